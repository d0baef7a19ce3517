"""grain pipeline: batch contract, batch(seed, step) purity, epochs, sharding, resume."""

import json
import pickle

import numpy as np
import pytest

from prism_jax.config import DataConfig
from prism_jax.data import make_loader, prepare_data

T = 8
KEYS = ("inputs", "targets", "mask", "example_id", "offset", "row_id")


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("pipe")
  rng = np.random.default_rng(0)
  words = ["one", "two", "three", "ünï", "코드", "x"]
  with open(tmp / "c.jsonl", "w", encoding="utf-8") as f:
    for _ in range(60):
      text = " ".join(rng.choice(words, size=int(rng.integers(1, 12))))
      f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
  cfg = DataConfig(sources=(str(tmp / "c.jsonl"),), tokenizer="byte", seq_len=T,
                   val_fraction=0.2, seed=0)
  return prepare_data(cfg, 258, str(tmp))


def assert_batches_equal(a, b):
  assert set(a) == set(b) == set(KEYS)
  for k in KEYS:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_batch_contract(packed):
  loader = make_loader(packed, "train", 12, seed=5)
  rows = packed.rows("train")
  b = loader.batch_at(3)
  for k in KEYS:
    assert b[k].shape == ((12,) if k == "row_id" else (12, T)), k
  assert b["mask"].dtype == bool
  assert all(b[k].dtype == np.int32 for k in KEYS if k != "mask")
  r = b["row_id"]
  np.testing.assert_array_equal(b["inputs"], rows["tokens"][r, :-1])
  np.testing.assert_array_equal(b["targets"], rows["tokens"][r, 1:])
  np.testing.assert_array_equal(b["example_id"], rows["example_id"][r, 1:])
  np.testing.assert_array_equal(b["offset"], rows["offset"][r, 1:])
  # Mask, from first principles: the target is a real token and its input is a token of
  # the same document (not the EOS that ended the previous one).
  eid_in = rows["example_id"][r, :-1]
  expected = (b["example_id"] >= 0) & (eid_in == b["example_id"])
  np.testing.assert_array_equal(b["mask"], expected)
  assert not b["mask"][b["inputs"] == packed.eos_id].any()
  assert b["mask"].any() and not b["mask"].all()


def test_batch_at_is_pure_and_history_free(packed):
  rng = np.random.default_rng(1)
  a = make_loader(packed, "train", 8, seed=7)
  steps = rng.integers(0, 200, 12).tolist()
  first = {s: a.batch_at(s) for s in steps}
  for _ in zip(range(25), a.iterate(0)):  # some iteration history in between
    pass
  b = make_loader(packed, "train", 8, seed=7)
  for s in rng.permutation(steps).tolist():
    assert_batches_equal(b.batch_at(s), first[s])
    assert_batches_equal(a.batch_at(s), first[s])
  c = make_loader(packed, "train", 8, seed=8)
  assert not np.array_equal(c.batch_at(steps[0])["row_id"], first[steps[0]]["row_id"])


def test_iterate_and_resume_match_batch_at(packed):
  loader = make_loader(packed, "train", 8, seed=2)
  start = 17
  it = loader.iterate(start)
  for s in range(start, start + 6):
    assert_batches_equal(next(it), loader.batch_at(s))
  state = loader.state(start + 6)
  assert state == {"step": start + 6, "seed": 2}
  fresh = make_loader(packed, "train", 8, seed=2)
  resumed = fresh.resume(json.loads(json.dumps(state)))
  for s in range(start + 6, start + 9):
    assert_batches_equal(next(resumed), loader.batch_at(s))
  with pytest.raises(ValueError, match="saved with seed 2, this loader uses seed 3"):
    make_loader(packed, "train", 8, seed=3).resume(state)


def test_epochs_are_permutations_of_all_rows(packed):
  R = packed.num_rows("train")
  B = 7
  assert R % B  # batches straddle epoch boundaries
  loader = make_loader(packed, "train", B, seed=4)
  n_steps = -(-3 * R // B)
  ids = np.concatenate([loader.batch_at(s)["row_id"] for s in range(n_steps)])
  epochs = [ids[e * R:(e + 1) * R] for e in range(3)]
  for e in epochs:
    np.testing.assert_array_equal(np.sort(e), np.arange(R))
  assert not np.array_equal(epochs[0], epochs[1])
  assert not np.array_equal(epochs[0], np.arange(R))


@pytest.mark.parametrize("P", [2, 4])
def test_process_slices_make_the_global_batch(packed, P):
  ref = make_loader(packed, "train", 8, seed=9)
  loaders = [make_loader(packed, "train", 8, seed=9, process_index=p, process_count=P)
             for p in range(P)]
  for s in (0, 5, 33):
    parts = [l.batch_at(s) for l in loaders]
    assert all(part["inputs"].shape == (8 // P, T) for part in parts)
    union = {k: np.concatenate([part[k] for part in parts]) for k in KEYS}
    assert_batches_equal(union, ref.batch_at(s))
    assert_batches_equal(loaders[1].global_batch_at(s), ref.batch_at(s))
  it = loaders[P - 1].iterate(5)
  assert_batches_equal(next(it), loaders[P - 1].batch_at(5))
  with pytest.raises(ValueError, match="global batch 6 is not divisible by the process "
                     "count 4"):
    make_loader(packed, "train", 6, process_index=0, process_count=4)
  with pytest.raises(ValueError, match=r"process_index=4 is not in \[0, process_count=4\)"):
    make_loader(packed, "train", 8, process_index=4, process_count=4)


def test_eval_fixed_order_padded(packed):
  R = packed.num_rows("val")
  B = 6
  assert R % B
  loader = make_loader(packed, "val", B, seed=123)
  batches = list(loader.iterate())
  assert len(batches) == loader.num_batches == -(-R // B)
  ids = np.concatenate([b["row_id"] for b in batches])
  np.testing.assert_array_equal(ids[:R], np.arange(R))
  assert (ids[R:] == -1).all()
  last = batches[-1]
  pad = last["row_id"] == -1
  assert not last["mask"][pad].any()
  assert (last["example_id"][pad] == -1).all() and (last["offset"][pad] == -1).all()
  assert (last["targets"][pad] == packed.pad_id).all()
  # Every val target token is seen exactly once, independent of the seed.
  rows = packed.rows("val")
  total = sum(int(b["mask"].sum()) for b in batches)
  assert total == int((rows["offset"][:, 1:] > 0).sum())
  assert_batches_equal(make_loader(packed, "val", B, seed=0).batch_at(1), batches[1])
  # Two processes each take half of every eval batch.
  halves = [make_loader(packed, "val", B, process_index=p, process_count=2)
            for p in range(2)]
  for s in range(loader.num_batches):
    union = {k: np.concatenate([h.batch_at(s)[k] for h in halves]) for k in KEYS}
    assert_batches_equal(union, batches[s])
  with pytest.raises(IndexError, match="out of range for the val loader"):
    loader.batch_at(loader.num_batches)


def test_source_is_picklable(packed):
  loader = make_loader(packed, "train", 4, seed=0)
  clone = pickle.loads(pickle.dumps(loader.source))
  for i in (0, len(clone) - 1):
    for k, v in clone[i].items():
      np.testing.assert_array_equal(v, loader.source[i][k])
  with pytest.raises(IndexError, match="out of range"):
    clone[len(clone)]


def test_bad_loader_arguments(packed):
  with pytest.raises(ValueError, match="unknown split 'test'"):
    make_loader(packed, "test", 4)
  with pytest.raises(ValueError, match="global batch must be positive"):
    make_loader(packed, "train", 0)
  with pytest.raises(ValueError, match="data seed must be in"):
    make_loader(packed, "train", 4, seed=-1)
