"""The batch contract module: rows -> batch, padding, and its refusals."""

import secrets

import numpy as np
import pytest

from prism_jax.data import batch as batch_lib
from prism_jax.data.pipeline import row_to_example


def _rows(rng, rows=3, seq=6):
  tokens = rng.integers(0, 50, (rows, seq + 1)).astype(np.int32)
  example_id = rng.integers(0, 9, (rows, seq + 1)).astype(np.int32)
  offset = rng.integers(-1, 4, (rows, seq + 1)).astype(np.int32)
  return tokens, example_id, offset, np.arange(rows, dtype=np.int32)


def test_from_rows_is_the_contract_row_by_row():
  seed = secrets.randbits(32)
  tokens, ex, off, row_id = _rows(np.random.default_rng(seed))
  got = batch_lib.from_rows(tokens, ex, off, row_id)
  assert set(got) == set(batch_lib.KEYS)
  np.testing.assert_array_equal(got["inputs"], tokens[:, :-1])
  np.testing.assert_array_equal(got["targets"], tokens[:, 1:])
  np.testing.assert_array_equal(got["mask"], off[:, 1:] > 0, err_msg=f"seed {seed}")
  for r in range(len(tokens)):  # the grain pipeline's per-row map gives the same rows
    one = row_to_example({"tokens": tokens[r], "example_id": ex[r], "offset": off[r],
                          "row_id": row_id[r]})
    for key in batch_lib.KEYS:
      np.testing.assert_array_equal(one[key], got[key][r], err_msg=key)


def test_pad_batch_appends_padding_rows_and_refuses_bad_batches():
  seed = secrets.randbits(32)
  batch = batch_lib.from_rows(*_rows(np.random.default_rng(seed)))
  padded = batch_lib.pad_batch(batch, 5)
  for key, value in batch.items():
    assert padded[key].dtype == value.dtype and len(padded[key]) == 5
    np.testing.assert_array_equal(padded[key][:3], value)
    assert (padded[key][3:] == batch_lib.PAD_VALUES[key]).all(), key
  assert batch_lib.pad_batch(batch, 3).keys() == batch.keys()
  three = batch_lib.pad_batch({k: batch[k] for k in ("inputs", "targets", "mask")}, 4)
  assert set(three) == {"inputs", "targets", "mask"} and not three["mask"][3].any()
  with pytest.raises(ValueError, match=r"keys \['weights'\] are not in the batch contract"):
    batch_lib.pad_batch({**batch, "weights": batch["mask"]}, 5)
  with pytest.raises(ValueError, match="a batch of 3 rows cannot be padded to 2 rows"):
    batch_lib.pad_batch(batch, 2)
  with pytest.raises(ValueError, match=r"mask must have the inputs' shape \(2, 4\)"):
    batch_lib.next_token(np.zeros((2, 5), np.int32), np.ones((2, 5), bool))
