"""Retrofit (train.init_from): PRISM's bank on a trained dense twin. With the backbone
frozen (train.trainable=prototypes) the full logits stay the dense model's to the bit and
only the head's parameters change."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prism_jax.config import preset
from prism_jax.loading import load_for_inference
from prism_jax.train import apply_overrides, train
from prism_jax.loading import load_params
from prism_jax.train.optimizer import make_optimizer
from prism_jax.train.state import init_fn

WORDS = ["for", "while", "the", "of", "prototype", "token", "mesh", "<x>", "&amp;"]
SETS = [
    "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.num_prototypes=16",
    "model.k=4", "model.vocab_size=258", "model.max_len=32", "data.tokenizer=byte",
    "data.seq_len=32", "data.val_fraction=0.1", "train.batch_size=8", "train.steps=6",
    "train.warmup_steps=1", "train.ckpt_every=3", "train.log_every=3", "train.eval_every=3",
    "train.eval_batches=1",
]


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory):
  root = tmp_path_factory.mktemp("retrofit")
  rng = np.random.default_rng(5)
  corpus = root / "corpus.txt"
  corpus.write_text("\n\n".join(" ".join(rng.choice(WORDS, 12)) for _ in range(120)))
  sets = SETS + [f"data.sources={corpus}"]
  train(apply_overrides(preset("tiny"), sets + ["model.kind=dense"]), str(root / "dense"))
  return root, sets


def _leaves(tree):
  return jax.tree_util.tree_leaves_with_path(jax.device_get(tree))


def test_frozen_retrofit_keeps_the_dense_logits_bit_for_bit(dense_run):
  root, sets = dense_run
  dense_dir, run = str(root / "dense"), str(root / "frozen")
  cfg = apply_overrides(preset("tiny"), sets + [
      f"train.init_from={dense_dir}", "train.trainable=prototypes", "train.proto_init_step=0"])
  result = train(cfg, run)
  assert np.isfinite(result.eval["loss"]) and "agreement_decisive" in result.eval
  _, dense_params, _, _ = load_params(dense_dir)
  _, mid, _, _ = load_params(run, step=3)
  _, end, _, _ = load_params(run, step=6)
  for (path, a), (_, b), (_, c) in zip(_leaves(dense_params["backbone"]),
                                       _leaves(mid["backbone"]), _leaves(end["backbone"])):
    assert np.array_equal(a, b) and np.array_equal(a, c), path  # frozen: every bit
  assert not np.array_equal(np.asarray(mid["bank"]["protos"]), np.asarray(end["bank"]["protos"]))
  dense, _, _ = load_for_inference(dense_dir)
  prism, _, _ = load_for_inference(run)
  toks = jnp.asarray(np.random.default_rng(0).integers(0, 258, (4, 32)), jnp.int32)
  want = np.asarray(dense(toks).logits_BxTxV)
  assert np.array_equal(np.asarray(prism(toks).logits_BxTxV), want)
  jitted = [jax.jit(lambda t, m=m: m(t).logits_BxTxV)(toks) for m in (dense, prism)]
  assert np.array_equal(np.asarray(jitted[1]), np.asarray(jitted[0]))  # compiled alike


def test_one_run_retrofit_trains_the_backbone_until_the_bank_is_set(dense_run, tmp_path):
  """trainable=prototypes without init_from: the dense warm-up trains the backbone, which is
  then frozen from the bank's setting on (the tiny preset's recipe)."""
  _, sets = dense_run
  run = str(tmp_path / "one_run")
  cfg = apply_overrides(preset("tiny"), sets + [
      "train.trainable=prototypes", "train.proto_init_step=3"])
  assert np.isfinite(train(cfg, run).eval["agreement"])
  _, mid, _, _ = load_params(run, step=3)
  _, end, _, _ = load_params(run, step=6)
  init = jax.device_get(nnx_init_params(cfg))  # step 0
  moved = [not np.array_equal(a, b) for (_, a), (_, b) in
           zip(_leaves(init["backbone"]), _leaves(mid["backbone"]))]
  assert sum(moved) > len(moved) // 2  # the warm-up trained the backbone
  for (path, b), (_, c) in zip(_leaves(mid["backbone"]), _leaves(end["backbone"])):
    assert np.array_equal(b, c), path  # frozen from the bank's setting on
  assert not np.array_equal(np.asarray(mid["bank"]["protos"]), np.asarray(end["bank"]["protos"]))


def nnx_init_params(cfg):
  """The run's step-0 parameters (a pure function of train.seed)."""
  return init_fn(cfg, make_optimizer(cfg.train))().params


def test_full_retrofit_trains_the_backbone(dense_run):
  root, sets = dense_run
  cfg = apply_overrides(preset("tiny"), sets + [
      f"train.init_from={root / 'dense'}", "train.proto_init_step=0"])
  train(cfg, str(root / "full"))
  _, dense_params, _, _ = load_params(str(root / "dense"))
  _, end, _, _ = load_params(str(root / "full"))
  assert not np.array_equal(np.asarray(dense_params["backbone"]["wte"]),
                            np.asarray(end["backbone"]["wte"]))


@pytest.mark.parametrize("bad, match", [
    (["model.d_model=16"], "model.d_model"),
    (["data.tokenizer=char"], "tokenizer"),
])
def test_mismatched_source_is_refused(dense_run, bad, match):
  root, sets = dense_run
  cfg = apply_overrides(preset("tiny"), sets + bad + [f"train.init_from={root / 'dense'}",
                                                     "train.proto_init_step=0"])
  with pytest.raises(ValueError, match=match):
    train(cfg, str(root / f"bad_{match}"))
  ckpts = root / f"bad_{match}" / "checkpoints"
  assert not ckpts.exists() or not list(ckpts.iterdir())  # no checkpoint written


@pytest.mark.parametrize("pick, kmeans_pp", [("kmeans++", True), ("uniform", False)])
def test_proto_init_pick_reaches_the_bank_init(dense_run, tmp_path, monkeypatch, pick, kmeans_pp):
  """model.proto_init_pick chooses k-means++ seeding or a uniform draw of the candidates."""
  from prism_jax.model import lm  # pylint: disable=g-import-not-at-top
  from prism_jax.train import recipe  # pylint: disable=g-import-not-at-top
  seen = []
  real = lm.init_prototypes_from_hidden

  def spy(*args, **kwargs):
    seen.append(kwargs["kmeans_pp"])
    return real(*args, **kwargs)

  monkeypatch.setattr(recipe, "init_prototypes_from_hidden", spy)
  _, sets = dense_run
  cfg = apply_overrides(preset("tiny"), sets + [f"model.proto_init_pick={pick}",
                                                "train.proto_init_step=2", "train.steps=3"])
  train(cfg, str(tmp_path / "run"))
  assert seen == [kmeans_pp]
