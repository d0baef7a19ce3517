"""Training as users expect: a finished run trained longer, allowed changes on resume, eval
at step 0 with the train-split loss beside it, the whole val split, steady throughput."""

import math
import os
import shutil

import numpy as np
import pytest

from prism_jax.config import preset
from prism_jax.data import PackedData, pipeline
from prism_jax.train import ConfigMismatchError, apply_overrides, read_metrics, train
from prism_jax.train import metrics as metrics_lib
from test_checkpoint_bad_inputs import _corpus  # the same small word corpus

SETS = [
    "model.d_model=16", "model.n_layers=1", "model.n_heads=2", "model.num_prototypes=16",
    "model.k=2", "model.vocab_size=258", "model.max_len=16", "data.tokenizer=byte",
    "data.seq_len=16", "data.val_fraction=0.2", "train.batch_size=8", "train.lr=1e-2",
    "train.warmup_steps=10", "train.min_lr_ratio=0.1", "train.proto_init_step=5",
    "train.log_every=1", "train.eval_every=30", "train.ckpt_every=30", "train.eval_batches=2",
]


def _cfg(data, *extra):
  return apply_overrides(preset("tiny"), SETS + [f"data.sources={data}", *extra])


def _lr(step, peak, warmup, total, end_ratio):
  """Linear warm-up then cosine to peak * end_ratio at `total` (the documented schedule)."""
  if step < warmup:
    return peak * step / warmup
  end = peak * end_ratio
  return end + (peak - end) * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


@pytest.mark.long  # make test-long (issue 56 item 7): on the module's 30-step run, trained again
def test_finished_run_extends_with_the_new_schedule_and_the_same_data_order(tmp_path, run30,
                                                                            monkeypatch):
  data, finished = run30  # 30 steps done; trained longer here, to 60
  run = str(tmp_path / "run")
  shutil.copytree(finished, run)
  seen = []  # row ids of every batch the extended run trains on, in order
  real = pipeline.Loader.resume

  def recording_resume(self, state):
    for b in real(self, state):
      seen.append(np.asarray(b["row_id"]))
      yield b
  monkeypatch.setattr(pipeline.Loader, "resume", recording_resume)
  longer = _cfg(data, "train.steps=60", "train.eval_batches=0")
  result = train(longer, run)
  assert (result.start_step, result.final_step) == (30, 60)
  lrs = {r["step"]: r["lr"] for r in read_metrics(run) if r["step"] > 30}
  for done in range(31, 61):  # the record of step s (done = s + 1) holds lr(s)
    assert lrs[done] == pytest.approx(_lr(done - 1, 1e-2, 10, 60, 0.1), rel=1e-6)
  from prism_jax.data import make_loader  # pylint: disable=import-outside-toplevel
  loader = make_loader(PackedData(os.path.join(run, "data")), "train", 8, 0)
  assert len(seen) == 30
  for s, rows in zip(range(30, 60), seen):
    np.testing.assert_array_equal(rows, loader.global_batch_at(s)["row_id"])
  change = [r for r in read_metrics(run, "config_change")]
  assert change and change[0]["step"] == 30 and change[0]["train.steps"] == [30, 60]
  with pytest.raises(ConfigMismatchError, match="may grow on resume, not shrink"):
    train(_cfg(data, "train.steps=50", "train.eval_batches=0"), run)


@pytest.fixture(scope="module")
def run30(tmp_path_factory):
  """A finished 30-step run evaluated on the whole val split: (its corpus, its workdir).
  Tests that continue it work on a copy."""
  tmp = tmp_path_factory.mktemp("run30")
  data = _corpus(tmp / "c.txt", seed=5)
  train(_cfg(data, "train.steps=30", "train.eval_batches=0"), str(tmp / "run"))
  return data, str(tmp / "run")


@pytest.mark.long  # make test-long (issue 56 item 7): on the module's 30-step run, trained again
def test_allow_change_is_explicit_and_recorded(tmp_path, run30):
  data, finished = run30
  run = str(tmp_path / "run")
  shutil.copytree(finished, run)
  lower = _cfg(data, "train.steps=40", "train.lr=5e-3", "train.eval_batches=0")
  with pytest.raises(ConfigMismatchError, match="train.lr"):
    train(lower, run)
  with pytest.raises(ValueError, match="only these fields may change"):
    train(lower, run, allow_config_change=("train.seed",))
  result = train(lower, run, allow_config_change=("train.lr",))
  assert result.final_step == 40
  change = read_metrics(run, "config_change")[-1]
  assert change["step"] == 30 and change["train.lr"] == [1e-2, 5e-3]
  lr31 = [r["lr"] for r in read_metrics(run, "train") if r["step"] == 31][-1]
  assert lr31 == pytest.approx(_lr(30, 5e-3, 10, 40, 0.1), rel=1e-6)


@pytest.mark.long  # make test-long (issue 56 item 7): on the module's 30-step run, trained again
def test_eval_at_step_zero_train_loss_and_whole_split(run30):
  _, run = run30
  vals = read_metrics(run, "val")
  assert [r["step"] for r in vals] == [0, 30]
  packed = PackedData(os.path.join(run, "data"))
  val_rows = packed.rows("val")
  whole = int((val_rows["offset"][:, 1:] > 0).sum())  # the masked targets of the split
  for r in vals:
    assert r["tokens"] == whole and np.isfinite(r["train_loss"]) and r["train_tokens"] > 0
  assert vals[0]["loss"] > vals[1]["loss"] and vals[0]["train_loss"] > vals[1]["train_loss"]
  assert abs(vals[0]["loss"] - math.log(258)) < 1.0  # untrained: near-uniform predictions


def test_throughput_leaves_out_excluded_time(monkeypatch):
  clock = iter([0.0, 10.0, 10.0, 30.0, 30.0])  # start, read (+ restart), read (+ restart)
  monkeypatch.setattr(metrics_lib.time, "perf_counter", lambda: next(clock))
  thr = metrics_lib.Throughput(None, 0, tokens_per_step=100, num_devices=2)
  thr.start()
  for _ in range(4):
    thr.step()
  thr.exclude(6.0)  # e.g. an eval and a checkpoint save inside the window
  first = thr.read()
  assert first["steady_tokens_per_s"] == pytest.approx(400 / 4.0)
  assert first["steady_tokens_per_s_per_device"] == pytest.approx(50.0)
  assert first["excluded_s"] == 6.0
  for _ in range(2):
    thr.step()
  second = thr.read()
  assert second["steady_tokens_per_s"] == pytest.approx(200 / 20.0)
  assert thr.overall() == pytest.approx(600 / 24.0)
