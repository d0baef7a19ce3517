"""Which process of a multi-host job this is, and the barriers packing needs.

Packing reads jax.distributed's process index and count when the runtime is up (never
starting it, nor a backend, when it is not): every process packs its share of the
pieces, process 0 alone writes the plan, the tokenizer and the final metadata.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class Processes:
  index: int = 0
  count: int = 1
  barrier: Callable[[str], None] = lambda name: None
  all_true: Callable[[bool], bool] = bool  # every process's flag is True
  broadcast: Callable[[np.ndarray], np.ndarray] = lambda x: x  # process 0's array

  def broadcast_int(self, value: int) -> int:
    return int(self.broadcast(np.array(value, np.int64)))

  def broadcast_hex(self, make: Callable[[], str]) -> str:
    """Process 0 computes a 64-character hex digest (a source hash); all receive it."""
    if self.count == 1:
      return make()
    raw = (np.frombuffer(make().encode("ascii"), np.uint8) if self.index == 0
           else np.zeros(64, np.uint8))
    return bytes(np.asarray(self.broadcast(raw), np.uint8)).decode("ascii")


def _jax_processes() -> Processes:
  import jax  # pylint: disable=g-import-not-at-top  (deferred: jax, which packing never imports)
  if not jax.distributed.is_initialized() or jax.process_count() == 1:
    return Processes()
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top  (deferred: jax, only under jax.distributed)
  from prism_jax import distributed  # pylint: disable=g-import-not-at-top  (deferred: jax, only under jax.distributed)

  def all_true(flag: bool) -> bool:
    return bool(np.all(multihost_utils.process_allgather(np.array([int(flag)], np.int32))))

  def broadcast(value: np.ndarray) -> np.ndarray:
    return np.asarray(multihost_utils.broadcast_one_to_all(value))

  return Processes(jax.process_index(), jax.process_count(),
                   lambda name: distributed.sync(f"prism_pack_{name}"), all_true, broadcast)


def current() -> Processes:
  """This job's processes (one, unless jax.distributed is initialised)."""
  try:
    return _jax_processes()
  except ImportError:
    return Processes()
