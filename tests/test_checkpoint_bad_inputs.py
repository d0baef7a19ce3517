"""Bad inputs to training: each a clear error, and nothing already saved is lost.

config != checkpoint, corrupt latest checkpoint (falls back to the previous one), NaN loss
(the last good checkpoint survives), missing / empty data. Also: a checkpoint restores
bit-exactly (into this 8-device mesh) and `load_for_inference` reads it back.
"""

import filecmp
import json
import logging
import os
import shutil

import jax
import numpy as np
import pytest

from prism_jax.config import preset
from prism_jax.loading import load_for_inference
from prism_jax.train import (Checkpointer, ConfigMismatchError, TrainingDivergedError,
                             apply_overrides, load_params, read_metrics, train)

SETS = [
    "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.num_prototypes=16",
    "model.k=4", "model.vocab_size=258", "model.max_len=16", "data.tokenizer=byte",
    "data.seq_len=16", "data.val_fraction=0", "train.batch_size=8", "train.steps=4",
    "train.warmup_steps=1", "train.proto_init_step=0", "train.ckpt_every=2",
    "train.log_every=1", "train.eval_every=1000",
]


def _corpus(path, seed=0):
  rng = np.random.default_rng(seed)
  words = ["alpha", "beta", "gamma", "delta", "the", "of", "prototype", "token", "mesh"]
  path.write_text("\n\n".join(" ".join(rng.choice(words, 10)) for _ in range(300)))
  return str(path)


def _cfg(data, *extra):
  return apply_overrides(preset("tiny"), SETS + [f"data.sources={data}", *extra])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  root = tmp_path_factory.mktemp("bad_inputs")
  data = _corpus(root / "corpus.txt")
  cfg = _cfg(data)
  result = train(cfg, str(root / "run"))
  assert result.final_step == 4
  return cfg, str(root / "run"), data


def _copy(src, tmp_path):
  dst = str(tmp_path / "copy")
  shutil.copytree(src, dst)
  return dst


def _tree_equal(a, b):
  return all(np.array_equal(np.asarray(x), np.asarray(y))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_checkpoints_written_and_restorable(trained):
  cfg, workdir, _ = trained
  assert Checkpointer(workdir, read_only=True).all_steps() == [2, 4]
  assert os.path.isfile(os.path.join(workdir, "config.json"))
  assert os.listdir(os.path.join(workdir, "tb"))  # TensorBoard event file
  losses = [r["loss"] for r in read_metrics(workdir)]
  assert len(losses) == 4 and all(np.isfinite(losses))
  model, cfg2, tok = load_for_inference(workdir)
  assert cfg2 == cfg
  assert tok.decode(tok.encode("alpha beta")) == "alpha beta"
  _, params, _, step = load_params(workdir)
  assert step == 4
  assert np.array_equal(np.asarray(model.bank.protos[...]),
                        np.asarray(params["bank"]["protos"]))


def test_dense_run_is_refused_where_prototypes_are_needed(trained, tmp_path):
  _, workdir, _ = trained
  model, _, _ = load_for_inference(workdir, needs_prototypes="a report")  # a PRISM run passes
  assert hasattr(model, "bank")
  run = _copy(workdir, tmp_path)
  path = os.path.join(run, "config.json")
  saved = json.load(open(path))
  saved["model"]["kind"] = "dense"
  json.dump(saved, open(path, "w"))
  with pytest.raises(ValueError, match=r"is a dense run \(model.kind='dense'\): a report "
                     "needs prototypes"):
    load_for_inference(run, needs_prototypes="a report")


def test_config_mismatch_is_refused_naming_fields(trained, tmp_path):
  cfg, workdir, data = trained
  run = _copy(workdir, tmp_path)
  before = open(os.path.join(run, "config.json")).read()
  with pytest.raises(ConfigMismatchError) as e:
    train(_cfg(data, "model.k=2", "train.lr=0.01"), run)
  msg = str(e.value)
  assert "model.k: checkpoint 4, requested 2" in msg
  assert "train.lr: checkpoint 0.003, requested 0.01" in msg
  assert Checkpointer(run, read_only=True).all_steps() == [2, 4]
  assert open(os.path.join(run, "config.json")).read() == before
  assert filecmp.dircmp(os.path.join(workdir, "checkpoints"),
                        os.path.join(run, "checkpoints")).diff_files == []


@pytest.mark.long  # make test-long (issue 56 item 7): test_faults checks the fall-back in-process
def test_corrupt_latest_checkpoint_falls_back_to_previous(trained, tmp_path, caplog):
  cfg, workdir, _ = trained
  run = _copy(workdir, tmp_path)
  params_dir = os.path.join(run, "checkpoints", "4", "params")
  for root, _, files in os.walk(params_dir):  # garble every byte of the saved arrays
    for name in files:
      with open(os.path.join(root, name), "wb") as f:
        f.write(b"\x00garbage")
  with caplog.at_level(logging.ERROR):
    result = train(cfg, run)
  assert result.start_step == 2 and result.final_step == 4
  assert any("checkpoint 4" in r.getMessage() and "unreadable" in r.getMessage()
             for r in caplog.records)
  moved = os.listdir(os.path.join(run, "corrupt_checkpoints"))
  assert len(moved) == 1 and moved[0].startswith("4-")  # kept for inspection, not deleted
  # re-trained steps 3..4 from checkpoint 2 reproduce the original run exactly
  want = {r["step"]: r["loss"] for r in read_metrics(workdir)}
  got = {r["step"]: r["loss"] for r in read_metrics(run)}
  assert got == want


def test_nan_loss_stops_and_keeps_last_good_checkpoint(trained, tmp_path):
  cfg, workdir, data = trained
  run = _copy(workdir, tmp_path)
  _, good_params, _, _ = load_params(run)
  bad = _cfg(data, "train.lr=1e30", "train.steps=10", "train.ckpt_every=1")
  with pytest.raises(TrainingDivergedError) as e:
    train(bad, run, allow_config_change=("train.lr", "train.steps"))
  msg = str(e.value)
  assert "diverged at step" in msg and "not saved" in msg
  bad_step = int(msg.split("diverged at step ")[1].split(":")[0])
  assert 5 <= bad_step <= 10
  steps = Checkpointer(run, read_only=True).all_steps()
  assert 4 in steps and max(steps) < bad_step  # no checkpoint of the bad state
  assert f"Last good checkpoint: step {max(steps)}" in msg
  # checkpoint 4 is untouched
  _, params4, _, _ = load_params(run, step=4)
  assert _tree_equal(params4, good_params)


def test_missing_and_empty_data_are_clear_errors(tmp_path):
  with pytest.raises((FileNotFoundError, ValueError)) as e:
    train(_cfg(str(tmp_path / "nope" / "*.txt")), str(tmp_path / "w1"))
  assert "nope" in str(e.value)
  empty = tmp_path / "empty.txt"
  empty.write_text("")
  with pytest.raises(ValueError) as e:
    train(_cfg(str(empty)), str(tmp_path / "w2"))
  assert "empty" in str(e.value).lower() or "no " in str(e.value).lower()
  for w in ("w1", "w2"):
    assert not os.path.exists(os.path.join(tmp_path, w, "checkpoints", "1"))
