"""On-disk format of the attribution cache: options, identity, zarr arrays, row iteration.

Shared by the builder (cache_build.py) and the reader (cache.py). A cache directory holds
metadata.json (identity + sizes + stats), progress.json while it is being built, and one
tensorstore array per field (see cache.py for the fields). The directory is a local path or
a gs:// URI: JSON through prism_jax.paths (etils epath), arrays through tensorstore's own
`file` / `gcs` kvstore.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Iterator

import jax
import numpy as np
import tensorstore as ts
from flax import nnx

from prism_jax import paths
from prism_jax.attribution.hessians import curvature_stats as cs
from prism_jax.config import Config, to_dict
from prism_jax.data import batch as batch_lib

METADATA = "metadata.json"
PROGRESS = "progress.json"
PASS1_STATE = "pass1_state.npz"
FORMAT_VERSION = 3  # 2: proto_acts beside proto_tokens; 3: stats folded over stat_shards
CACHE_KIND = "attribution cache"  # io_guard marker kind


class CacheMismatchError(ValueError):
  """The cache was built from another checkpoint, config or cache option."""


@dataclasses.dataclass(frozen=True)
class CacheConfig:
  rank: int | None = None  # eigenvectors of G kept for g; None = D (exact)
  split: str = "train"
  batch_rows: int = 16  # rows per forward pass
  chunk_tokens: int = 16384  # zarr chunk length along the token axis
  fisher: str = "true"  # G: exact per-token Fisher ("true") or g gᵀ ("empirical")
  max_rows: int | None = None  # only the first rows of the split (benchmarks, tests)
  save_every: int = 8  # pass-1 accumulator snapshot every this many batches
  driver: str = "zarr3"
  # Pass 1 sums each of this many contiguous batch ranges from zero and folds them in
  # order: the result is the same bits for any process count <= stat_shards.
  stat_shards: int = 64
  # Pass 1 keeps its per-token outputs (idx, act, raw g) for pass 2 when all of them fit
  # in this many bytes: one model pass instead of two (2 GiB: 3.4M tokens at D 128, k 16).
  hold_bytes: int = 2 << 30

  def __post_init__(self):
    if self.rank is not None and self.rank <= 0:
      raise ValueError(f"cache.rank must be positive or None, got {self.rank}")
    for name in ("batch_rows", "chunk_tokens", "save_every", "stat_shards"):
      if getattr(self, name) <= 0:
        raise ValueError(f"cache.{name} must be positive, got {getattr(self, name)}")
    if self.driver not in ("zarr", "zarr3"):
      raise ValueError(f"cache.driver={self.driver!r}; use 'zarr' or 'zarr3'")
    if self.fisher not in cs.FISHERS:
      raise ValueError(f"cache.fisher={self.fisher!r}; use one of {cs.FISHERS}")


def model_fingerprint(model) -> str:
  """SHA-256 over every parameter's path, shape, dtype and bytes: the checkpoint identity."""
  h = hashlib.sha256()
  flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
  for path, var in sorted(flat, key=lambda kv: tuple(str(p) for p in kv[0])):
    arr = np.asarray(jax.device_get(var[...]))
    h.update(repr((tuple(str(p) for p in path), arr.shape, str(arr.dtype))).encode())
    h.update(np.ascontiguousarray(arr).tobytes())
  return h.hexdigest()


def relevant_config(cfg: Config) -> dict[str, Any]:
  """The parts of the run config that change cached values (not train/mesh settings)."""
  d = to_dict(cfg)
  return {k: d[k] for k in ("model", "loss", "data")}


# What in a pack's metadata.json determines its rows: the corpus bytes' sha256, the pack
# config, the tokenizer, the counts and rows per piece; not seconds_last_run.
_PACK_CONTENT = ("format_version", "config", "source_hash", "tokenizer", "counts", "pieces")


def data_digest(packed) -> str:
  """SHA-256 of the pack's content manifest (_PACK_CONTENT of its metadata.json): the data's
  identity whatever directory holds it, so a copied or moved run keeps its cache, while
  data re-packed from other text (or with other settings) does not. Read from metadata
  alone: hashing the rows would read the whole pack on every open."""
  meta = {k: packed.metadata[k] for k in _PACK_CONTENT if k in packed.metadata}
  return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()


def identity(model, cfg: Config, cache_cfg: CacheConfig, packed) -> dict[str, Any]:
  return {"format": FORMAT_VERSION, "model_fingerprint": model_fingerprint(model),
          "config": relevant_config(cfg),
          # hold_bytes changes how the build runs, never a bit of what it writes
          "cache": {k: v for k, v in dataclasses.asdict(cache_cfg).items() if k != "hold_bytes"},
          "data": {"content": data_digest(packed), "pack": packed.metadata.get("config")}}


def keyed_on_path(stored: dict[str, Any], wanted: dict[str, Any]) -> bool:
  """A cache whose identity names its data by path (before data_digest) and otherwise
  equals `wanted`: it cannot be checked against the data's content, so it is rebuilt."""
  data = stored.get("data")
  if not isinstance(data, dict) or "path" not in data or "content" in data:
    return False
  strip = lambda ident: {**ident, "data": {"pack": ident.get("data", {}).get("pack")}}
  return not diff(strip(stored), strip(wanted))


def diff(a: Any, b: Any, prefix: str = "") -> list[str]:
  """Human-readable differences between two identity dicts ('key: cache has …, wanted …')."""
  if isinstance(a, dict) and isinstance(b, dict):
    out = []
    for key in sorted(set(a) | set(b)):
      out += diff(a.get(key), b.get(key), f"{prefix}{key}.")
    return out
  a = list(a) if isinstance(a, tuple) else a
  b = list(b) if isinstance(b, tuple) else b
  return [] if a == b else [f"{prefix[:-1]}: cache has {a!r}, wanted {b!r}"]


def is_cache_dir(path: str) -> bool:
  """A cache directory written before io_guard markers: its metadata.json has an identity."""
  meta = paths.join(path, METADATA)
  try:
    return paths.path(meta).is_file() and "identity" in read_json(meta)
  except (OSError, ValueError):
    return False


def is_complete_cache(path: str) -> bool:
  """A cache whose build finished (its metadata says complete): opening it writes nothing,
  so it needs no run lock; an unfinished or stale one is built on, which does."""
  meta = paths.join(path, METADATA)
  try:
    return paths.path(meta).is_file() and bool(read_json(meta).get("complete"))
  except (OSError, ValueError, AttributeError):
    return False


def exists(path) -> bool:
  return paths.path(path).exists()


def read_json(path):
  return json.loads(paths.path(path).read_text())


def write_json(path, obj):
  # atomic: a kill leaves the old or the new file, never half
  paths.write_text_atomic(path, json.dumps(obj, indent=1, sort_keys=True))


def store(directory, name, driver, *, shape=None, dtype=None, chunks=None, create=False):
  """Opens (or creates, deleting any old one) the tensorstore array `name` in directory."""
  spec = {"driver": driver, "kvstore": paths.kvstore(paths.join(directory, name))}
  if not create:
    return ts.open(spec, open=True).result()
  chunks = chunks or shape
  old = paths.path(paths.join(directory, name))
  if paths.is_remote(old) and old.exists():
    # Removed through epath: a kvstore range delete on an object store lists by offset,
    # which emulators (gcp-storage-emulator) ignore, deleting the whole bucket listing.
    old.rmtree()
  return ts.open(spec, create=True, delete_existing=not paths.is_remote(old),
                 dtype=ts.dtype(np.dtype(dtype).name),
                 shape=list(shape), chunk_layout=ts.ChunkLayout(
                     chunk_shape=[max(1, c) for c in chunks])).result()


def write_array(directory, name, driver, value):
  value = np.asarray(value)
  store(directory, name, driver, shape=value.shape or (1,), dtype=value.dtype,
        create=True).write(value.reshape(value.shape or (1,))).result()


def iter_rows(packed, split: str, batch_rows: int, start_row: int = 0,
              max_rows: int | None = None) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
  """(first row, batch) over the split's rows in order, following the batch contract."""
  rows = packed.rows(split)
  total = packed.num_rows(split) if max_rows is None else min(max_rows, packed.num_rows(split))
  for start in range(start_row, total, batch_rows):
    stop = min(start + batch_rows, total)
    yield start, batch_lib.from_rows(rows["tokens"][start:stop],
                                     rows["example_id"][start:stop],
                                     rows["offset"][start:stop],
                                     np.arange(start, stop, dtype=np.int32))
