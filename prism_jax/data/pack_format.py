"""The on-disk pack (format 2): pieces of rows in tensorstore zarr3 arrays + document index.

Layout of a pack directory (a local path or gs://):
  plan.json                      config, source hash, the pieces (plan.py); written first
  tokenizer.json                 reload with load_tokenizer(dir)
  pieces/<k>/<split>.zarr        uint16 (int32 if vocab > 65536) (R_k, T+1) rows of piece k
  pieces/<k>/index.npz           per document of the piece: split, length (EOS included),
                                 name; per unit: its document count
  pieces/<k>/done.json           the piece's counts, written after its arrays and index
  metadata.json                  config, source hash, tokenizer, counts, rows and documents
                                 per piece: written last, once every piece is done. Its
                                 presence is what makes a pack finished.

Rows: each split of a piece is one token stream (a leading EOS, then each document's
tokens and its EOS); row r holds stream[r*T : r*T + T + 1], consecutive rows overlap by
one token, the last row is padded with PAD. A split's rows are its pieces' rows in piece
order. A token's example id and offset are not stored: the document index gives them
(`ids_and_offsets`), which makes the pack a third of format 1's three int32 arrays.

Why tensorstore zarr3: already the attribution cache's store (one dependency, the same
`file` / `gcs` kvstores, so gs:// is written object by object with no local staging); its
sharding codec writes a shard of rows as one object (the write chunk, SHARD_BYTES) while
a reader fetches one row of it by a ranged read (the read chunk): the grain loader's
random access costs one row, not one shard. ArrayRecord would add a dependency and a
record per row with no array view for attribution's slices.
"""

from __future__ import annotations

import collections
import io
import json
import threading
from typing import Any

import numpy as np
import tensorstore as ts

from prism_jax import paths

FORMAT_VERSION = 2
SPLITS = ("train", "val")
FIELDS = ("tokens", "example_id", "offset")
METADATA = "metadata.json"
PLAN = "plan.json"
PIECES = "pieces"
DONE = "done.json"
INDEX = "index.npz"
SHARD_BYTES = 8 << 20  # one written object of rows
_HANDLES = 64  # open arrays / piece indexes a reader keeps (LRU)


class OldPackError(ValueError):
  """A pack written by an older prism_jax (format 1: whole .npy arrays)."""


def old_format_message(path: str) -> str:
  return (f"{path} holds packed data of format 1 (whole .npy arrays), which this prism_jax "
          f"does not read; re-pack it: remove everything in {path} but tokenizer.json (the "
          "run's tokenizer) and rerun the same command, which packs the same rows in format 2")


def check_format(path: str, meta: dict) -> None:
  version = meta.get("format_version", meta.get("config", {}).get("format_version"))
  if version == 1:
    raise OldPackError(old_format_message(path))
  if version != FORMAT_VERSION:
    raise ValueError(f"{path}: packed data format {version!r}, this prism_jax reads "
                     f"format {FORMAT_VERSION}")


def piece_dir(root: str, k: int) -> str:
  return paths.join(root, PIECES, f"{k:06d}")


def token_dtype(vocab_size: int) -> np.dtype:
  return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.int32)


def shard_rows(seq_len: int, dtype) -> int:
  return max(1, SHARD_BYTES // ((seq_len + 1) * np.dtype(dtype).itemsize))


# --- writing ---------------------------------------------------------------------------


def _row_codec(seq_len: int):
  """Shards of rows, each row its own inner chunk; the shard index at the start of the
  object (a suffix range read, for an index at the end, is not served by every store)."""
  little = {"name": "bytes", "configuration": {"endian": "little"}}
  return ts.CodecSpec({"driver": "zarr3", "codecs": [{
      "name": "sharding_indexed", "configuration": {
          "chunk_shape": [1, seq_len + 1], "codecs": [little],
          "index_codecs": [little, {"name": "crc32c"}], "index_location": "start"}}]})


def write_rows(directory: str, split: str, stream: np.ndarray, seq_len: int,
               pad_id: int) -> int:
  """Cuts `stream` into rows and writes them shard by shard; returns the row count."""
  T = seq_len
  n_rows = -(-(len(stream) - 1) // T) if len(stream) > 1 else 0
  if n_rows == 0:
    return 0
  dst = paths.path(paths.join(directory, f"{split}.zarr"))
  if paths.is_remote(dst) and dst.exists():
    dst.rmtree()  # as cache_format.store: an emulator's range delete drops the bucket
  S = shard_rows(T, stream.dtype)
  arr = ts.open({"driver": "zarr3", "kvstore": paths.kvstore(dst)}, create=True,
                delete_existing=not paths.is_remote(dst), dtype=ts.dtype(stream.dtype.name),
                shape=[n_rows, T + 1], chunk_layout=ts.ChunkLayout(
                    write_chunk_shape=[min(S, n_rows), T + 1]),
                codec=_row_codec(T)).result()
  padded = np.concatenate([stream, np.full(n_rows * T + 1 - len(stream), pad_id,
                                           stream.dtype)])
  for r0 in range(0, n_rows, S):
    r1 = min(n_rows, r0 + S)
    idx = np.arange(r0, r1)[:, None] * T + np.arange(T + 1)[None, :]
    arr[r0:r1].write(padded[idx]).result()
  return n_rows


def write_index(directory: str, split_D: np.ndarray, length_D: np.ndarray,
                names: list[str], unit_docs: list[int]) -> None:
  blob = "\n".join(n.replace("\n", " ") for n in names).encode("utf-8")
  buf = io.BytesIO()
  np.savez(buf, split_D=split_D.astype(np.uint8), length_D=length_D.astype(np.int64),
           names=np.frombuffer(blob, np.uint8), unit_docs=np.asarray(unit_docs, np.int64))
  _mkdir_parent(paths.join(directory, INDEX))
  paths.write_bytes_atomic(paths.join(directory, INDEX), buf.getvalue())


def read_json(path: str) -> Any:
  return json.loads(paths.path(path).read_text())


def _mkdir_parent(path: str) -> None:
  if not paths.is_remote(path):  # an object store has no directories
    paths.path(path).parent.mkdir(parents=True, exist_ok=True)


def write_json(path: str, obj: Any) -> None:
  _mkdir_parent(path)
  paths.write_text_atomic(path, json.dumps(obj, indent=1, sort_keys=True))


# --- reading ---------------------------------------------------------------------------


class PieceIndex:
  """One piece's documents: split, stream start and length per document, names."""

  def __init__(self, directory: str):
    with np.load(io.BytesIO(paths.path(paths.join(directory, INDEX)).read_bytes())) as z:
      self.split_D, self.length_D = z["split_D"], z["length_D"]
      self._names = z["names"].tobytes().decode("utf-8").split("\n")
      self.unit_docs = z["unit_docs"]
    self.start_D = np.zeros(len(self.split_D), np.int64)
    self.local = {}  # split -> local document ids of that split, in stream order
    for s in range(len(SPLITS)):
      ids = np.flatnonzero(self.split_D == s)
      self.local[s] = ids
      self.start_D[ids] = 1 + np.concatenate([[0], np.cumsum(self.length_D[ids])[:-1]])

  def name(self, i: int) -> str:
    return self._names[i]

  def ids_and_offsets(self, split: int, rows_R: np.ndarray, seq_len: int, doc_base: int
                      ) -> tuple[np.ndarray, np.ndarray]:
    """(example_id, offset) int32 (R, T+1) of the piece's rows `rows_R` of `split`."""
    ids = self.local[split]
    starts = self.start_D[ids]
    end = 1 + int(self.length_D[ids].sum())  # stream length
    pos = rows_R[:, None].astype(np.int64) * seq_len + np.arange(seq_len + 1)[None, :]
    j = np.searchsorted(starts, pos, side="right") - 1
    real = (pos >= 1) & (pos < end)
    j = np.clip(j, 0, max(len(ids) - 1, 0))
    if len(ids) == 0:
      return np.full(pos.shape, -1, np.int32), np.full(pos.shape, -1, np.int32)
    eid = np.where(real, doc_base + ids[j], -1).astype(np.int32)
    off = np.where(real, pos - starts[j], -1).astype(np.int32)
    return eid, off


class _Lru:
  """A small LRU of open arrays / piece indexes, safe under grain's reader threads; it
  pickles empty (each worker process opens its own)."""

  def __init__(self):
    self._d, self._lock = collections.OrderedDict(), threading.Lock()

  def __getstate__(self):
    return {}

  def __setstate__(self, state):
    del state
    self.__init__()

  def get_or(self, key, make):
    with self._lock:
      if key in self._d:
        self._d.move_to_end(key)
        return self._d[key]
    value = make()  # outside the lock: opening may read from an object store
    with self._lock:
      self._d[key] = value
      if len(self._d) > _HANDLES:
        self._d.popitem(last=False)
    return value


class SplitReader:
  """Random access to one split's rows across pieces; picklable (handles open lazily)."""

  def __init__(self, root: str, split: str, seq_len: int, rows_K: list[int],
               docs_K: list[int]):
    self.root, self.split, self.seq_len = root, split, seq_len
    self.s = SPLITS.index(split)
    self.rows_K = np.asarray(rows_K, np.int64)
    self.row_base = np.concatenate([[0], np.cumsum(self.rows_K)])
    self.doc_base = np.concatenate([[0], np.cumsum(np.asarray(docs_K, np.int64))])
    self.num_rows = int(self.row_base[-1])
    self._arrays, self._indexes = _Lru(), _Lru()

  def index(self, k: int) -> PieceIndex:
    return self._indexes.get_or(k, lambda: PieceIndex(piece_dir(self.root, k)))

  def _array(self, k: int):
    def open_():
      spec = {"driver": "zarr3", "kvstore": paths.kvstore(
          paths.join(piece_dir(self.root, k), f"{self.split}.zarr"))}
      ctx = ts.Context({"cache_pool": {"total_bytes_limit": 1 << 20}})  # shard indexes
      return ts.open(spec, open=True, context=ctx).result()
    return self._arrays.get_or(k, open_)

  def _by_piece(self, rows_N: np.ndarray):
    """(piece, positions in rows_N, local rows) for sorted global rows."""
    k_N = np.searchsorted(self.row_base, rows_N, side="right") - 1
    for k in np.unique(k_N):
      at = np.flatnonzero(k_N == k)
      yield int(k), at, rows_N[at] - self.row_base[k]

  def tokens(self, rows_N: np.ndarray) -> np.ndarray:
    """int32 (N, T+1) rows for sorted unique global row ids."""
    out = np.empty((len(rows_N), self.seq_len + 1), np.int32)
    for k, at, local in self._by_piece(rows_N):
      arr = self._array(k)
      if local[-1] - local[0] + 1 == len(local):  # contiguous: one read
        out[at] = arr[int(local[0]):int(local[-1]) + 1].read().result()
      else:
        out[at] = arr[local].read().result()
    return out

  def ids_and_offsets(self, rows_N: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    eid = np.empty((len(rows_N), self.seq_len + 1), np.int32)
    off = np.empty_like(eid)
    for k, at, local in self._by_piece(rows_N):
      eid[at], off[at] = self.index(k).ids_and_offsets(self.s, local, self.seq_len,
                                                       int(self.doc_base[k]))
    return eid, off

  def row(self, index: int) -> dict[str, np.ndarray]:
    rows = np.array([index])
    eid, off = self.ids_and_offsets(rows)
    return {"tokens": self.tokens(rows)[0], "example_id": eid[0], "offset": off[0]}


class RowView:
  """One field of a split as a read-only (R, T+1) int32 array: NumPy indexing (ints,
  slices, integer or boolean arrays on the row axis, then anything on the columns) reads
  only the rows asked for; np.asarray reads them all."""

  def __init__(self, reader: SplitReader, field: str):
    self.reader, self.field = reader, field
    self.shape = (reader.num_rows, reader.seq_len + 1)
    self.dtype, self.ndim = np.dtype(np.int32), 2

  def __len__(self) -> int:
    return self.shape[0]

  def _read(self, rows_N: np.ndarray) -> np.ndarray:
    if self.field == "tokens":
      return self.reader.tokens(rows_N)
    eid, off = self.reader.ids_and_offsets(rows_N)
    return eid if self.field == "example_id" else off

  def __getitem__(self, key):
    key = key if isinstance(key, tuple) else (key,)
    first, rest = key[0], key[1:]
    R = self.shape[0]
    if isinstance(first, (int, np.integer)):
      i = int(first) + (R if first < 0 else 0)
      if not 0 <= i < R:
        raise IndexError(f"row {int(first)} out of range for {R} rows")
      return self._read(np.array([i]))[(0,) + rest]
    if isinstance(first, slice):
      rows = np.arange(R)[first]
      if len(rows) and rows[0] > rows[-1]:  # a negative step
        block = self._read(rows[::-1])[::-1]
      else:
        block = self._read(rows) if len(rows) else np.empty((0, self.shape[1]), np.int32)
      return block[(slice(None),) + rest]
    arr = np.asarray(first)
    if arr.dtype == bool:
      arr = np.flatnonzero(arr)
    arr = np.where(arr < 0, arr + R, arr).astype(np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= R):
      raise IndexError(f"row index out of range for {R} rows")
    uniq, inv = np.unique(arr, return_inverse=True)
    block = self._read(uniq) if len(uniq) else np.empty((0, self.shape[1]), np.int32)
    return block[(inv.reshape(arr.shape),) + rest]

  def __array__(self, dtype=None, copy=None):
    out = self[:]
    return out if dtype is None else out.astype(dtype)

  def __iter__(self):
    step = 1024
    for r0 in range(0, len(self), step):
      yield from self[r0:r0 + step]
