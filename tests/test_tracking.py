"""train.log_to=wandb (offline, no network): the tracked history holds metrics.jsonl's
scalars and the prototype-usage histogram of each eval, and a resumed run appends to the
same W&B run id; a missing extra is one line."""

import glob
import json
import os
import sys

import numpy as np
import pytest

from prism_jax.config import preset
from prism_jax.train import apply_overrides, train

import wandb_offline

pytest.importorskip("wandb")
WORDS = ["for", "while", "the", "of", "prototype", "token", "mesh", "return", "def"]


def _cfg(tmp_path, steps):
  if not (tmp_path / "c.txt").exists():
    rng = np.random.default_rng(4)
    (tmp_path / "c.txt").write_text("\n\n".join(" ".join(rng.choice(WORDS, 12))
                                                for _ in range(60)))
  return apply_overrides(preset("tiny"), [
      "model.d_model=16", "model.n_layers=1", "model.n_heads=2", "model.num_prototypes=16",
      "model.k=2", "model.vocab_size=258", "model.max_len=16", "data.tokenizer=byte",
      "data.seq_len=16", "data.val_fraction=0.1", "train.batch_size=8", f"train.steps={steps}",
      "train.warmup_steps=1", "train.proto_init_step=1", "train.eval_every=2",
      "train.eval_batches=1", "train.ckpt_every=2", "train.log_every=1",
      "train.log_to=tensorboard,wandb", f"data.sources={tmp_path / 'c.txt'}"])


@pytest.mark.long  # ~30-45 s: `make test-long`
def test_wandb_offline_history_holds_the_metrics_and_a_resume_continues_the_run(
    tmp_path, monkeypatch):
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  run = tmp_path / "run"
  train(_cfg(tmp_path, 4), str(run))  # evals at steps 2 and 4 (and 0)
  train(_cfg(tmp_path, 6), str(run))  # resumed: steps 5-6, eval at 6
  files = sorted(glob.glob(str(run / "wandb" / "offline-run-*" / "run-*.wandb")))
  assert len(files) == 2
  runs = [wandb_offline.read_run(f) for f in files]
  run_id = (run / "wandb_run_id").read_text().strip()
  assert [r for r, _ in runs] == [run_id, run_id]  # one tracked run across the resume
  history = {}
  for _, rows in runs:
    for row in rows:
      for k, v in row.items():
        if not k.startswith("_"):
          history[(row["_step"], k)] = v
  records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  assert {r["split"] for r in records} >= {"train", "val"}
  checked = 0
  for r in records:
    for k, v in r.items():
      if k in ("step", "split") or not isinstance(v, (int, float)):
        continue
      assert history[(r["step"], f"{r['split']}/{k}")] == pytest.approx(v, rel=1e-6), (r, k)
      checked += 1
  assert checked > 20 and max(s for s, _ in history) == 6
  _check_usage_histograms(run, runs)


def _check_usage_histograms(run, runs):
  """At each eval the tracked run gets the report's usage plot: log10(1 + tokens selecting
  each prototype) as a histogram; the last equals one recomputed from a plain forward of the
  final model over the same val batch (top-k ids counted in NumPy)."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from prism_jax import data as data_lib  # pylint: disable=import-outside-toplevel
  from prism_jax.loading import load_for_inference  # pylint: disable=import-outside-toplevel
  key = "val/prototype_usage/"  # the reader flattens W&B's nested histogram value
  hists = {row["_step"]: {k[len(key):]: v for k, v in row.items() if k.startswith(key)}
           for _, rows in runs for row in rows if key + "values" in row}
  assert sorted(hists) == [0, 2, 4, 6]  # every eval (0: the untrained model)
  model, cfg, _ = load_for_inference(str(run))
  packed = data_lib.prepare_data(cfg.data, cfg.model.vocab_size, str(run))
  b = data_lib.make_loader(packed, "val", cfg.train.batch_size, cfg.data.seed).batch_at(0)
  out = model(jnp.asarray(b["inputs"]), mask_BxT=jnp.asarray(b["mask"]))
  idx = np.asarray(out.protos.idx_Nxk)[np.asarray(b["mask"]).reshape(-1)]
  usage = np.bincount(idx.reshape(-1), minlength=cfg.model.num_prototypes)
  counts, edges = np.histogram(np.log10(1.0 + usage), bins=32)
  h = hists[6]
  assert h["_type"] == "histogram" and sum(h["values"]) == cfg.model.num_prototypes
  np.testing.assert_array_equal(h["values"], counts)
  np.testing.assert_allclose(h["bins"], edges, rtol=1e-6)


def test_wandb_without_the_extra_is_one_clear_error(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
  with pytest.raises(ModuleNotFoundError, match=r"wandb extra: pip install 'prism_jax\[wandb\]'"):
    train(_cfg(tmp_path, 2), str(tmp_path / "run"))
  assert not os.path.exists(tmp_path / "run" / "checkpoints" / "2")


def test_an_unknown_tracker_is_refused_by_the_config():
  with pytest.raises(ValueError, match="train.log_to"):
    apply_overrides(preset("tiny"), ["train.log_to=tensorboard,mlflow"])
