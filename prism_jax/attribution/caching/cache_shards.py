"""Who builds what in a multi-process cache build, and the fixed-order curvature fold.

Under jax.distributed every process runs the same build (cache_build.py); this module says
which part is its own, so that any process count gives the same bits as one process:

- Pass 1: the global batch grid (batch b = rows [b·B, (b+1)·B)) is cut into
  `stat_shards` contiguous shards; process p owns shards [p·S/P, (p+1)·S/P). Each shard
  is summed from zero (float64) and saved as its own file; every process then folds all
  shard files in shard order. A psum would add in an order that depends on the process
  count; this fold does not, and the shard files make pass 1 resumable per process.
- Pass 2: the token axis is cut at chunk boundaries into P shares; process p writes only
  the tokens of its share (no chunk is written by two processes), running the batches of
  the global grid that touch it (a batch straddling two shares runs on both, each
  keeping its own tokens: records are per-token, so the bits are the same).
- Pass 3 (the inverted index): each process inverts its pass-2 token share, then writes
  a chunk-aligned share of the merged index (cache_index.py).
- Progress: process 0 keeps progress.json (also the global pass), process p > 0
  progress-<p>.json; pass-1 snapshots pass1_state.npz / pass1_state-<p>.npz.
"""

from __future__ import annotations

import io

import jax
import numpy as np

from prism_jax import distributed, paths
from prism_jax.attribution.caching import cache_format as fmt

SHARD_PREFIX = "pass1_shard-"


def process() -> tuple[int, int]:
  """(this process's index, process count)."""
  return jax.process_index(), jax.process_count()


def sync(name: str) -> None:
  if jax.process_count() > 1:
    distributed.sync(name)


def progress_name(pid: int) -> str:
  return fmt.PROGRESS if pid == 0 else f"progress-{pid}.json"


def state_name(pid: int) -> str:
  return fmt.PASS1_STATE if pid == 0 else fmt.PASS1_STATE.replace(".npz", f"-{pid}.npz")


def shard_name(i: int) -> str:
  return f"{SHARD_PREFIX}{i:05d}.npz"


def is_build_file(name: str) -> bool:
  """A file of an unfinished build (progress, snapshots, shard sums)."""
  return name.startswith(("progress", "pass1_")) or name == fmt.METADATA


def check_processes(num_shards: int, count: int) -> None:
  if count > num_shards:
    raise ValueError(f"{count} processes but cache.stat_shards={num_shards}: set "
                     f"stat_shards >= the process count (a multiple of it balances best)")


def stat_shards(num_rows: int, batch_rows: int, num_shards: int) -> list[tuple[int, int]]:
  """Row range [lo, hi) of each shard (empty ranges allowed), on the batch grid."""
  nb = -(-num_rows // batch_rows)
  cuts = [i * nb // num_shards for i in range(num_shards + 1)]
  return [(min(a * batch_rows, num_rows), min(b * batch_rows, num_rows))
          for a, b in zip(cuts[:-1], cuts[1:])]


def own_shards(num_shards: int, pid: int, count: int) -> range:
  return range(pid * num_shards // count, (pid + 1) * num_shards // count)


def token_share(num_tokens: int, chunk: int, pid: int, count: int) -> tuple[int, int]:
  """Token range [lo, hi) of process pid: whole chunks, so no chunk has two writers."""
  n_chunks = -(-num_tokens // chunk)
  lo = pid * n_chunks // count * chunk
  hi = (pid + 1) * n_chunks // count * chunk
  return min(lo, num_tokens), min(hi, num_tokens)


def share_rows(row_offsets: np.ndarray, lo: int, hi: int, batch_rows: int
               ) -> tuple[int, int]:
  """Rows [r0, r1) of the batches on the grid that hold tokens [lo, hi) (empty if none)."""
  if hi <= lo:
    return 0, 0
  first = int(np.searchsorted(row_offsets, lo, side="right")) - 1  # row holding token lo
  last = int(np.searchsorted(row_offsets, hi - 1, side="right")) - 1
  num_rows = len(row_offsets) - 1
  return first // batch_rows * batch_rows, min(num_rows, -(-(last + 1) // batch_rows) * batch_rows)


def save_npz(path: str, **arrays) -> None:
  buf = io.BytesIO()
  np.savez(buf, **{k: np.asarray(v) for k, v in arrays.items() if v is not None})
  paths.write_bytes_atomic(path, buf.getvalue())


def load_npz(path: str) -> dict[str, np.ndarray]:
  with np.load(io.BytesIO(paths.path(path).read_bytes()), allow_pickle=False) as f:
    return {k: f[k] for k in f.files}
