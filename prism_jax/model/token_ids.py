"""The one check of token ids at the door: integers in [0, vocab_size).

Every public entry point taking ids (generation, decomposition, attribution, cards,
reports) calls `check_token_ids` on its host inputs. Inside jit the ids are traced and out
of reach, and XLA's gathers clamp an out-of-range id to V − 1 silently, so the check must
run before anything is traced; a traced input is passed through unchecked.
"""

from __future__ import annotations

import jax
import numpy as np


def check_token_ids(ids, vocab_size: int, what: str = "token ids") -> np.ndarray:
  """ids as a NumPy integer array; ValueError naming `what`, the range and the first bad
  position if any id is outside [0, vocab_size), TypeError if they are not integers."""
  if isinstance(ids, jax.core.Tracer):
    return ids
  arr = np.asarray(ids)
  if arr.size == 0:
    return arr.astype(np.int32)
  if not np.issubdtype(arr.dtype, np.integer):
    raise TypeError(f"{what} must be integers, got dtype {arr.dtype}")
  bad = (arr < 0) | (arr >= vocab_size)
  if bad.any():
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    where = first[0] if len(first) == 1 else first
    raise ValueError(f"{what} must be in [0, vocab_size={vocab_size}), got range "
                     f"[{arr.min()}, {arr.max()}] ({int(bad.sum())} out of range, first at "
                     f"position {where}: {arr[first]})")
  return arr
