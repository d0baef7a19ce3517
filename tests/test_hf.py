"""Hugging Face GPT-2 in and out (prism_jax.hf) against a golden directory written by
transformers (tests/golden/hf_gpt2_tiny/NOTE.md says how and by which versions)."""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from prism_jax import hf
from prism_jax.config import preset
from prism_jax.model.ops import PAD_LOGIT
from prism_jax.loading import load_for_inference
from prism_jax.train import apply_overrides, train
from prism_jax.loading import load_params

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "hf_gpt2_tiny")
VOCAB = 1000  # the golden model's vocabulary; padded to 1024 rows here


def golden():
  return load_file(os.path.join(GOLDEN, "golden_logits.safetensors"))


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
  root = tmp_path_factory.mktemp("hf")
  hf.import_hf(GOLDEN, str(root / "dense"))
  hf.import_hf(GOLDEN, str(root / "prism"), "prism", num_prototypes=16, k=4)
  return root


def _logits(workdir, ids):
  model, cfg, tok = load_for_inference(workdir)
  return np.asarray(model(jnp.asarray(ids, jnp.int32)).logits_BxTxV), cfg, tok


def test_golden_logits_dense_twin_and_prism_backbone(imported):
  g = golden()
  dense, cfg, tok = _logits(str(imported / "dense"), g["input_ids"])
  assert cfg.model.vocab_size == 1024 and cfg.model.vocab_used == VOCAB
  assert tok.vocab_size == VOCAB and tok.kind == "gpt2"
  np.testing.assert_allclose(dense[..., :VOCAB], g["logits"], rtol=1e-5, atol=1e-5)
  assert np.all(dense[..., VOCAB:] == PAD_LOGIT)  # padding rows are never predicted
  assert np.all(dense.argmax(-1) < VOCAB)
  prism, pcfg, _ = _logits(str(imported / "prism"), g["input_ids"])
  assert pcfg.model.kind == "prism" and pcfg.model.num_prototypes == 16
  assert np.array_equal(prism, dense)  # W r + W z_hat = W z, to the bit


def test_export_then_import_is_bit_exact(imported, tmp_path):
  out = tmp_path / "exported"
  hf.export_hf(str(imported / "dense"), str(out))
  original, exported = load_file(os.path.join(GOLDEN, "model.safetensors")), load_file(
      str(out / "model.safetensors"))
  assert sorted(original) == sorted(exported)
  for name, x in original.items():
    assert np.array_equal(x, exported[name]), name
  cfg = json.loads((out / "config.json").read_text())
  assert cfg["vocab_size"] == VOCAB and cfg["model_type"] == "gpt2"
  hf.import_hf(str(out), str(tmp_path / "again"))
  _, a, _, _ = load_params(str(imported / "dense"))
  _, b, _, _ = load_params(str(tmp_path / "again"))
  for (path, x), (_, y) in zip(*(jax.tree_util.tree_leaves_with_path(jax.device_get(t))
                                 for t in (a, b))):
    assert np.array_equal(x, y), path
  assert (out / "tokenizer.json").is_file()


def test_prism_export_says_the_head_is_not_exported(imported, tmp_path):
  hf.export_hf(str(imported / "prism"), str(tmp_path / "p"))
  readme = (tmp_path / "p" / "README.md").read_text()
  assert "not part of this architecture" in readme and "GPT2LMHeadModel" in readme


def test_export_of_a_trained_dense_run_loads_back(tmp_path):
  rng = np.random.default_rng(3)
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("\n\n".join(" ".join(rng.choice(["for", "the", "mesh", "of"], 10))
                                for _ in range(80)))
  cfg = apply_overrides(preset("tiny"), [
      "model.kind=dense", "model.d_model=32", "model.n_layers=1", "model.n_heads=2",
      "model.vocab_size=258", "model.max_len=16", "data.tokenizer=byte", "data.seq_len=16",
      f"data.sources={corpus}", "train.batch_size=8", "train.steps=3", "train.warmup_steps=1",
      "train.eval_every=3", "train.eval_batches=1", "train.log_every=3"])
  train(cfg, str(tmp_path / "run"))
  hf.export_hf(str(tmp_path / "run"), str(tmp_path / "out"))
  assert "no Hugging Face tokenizer" in (tmp_path / "out" / "README.md").read_text()
  assert not (tmp_path / "out" / "tokenizer.json").exists()
  # No tokenizer files: import the weights beside the run's own tokenizer, as a user would.
  (tmp_path / "out" / "tokenizer.json").write_text(json.dumps(
      _byte_level_tokenizer(258)))
  hf.import_hf(str(tmp_path / "out"), str(tmp_path / "back"))
  ids = rng.integers(0, 258, (3, 16))
  want, _, _ = _logits(str(tmp_path / "run"), ids)
  got, back_cfg, _ = _logits(str(tmp_path / "back"), ids)
  assert back_cfg.model.vocab_size == 384 and back_cfg.model.vocab_used == 258
  assert np.array_equal(got[..., :258], want)


def _byte_level_tokenizer(vocab):
  """A minimal tokenizers BPE spec with `vocab` ids and <|endoftext|>."""
  from tokenizers import Tokenizer, models  # pylint: disable=g-import-not-at-top
  tok = Tokenizer(models.BPE(vocab={f"t{i}": i for i in range(vocab - 1)}, merges=[]))
  tok.add_special_tokens(["<|endoftext|>"])
  return json.loads(tok.to_str())


def _broken(tmp_path, edit_config=None, drop=None, reshape=None):
  src = tmp_path / "src"
  shutil.copytree(GOLDEN, src)
  if edit_config is not None:
    cfg = json.loads((src / "config.json").read_text())
    edit_config(cfg)
    (src / "config.json").write_text(json.dumps(cfg))
  if drop or reshape:
    tensors = load_file(str(src / "model.safetensors"))
    if drop:
      del tensors[drop]
    if reshape:
      tensors[reshape] = tensors[reshape][:-1].copy()
    save_file(tensors, str(src / "model.safetensors"))
  return src


BAD = {
    "missing weight": (dict(drop="transformer.h.1.mlp.c_fc.bias"),
                       "missing weight h.1.mlp.c_fc.bias"),
    "shape mismatch": (dict(reshape="transformer.wpe.weight"),
                       r"weight wpe.weight has shape \(127, 32\), expected \(128, 32\)"),
    "activation": (dict(edit_config=lambda c: c.update(activation_function="relu")),
                   "activation_function='relu' is not supported"),
    "layer-idx scaling": (dict(edit_config=lambda c: c.update(
        scale_attn_by_inverse_layer_idx=True)), "scale_attn_by_inverse_layer_idx=True"),
    "upcast": (dict(edit_config=lambda c: c.update(reorder_and_upcast_attn=True)),
               "reorder_and_upcast_attn=True"),
    "n_inner": (dict(edit_config=lambda c: c.update(n_inner=100)), "n_inner=100"),
    "unknown family": (dict(edit_config=lambda c: c.update(model_type="bert")),
                       "model_type='bert' is not supported"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_error_and_writes_nothing(tmp_path, case):
  kwargs, message = BAD[case]
  src = _broken(tmp_path, **kwargs)
  with pytest.raises(hf.HFFormatError, match=message):
    hf.import_hf(str(src), str(tmp_path / "target"))
  assert not (tmp_path / "target").exists()


def test_cli_errors_are_one_line_exit_2(tmp_path):
  """The command's form of the errors: a directory without config.json, an occupied target."""
  env = dict(os.environ, PYTHONPATH=os.getcwd())
  (tmp_path / "not_hf").mkdir()
  (tmp_path / "busy").mkdir()
  (tmp_path / "busy" / "keep.txt").write_text("mine")
  for args, message in (
      ([f"--hf_dir={tmp_path / 'not_hf'}", f"--workdir={tmp_path / 'w'}"], "no config.json"),
      ([f"--hf_dir={GOLDEN}", f"--workdir={tmp_path / 'busy'}"], "is not empty")):
    proc = subprocess.run([sys.executable, "-m", "prism_jax.cli", "import-hf"] + args, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], proc.stderr
  assert not (tmp_path / "w").exists()
  assert os.listdir(tmp_path / "busy") == ["keep.txt"]


@pytest.mark.transformers
def test_live_transformers_both_directions(tmp_path):
  """A random GPT-2 built now by transformers: imported logits match its forward; our
  export loads in transformers with the same logits (skipped without transformers)."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch.manual_seed(1)
  cfg = transformers.GPT2Config(vocab_size=300, n_positions=32, n_embd=32, n_layer=2, n_head=2)
  model = transformers.GPT2LMHeadModel(cfg).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(torch.randn_like(p) * 0.1)
  model.save_pretrained(tmp_path / "hf", safe_serialization=True)
  shutil.copy(os.path.join(GOLDEN, "tokenizer.json"), tmp_path / "hf")  # 1000 ids > 300
  (tmp_path / "hf" / "tokenizer.json").write_text(json.dumps(_byte_level_tokenizer(300)))
  ids = np.random.default_rng(0).integers(0, 300, (2, 20))
  with torch.no_grad():
    want = model(torch.from_numpy(ids)).logits.numpy()
  hf.import_hf(str(tmp_path / "hf"), str(tmp_path / "run"))
  got, _, _ = _logits(str(tmp_path / "run"), ids)
  np.testing.assert_allclose(got[..., :300], want, rtol=1e-5, atol=1e-5)
  hf.export_hf(str(tmp_path / "run"), str(tmp_path / "out"))
  back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
  with torch.no_grad():
    again = back(torch.from_numpy(ids)).logits.numpy()
  assert np.array_equal(again, want)
