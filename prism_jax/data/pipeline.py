"""grain pipeline: the global batch of step s is a pure function of (seed, s).

Train: epoch e is a seeded permutation of the split's rows (grain's index shuffle,
reseeded per epoch); the epochs are concatenated and global batch s is elements
[s*B, (s+1)*B). Process p of P takes its contiguous slice [p*B/P, (p+1)*B/P) of it.
Nothing depends on iteration history, so `batch_at(s)` is random access and resuming is
instant: a checkpoint stores only {"step", "seed"}.

Eval: the split's rows in fixed order, ceil(R/B) global batches; the last one is filled
with padding rows (mask False, example_id/offset/row_id -1).

Batches follow the contract of prism_jax/data/batch.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import grain
import numpy as np

from prism_jax.data import batch as batch_lib
from prism_jax.data.packed import PackedData


class PackedRows:
  """grain RandomAccessDataSource over one split's rows; picklable (its reader opens the
  arrays lazily in each worker).

  Index -1 (or any index >= len in `padded` mode) gives a padding row.
  """

  def __init__(self, reader, pad_id: int):
    self.reader, self.split = reader, reader.split
    self.seq_len, self.pad_id, self.num_rows = reader.seq_len, pad_id, reader.num_rows

  def __len__(self) -> int:
    return self.num_rows

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    index = int(index)
    if 0 <= index < self.num_rows:
      row = self.reader.row(index)
      row["row_id"] = np.int32(index)
      return row
    if index < 0:
      return self.pad_row()
    raise IndexError(f"row {index} out of range for {self.split} ({self.num_rows} rows)")

  def pad_row(self) -> dict[str, np.ndarray]:
    n = self.seq_len + 1
    pad = batch_lib.PAD_VALUES
    return {"tokens": np.full(n, self.pad_id, np.int32),
            "example_id": np.full(n, pad["example_id"], np.int32),
            "offset": np.full(n, pad["offset"], np.int32), "row_id": np.int32(pad["row_id"])}


class _PaddedLookup:
  """Row index -> row, or a padding row past the end (a picklable map for grain)."""

  def __init__(self, source: PackedRows):
    self.source = source

  def __call__(self, index: int) -> dict[str, np.ndarray]:
    return self.source[index if index < len(self.source) else -1]


def row_to_example(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """One packed row of T+1 tokens -> the model's (T,) inputs/targets/mask/ids."""
  return batch_lib.from_rows(row["tokens"], row["example_id"], row["offset"], row["row_id"])


@dataclasses.dataclass(frozen=True)
class DataState:
  """What a checkpoint stores to resume the input pipeline exactly."""

  step: int  # the next step to read
  seed: int

  def to_dict(self) -> dict[str, int]:
    return {"step": int(self.step), "seed": int(self.seed)}

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "DataState":
    return cls(step=int(d["step"]), seed=int(d["seed"]))


class Loader:
  """Step-indexed batches of one split for one process."""

  def __init__(self, packed, split: str, global_batch: int, seed: int = 0,
               process_index: int = 0, process_count: int = 1, shuffle: bool | None = None,
               worker_count: int = 0, read_threads: int = 1):
    if global_batch <= 0:
      raise ValueError(f"global batch must be positive, got {global_batch}")
    if process_count <= 0 or not 0 <= process_index < process_count:
      raise ValueError(f"process_index={process_index} is not in [0, process_count="
                       f"{process_count})")
    if global_batch % process_count:
      raise ValueError(f"global batch {global_batch} is not divisible by the process count "
                       f"{process_count}")
    if not 0 <= seed < 2**32:
      raise ValueError(f"data seed must be in [0, 2**32), got {seed}")
    self.split, self.seed = split, int(seed)
    self.global_batch, self.local_batch = global_batch, global_batch // process_count
    self.process_index, self.process_count = process_index, process_count
    self.shuffle = (split == "train") if shuffle is None else bool(shuffle)
    self.worker_count, self.read_threads = worker_count, read_threads
    self.num_rows = packed.num_rows(split)
    if self.num_rows == 0:
      raise ValueError(f"split {split!r} of {packed.path} has no rows")
    self.source = PackedRows(packed.reader(split), packed.pad_id)
    ds = grain.MapDataset.source(self.source)
    if self.shuffle:
      # Element i = row perm_{i // R}(i % R): epochs concatenated, each permuted anew.
      ds = ds.seed(self.seed).shuffle().repeat()
      self.num_batches = None  # infinite
    else:
      # Fixed order, one pass, padded to whole global batches (index -1 = padding row).
      self.num_batches = -(-self.num_rows // global_batch)
      ds = grain.MapDataset.range(self.num_batches * global_batch).map(
          _PaddedLookup(self.source))
    # Global batch s, process p = local batch s*P + p.
    self._local = ds.map(row_to_example).batch(self.local_batch)

  @property
  def steps_per_epoch(self) -> float:
    return self.num_rows / self.global_batch

  def _index(self, step: int) -> int:
    if step < 0 or (self.num_batches is not None and step >= self.num_batches):
      raise IndexError(f"step {step} out of range for the {self.split} loader"
                       + (f" ({self.num_batches} batches)" if self.num_batches else ""))
    return step * self.process_count + self.process_index

  def batch_at(self, step: int) -> dict[str, np.ndarray]:
    """This process's slice of global batch `step` (random access)."""
    return self._local[self._index(step)]

  def global_batch_at(self, step: int) -> dict[str, np.ndarray]:
    """The whole global batch (all processes' slices in order); for tests and tools."""
    parts = [self._local[step * self.process_count + p] for p in range(self.process_count)]
    return {k: np.concatenate([b[k] for b in parts]) for k in parts[0]}

  def iterate(self, start_step: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """Batches start_step, start_step + 1, ... (eval: until the split is exhausted)."""
    self._index(start_step)
    ds = self._local[start_step * self.process_count + self.process_index::
                     self.process_count]
    it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=self.read_threads,
                                                 prefetch_buffer_size=2))
    if self.worker_count > 0:
      it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=self.worker_count))
    return iter(it_ds)

  def __iter__(self):
    return self.iterate(0)

  def state(self, step: int) -> dict[str, int]:
    """The data state to checkpoint when `step` is the next step to run."""
    return DataState(step, self.seed).to_dict()

  def resume(self, state: dict[str, Any] | DataState) -> Iterator[dict[str, np.ndarray]]:
    """Iterates from a checkpointed state; refuses a state from another seed."""
    if isinstance(state, dict):
      state = DataState.from_dict(state)
    if state.seed != self.seed:
      raise ValueError(f"data state was saved with seed {state.seed}, this loader uses "
                       f"seed {self.seed}")
    return self.iterate(state.step)


def make_loader(packed, split: str, global_batch: int, seed: int = 0,
                process_index: int = 0, process_count: int = 1, **kwargs) -> Loader:
  """Train split: shuffled, infinite; val split: fixed order, one padded pass.

  `packed`: a PackedData or the path of a packed directory.
  """
  if isinstance(packed, str):
    packed = PackedData(packed)
  return Loader(packed, split, global_batch, seed, process_index, process_count, **kwargs)
