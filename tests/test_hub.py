"""A PRISM run in the Hugging Face Hub's layout (`prism export --format=hub`) and back:
`prism_jax.load` of the directory, of a cache snapshot of it by hf://org/name with
HF_HUB_OFFLINE=1, logits bit for bit; transformers-layout backbone (the golden GPT-2's
tensor names); the model card's metadata; a partial directory and an uncached repository
are one line each."""

import json
import os
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import prism_jax
from prism_jax import hf
from prism_jax.config import preset
from prism_jax.hf import hub
from prism_jax.train import apply_overrides, train

WORDS = ["for", "while", "the", "of", "prototype", "token", "mesh", "<x>", "&amp;"]
SETS = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.num_prototypes=24",
        "model.k=4", "model.max_len=32", "data.seq_len=32", "model.vocab_size=300",
        "data.val_fraction=0.1", "train.batch_size=8", "train.steps=4", "train.warmup_steps=1",
        "train.proto_init_step=1", "train.eval_every=4", "train.eval_batches=1",
        "train.log_every=2", "model.mixture_scale=learned"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  root = tmp_path_factory.mktemp("hub")
  rng = np.random.default_rng(3)
  (root / "corpus.txt").write_text("\n\n".join(" ".join(rng.choice(WORDS, 14))
                                               for _ in range(120)))
  cfg = apply_overrides(preset("tiny"), SETS + [f"data.sources={root / 'corpus.txt'}"])
  train(cfg, str(root / "run"))
  hub.export_hub(str(root / "run"), str(root / "out"))
  return root


def _logits(run, ids):
  return np.asarray(run.model(jnp.asarray(ids, jnp.int32)).logits_BxTxV)


def test_export_then_load_is_bit_exact_and_transformers_shaped(exported):
  root = exported
  want = prism_jax.load(str(root / "run"))
  got = prism_jax.load(str(root / "out"))
  ids = np.random.default_rng(0).integers(0, 300, (3, 32))
  assert np.array_equal(_logits(got, ids), _logits(want, ids))
  assert got.config == want.config
  assert got.tokenizer.encode("the prototype mesh") == want.tokenizer.encode("the prototype mesh")
  names = set(load_file(str(root / "out" / "model.safetensors")))
  assert "transformer.h.1.attn.c_attn.weight" in names and not any("bank" in n for n in names)
  head = load_file(str(root / "out" / hub.HEAD_FILE))
  assert set(head) == {"bank.protos", "mix_log_scale"}
  cfg = json.loads((root / "out" / "config.json").read_text())
  assert cfg["model_type"] == "gpt2" and cfg["prism_jax"]["model"]["num_prototypes"] == 24
  card = (root / "out" / "README.md").read_text()
  meta = card.split("---")[1]
  assert "library_name: prism_jax" in meta and "- gpt2" in meta
  assert "agreement" in card and "val CE" in card


def test_hf_scheme_reads_the_cache_snapshot_offline(exported, tmp_path, monkeypatch):
  cache = tmp_path / "hub_cache"
  snap = cache / "models--someone--tiny-prism" / "snapshots" / "0123abcd"
  shutil.copytree(exported / "out", snap)
  (cache / "models--someone--tiny-prism" / "refs").mkdir()
  (cache / "models--someone--tiny-prism" / "refs" / "main").write_text("0123abcd")
  monkeypatch.setenv("HF_HUB_CACHE", str(cache))
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  run = prism_jax.load("hf://someone/tiny-prism")
  assert os.path.realpath(run.workdir) == os.path.realpath(snap)
  ids = np.random.default_rng(1).integers(0, 300, (2, 32))
  assert np.array_equal(_logits(run, ids), _logits(prism_jax.load(str(exported / "out")), ids))
  with pytest.raises(hf.HFFormatError, match="not in the local Hugging Face cache"):
    prism_jax.load("hf://someone/absent")


@pytest.mark.parametrize("drop, message", [
    ("prism_head.safetensors", "lacks prism_head.safetensors"),
    ("prism_tokenizer.json", "lacks prism_tokenizer.json"),
    ("model.safetensors", "lacks model.safetensors")])
def test_a_partial_directory_is_one_line_naming_what_is_missing(exported, tmp_path, drop,
                                                               message):
  broken = tmp_path / "broken"
  shutil.copytree(exported / "out", broken)
  os.remove(broken / drop)
  with pytest.raises(hf.HFFormatError, match=message):
    prism_jax.load(str(broken))


def test_the_command_writes_it_and_refuses_an_occupied_target(exported, tmp_path):
  env = dict(os.environ, PYTHONPATH=os.getcwd(), JAX_PLATFORMS="cpu")
  out = tmp_path / "cli_out"
  ok = subprocess.run([sys.executable, "-m", "prism_jax.cli", "export", "--format=hub",
                       f"--workdir={exported / 'run'}", f"--out={out}"], env=env,
                      capture_output=True, text=True, timeout=300)
  assert ok.returncode == 0, ok.stderr[-2000:]
  assert hub.is_hub_dir(str(out))
  again = subprocess.run([sys.executable, "-m", "prism_jax.cli", "export", "--format=hub",
                          f"--workdir={exported / 'run'}", f"--out={out}"], env=env,
                         capture_output=True, text=True, timeout=300)
  errors = [ln for ln in again.stderr.splitlines() if ln.startswith("error:")]
  assert again.returncode == 2 and len(errors) == 1 and "is not empty" in errors[0]
