"""The shared trainer (prism_jax.train.engine) on losses other than the model's own.

A linear probe on frozen random features is trained over a parameter subset and checked
against a hand-written optax loop on the probe alone; a checkpointed run resumed half way
equals an uninterrupted one bit for bit; a NaN loss stops the run before anything bad is
saved; a PrismLM trained through it on the bank only moves nothing but the bank.
"""

import json
import os
import secrets

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from prism_jax.config import LossConfig, model_preset
from prism_jax.losses import total_loss
from prism_jax.model.lm import build_model
from prism_jax.train import ConfigMismatchError, Trainer, TrainingDivergedError

D_IN, D_FEAT, ROWS, STEPS = 6, 5, 16, 8
PROBE = lambda path: path[0] == "probe"


def _params(seed):
  rng = np.random.default_rng(seed)
  f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  return {"features": {"w": f32(D_IN, D_FEAT), "b": f32(D_FEAT)},
          "probe": {"w": 0.1 * f32(D_FEAT), "b": jnp.zeros((), jnp.float32)}}


def _batches(seed, steps=STEPS):
  rng = np.random.default_rng(seed + 1)
  out = []
  for _ in range(steps):
    x = rng.normal(size=(ROWS, D_IN)).astype(np.float32)
    out.append({"x": x, "y": (x[:, 0] > 0).astype(np.float32)})
  return out


def _probe_loss(params, batch):
  feats = jnp.tanh(batch["x"] @ params["features"]["w"] + params["features"]["b"])
  pred = feats @ params["probe"]["w"] + params["probe"]["b"]
  mse = jnp.mean((pred - batch["y"]) ** 2)
  return mse, {"mse": mse}


def _reference(params, batches, tx):
  """A plain optax loop over the probe only, the features closed over."""
  probe, opt = params["probe"], tx.init(params["probe"])
  for b in batches:
    loss = lambda p: _probe_loss({"features": params["features"], "probe": p}, b)[0]
    grads = jax.grad(loss)(probe)
    updates, opt = tx.update(grads, opt, probe)
    probe = optax.apply_updates(probe, updates)
  return probe


def _assert_trees_equal(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def test_probe_trains_only_the_subset_like_a_plain_optax_loop():
  seed = secrets.randbits(16)
  params, batches, tx = _params(seed), _batches(seed), optax.adam(3e-2)
  want = _reference(params, batches, tx)
  out = Trainer(_probe_loss, tx, trainable=PROBE).fit(params, batches, steps=STEPS,
                                                      tokens_per_step=ROWS)
  assert out.final_step == STEPS and int(out.state.step) == STEPS
  _assert_trees_equal(out.state.params["features"], params["features"])  # frozen, untouched
  jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7,
                                                       err_msg=f"seed {seed}"),
               out.state.params["probe"], want)
  assert not np.allclose(out.state.params["probe"]["w"], params["probe"]["w"])
  assert set(out.train) >= {"loss", "mse", "grad_norm", "steady_tokens_per_s"}
  assert out.train["loss"] == out.train["mse"] and "tflops_per_s" not in out.train
  # The optimiser state covers the probe alone.
  opt_paths = [jax.tree_util.keystr(p) for p, _ in
               jax.tree_util.tree_leaves_with_path(out.state.opt_state)]
  assert opt_paths and not any("features" in p for p in opt_paths), opt_paths


def _losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {r["step"]: r["loss"] for r in map(json.loads, f) if r["split"] == "train"}


def test_checkpoint_and_resume_is_exact(tmp_path):
  seed = secrets.randbits(16)
  params, batches, tx = _params(seed), _batches(seed), optax.adam(3e-2)
  trainer = Trainer(_probe_loss, tx, trainable=PROBE)
  config = {"lr": 3e-2, "seed": seed}
  ref = trainer.fit(params, batches, steps=STEPS, workdir=str(tmp_path / "ref"),
                    ckpt_every=3, log_every=1, config=config)
  run = str(tmp_path / "run")
  half = trainer.fit(params, batches, steps=STEPS // 2, workdir=run, ckpt_every=3,
                     log_every=1, config=config)
  assert half.checkpoint_step == STEPS // 2
  resumed = trainer.fit(params, batches, steps=STEPS, workdir=run, ckpt_every=3,
                        log_every=1, config=config)
  assert (resumed.start_step, resumed.final_step, resumed.checkpoint_step) == (
      STEPS // 2, STEPS, STEPS)
  _assert_trees_equal(resumed.state.params, ref.state.params)
  _assert_trees_equal(resumed.state.opt_state, ref.state.opt_state)
  want, got = _losses(str(tmp_path / "ref")), _losses(run)
  assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
  assert all(np.float32(got[s]).tobytes() == np.float32(want[s]).tobytes() for s in want)
  assert sorted(int(d) for d in os.listdir(os.path.join(run, "checkpoints"))
                if d.isdigit()) == [3, 4, 6, 8][-3:]
  with pytest.raises(ConfigMismatchError, match=r"lr: checkpoint 0.03, requested 0.1"):
    trainer.fit(params, batches, steps=STEPS, workdir=run, config={**config, "lr": 0.1})


def test_nan_loss_stops_before_saving_the_bad_state(tmp_path):
  seed = secrets.randbits(16)
  params, batches = _params(seed), _batches(seed)
  batches[5]["x"] = np.full_like(batches[5]["x"], np.nan)  # step 6 sees a NaN batch
  run = str(tmp_path / "run")
  with pytest.raises(TrainingDivergedError, match=r"diverged at step 6: non-finite loss"
                     r".*Last good checkpoint: step 4 in") as err:
    Trainer(_probe_loss, optax.adam(3e-2), trainable=PROBE).fit(
        params, batches, steps=STEPS, workdir=run, ckpt_every=2)
  assert "not saved" in str(err.value)
  saved = sorted(int(d) for d in os.listdir(os.path.join(run, "checkpoints")) if d.isdigit())
  assert saved == [2, 4]


def test_bad_inputs_are_refused():
  with pytest.raises(ValueError, match="trainable selects no parameter"):
    Trainer(_probe_loss, optax.adam(1e-2), trainable=lambda p: p[0] == "nope").fit(
        _params(0), _batches(0), steps=1)
  with pytest.raises(TypeError, match="params must be a nested dict"):
    Trainer(_probe_loss, optax.adam(1e-2)).fit([1.0], _batches(0), steps=1)
  with pytest.raises(ValueError, match="the batches ran out after 2 of 3 steps"):
    Trainer(_probe_loss, optax.adam(1e-2)).fit(_params(0), _batches(0, steps=2), steps=3)


def test_prism_lm_bank_only():
  seed = secrets.randbits(16)
  cfg = model_preset("tiny", vocab_size=32, max_len=8, d_model=16, n_layers=1, n_heads=2,
                     num_prototypes=8, k=2)
  graphdef, state = nnx.split(build_model(cfg, seed))
  params = nnx.to_pure_dict(state)
  rng = np.random.default_rng(seed)

  def loss_fn(p, batch):
    out = nnx.merge(graphdef, p)(batch["inputs"], mask_BxT=batch["mask"])
    return total_loss(out, batch["targets"], batch["mask"], LossConfig())

  def batch():
    tok = rng.integers(0, 32, (4, 9)).astype(np.int32)
    return {"inputs": tok[:, :-1], "targets": tok[:, 1:], "mask": np.ones((4, 8), bool)}

  out = Trainer(loss_fn, optax.adam(1e-2), trainable=lambda p: p[:2] == ("bank", "protos")
                ).fit(params, [batch() for _ in range(3)], steps=3)
  moved = {jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_leaves_with_path(
      jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))),
                   out.state.params, params)) if x}
  assert moved == {"['bank']['protos']"}, (seed, moved)
