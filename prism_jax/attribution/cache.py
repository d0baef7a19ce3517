"""The attribution cache: one sparse record per training token, in tensorstore zarr arrays.

PRISM.md §5 step 1. Three resumable passes over the packed training rows (in row order):

  1. curvature: A (K×K co-usage), G (D×D), μ (K) with
     prism_jax.attribution.curvature_stats.CurvatureAccumulator; its float64 sums are saved
     every few batches, so a resumed pass adds the same batches in the same order (exact).
     Then G = U E Uᵀ; the top `rank` eigenvectors U_r (rank = D: a rotation, exact).
  2. records, per valid training token t (mask True), row-major over (row, position):
       example_id (N,), offset (N,), idx (N,k) prototype ids, act (N,k) a_{t,i},
       g (N,r) = U_rᵀ g_t with g_t = ∂ℓ_t/∂ẑ_t (the token's own loss, not averaged).
     Each row's token range is known from pass 1's per-row counts, so every batch is written
     at a fixed place; `progress.json` records the rows done *after* the write completed.
  3. inverted index (CSR): proto_offsets (K+1,), proto_tokens (N·k,) token indices, each
     prototype's tokens sorted by decreasing activation (ties: token index), so a query can
     keep the top-M tokens per prototype.

Identity: metadata.json holds the model fingerprint (SHA-256 of every parameter), the config,
cache options and sizes. Building into a directory of another identity, or opening a cache
with a model/config it was not built from, raises CacheMismatchError.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
from typing import Any, Iterator

import jax
import numpy as np
import tensorstore as ts
from absl import logging
from flax import nnx

from prism_jax.attribution import curvature as cv
from prism_jax.attribution import curvature_stats as cs
from prism_jax.config import Config, to_dict

METADATA = "metadata.json"
PROGRESS = "progress.json"
FORMAT_VERSION = 2  # 2: proto_acts beside proto_tokens


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

  def __post_init__(self):
    if self.rank is not None and self.rank <= 0:
      raise ValueError(f"cache.rank must be positive or None, got {self.rank}")
    for name in ("batch_rows", "chunk_tokens", "save_every"):
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


def _relevant_config(cfg: Config) -> dict[str, Any]:
  """The parts of the run config that change cached values (not train/mesh settings)."""
  d = to_dict(cfg)
  return {k: d[k] for k in ("model", "loss", "data")}


def _identity(model, cfg: Config, cache_cfg: CacheConfig, packed) -> dict[str, Any]:
  return {"format": FORMAT_VERSION, "model_fingerprint": model_fingerprint(model),
          "config": _relevant_config(cfg), "cache": dataclasses.asdict(cache_cfg),
          "data": {"path": getattr(packed, "path", None),
                   "pack": getattr(packed, "metadata", {}).get("config")}}


def _diff(a: Any, b: Any, prefix: str = "") -> list[str]:
  if isinstance(a, dict) and isinstance(b, dict):
    out = []
    for key in sorted(set(a) | set(b)):
      out += _diff(a.get(key), b.get(key), f"{prefix}{key}.")
    return out
  a = list(a) if isinstance(a, tuple) else a
  b = list(b) if isinstance(b, tuple) else b
  return [] if a == b else [f"{prefix[:-1]}: cache has {a!r}, wanted {b!r}"]


def _read_json(path):
  with open(path) as f:
    return json.load(f)


def _write_json(path, obj):
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1, sort_keys=True)
  os.replace(tmp, path)  # atomic: a kill leaves the old or the new file, never half


def _store(directory, name, driver, *, shape=None, dtype=None, chunks=None, create=False):
  spec = {"driver": driver, "kvstore": {"driver": "file", "path": os.path.join(directory, name)}}
  if not create:
    return ts.open(spec, open=True).result()
  chunks = chunks or shape
  return ts.open(spec, create=True, delete_existing=True, dtype=ts.dtype(np.dtype(dtype).name),
                 shape=list(shape), chunk_layout=ts.ChunkLayout(
                     chunk_shape=[max(1, c) for c in chunks])).result()


def _write_array(directory, name, driver, value):
  value = np.asarray(value)
  _store(directory, name, driver, shape=value.shape or (1,), dtype=value.dtype,
         create=True).write(value.reshape(value.shape or (1,))).result()


def iter_rows(packed, split: str, batch_rows: int, start_row: int = 0,
              max_rows: int | None = None) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
  """(first row, batch) over the split's rows in order, following the batch contract."""
  rows = packed.rows(split)
  total = packed.num_rows(split) if max_rows is None else min(max_rows, packed.num_rows(split))
  for start in range(start_row, total, batch_rows):
    stop = min(start + batch_rows, total)
    tok = np.asarray(rows["tokens"][start:stop])
    ex = np.asarray(rows["example_id"][start:stop])
    off = np.asarray(rows["offset"][start:stop])
    yield start, {"inputs": tok[:, :-1], "targets": tok[:, 1:], "mask": off[:, 1:] > 0,
                  "example_id": ex[:, 1:], "offset": off[:, 1:],
                  "row_id": np.arange(start, stop, dtype=np.int32)}


def _pad_rows(batch, rows):
  """Pads a short final batch to `rows` rows (mask False) so one compiled shape serves all."""
  have = batch["inputs"].shape[0]
  if have == rows:
    return batch
  pad = lambda x, v: np.concatenate([x, np.full((rows - have,) + x.shape[1:], v, x.dtype)])
  return {"inputs": pad(batch["inputs"], 0), "targets": pad(batch["targets"], 0),
          "mask": pad(batch["mask"], False), "example_id": pad(batch["example_id"], -1),
          "offset": pad(batch["offset"], -1), "row_id": pad(batch["row_id"], -1)}


class _Progress:
  """tqdm on a terminal, otherwise absl log lines every ~10%."""

  def __init__(self, total: int, desc: str, initial: int = 0):
    self.total, self.desc, self.n, self.t0 = total, desc, initial, time.time()
    self.bar, self.next_log = None, 0.1
    if sys.stderr.isatty():
      import tqdm  # pylint: disable=import-outside-toplevel
      self.bar = tqdm.tqdm(total=total, initial=initial, desc=desc, unit="row")

  def update(self, n: int):
    self.n += n
    if self.bar is not None:
      self.bar.update(n)
    elif self.total and self.n / self.total >= self.next_log:
      logging.info("%s: %d/%d rows (%.0f%%, %.1fs)", self.desc, self.n, self.total,
                   100 * self.n / self.total, time.time() - self.t0)
      self.next_log = np.floor(self.n / self.total * 10 + 1) / 10

  def close(self):
    if self.bar is not None:
      self.bar.close()


def build_cache(model, cfg: Config, packed, out_dir: str,
                cache_cfg: CacheConfig = CacheConfig(), *, overwrite: bool = False,
                progress: bool = True, on_batch=None) -> "AttributionCache":
  """Builds (or resumes building) the cache of `model` over `packed`'s split into out_dir.

  `on_batch(pass_index, rows_done)` is called after every batch (tests, monitoring).
  """
  if cfg.model.kind != "prism":
    raise ValueError("the attribution cache needs a PrismLM (model.kind='prism')")
  os.makedirs(out_dir, exist_ok=True)
  ident = _identity(model, cfg, cache_cfg, packed)
  meta_path, prog_path = os.path.join(out_dir, METADATA), os.path.join(out_dir, PROGRESS)
  if os.path.exists(meta_path) and not overwrite:
    diffs = _diff(_read_json(meta_path)["identity"], ident)
    if diffs:
      raise CacheMismatchError(f"{out_dir} holds a cache of another model/config "
                               f"({'; '.join(diffs[:5])}); pass overwrite=True or another "
                               "directory")
  if overwrite or not os.path.exists(meta_path):
    for name in os.listdir(out_dir):  # a previous cache's files and arrays
      full = os.path.join(out_dir, name)
      if name in (METADATA, PROGRESS, "pass1_state.npz"):
        os.remove(full)
      elif os.path.isdir(full) and any(os.path.exists(os.path.join(full, m))
                                       for m in ("zarr.json", ".zarray")):
        shutil.rmtree(full)
    _write_json(meta_path, {"identity": ident, "complete": False})
  prog = _read_json(prog_path) if os.path.exists(prog_path) else {"pass": 1, "rows_done": 0}
  meta = _read_json(meta_path)
  if meta.get("complete"):
    return AttributionCache(out_dir, model, cfg)

  mcfg, driver = cfg.model, cache_cfg.driver
  num_rows = packed.num_rows(cache_cfg.split)
  if cache_cfg.max_rows is not None:
    num_rows = min(num_rows, cache_cfg.max_rows)
  if num_rows == 0:
    raise ValueError(f"split {cache_cfg.split!r} has no rows to cache")
  rank = mcfg.d_model if cache_cfg.rank is None else cache_cfg.rank
  if rank > mcfg.d_model:
    raise ValueError(f"cache.rank={rank} exceeds d_model={mcfg.d_model}")
  spec = cv.HeadSpec.from_model(model)
  t_start = time.time()

  if prog["pass"] == 1:
    acc = cs.CurvatureAccumulator(mcfg.num_prototypes, mcfg.d_model, cfg.loss,
                                  fisher=cache_cfg.fisher)
    state_path = os.path.join(out_dir, "pass1_state.npz")
    row_counts = np.zeros(num_rows, np.int64)
    prog["rows_done"] = 0
    if os.path.exists(state_path):  # the snapshot carries its own row count (atomic)
      with np.load(state_path, allow_pickle=False) as f:
        acc.load_state({k: f[k] for k in f.files})
        row_counts, prog["rows_done"] = f["row_counts"], int(f["rows_done"])
    bar = _Progress(num_rows, "cache pass 1/2 (curvature)", prog["rows_done"]) \
        if progress else None
    for step, (start, batch) in enumerate(iter_rows(packed, cache_cfg.split,
                                                    cache_cfg.batch_rows, prog["rows_done"],
                                                    num_rows)):
      n = batch["inputs"].shape[0]
      acc.update(model, _pad_rows(batch, cache_cfg.batch_rows))
      row_counts[start:start + n] = batch["mask"].sum(1)
      if bar:
        bar.update(n)
      done = start + n
      if on_batch:
        on_batch(1, done)
      if (step + 1) % cache_cfg.save_every == 0 and done < num_rows:
        _save_pass1(state_path, acc, row_counts, done)
        _write_json(prog_path, {"pass": 1, "rows_done": done})
    if bar:
      bar.close()
    stats = acc.finalize()
    evals, evecs = cs.eig_G(stats, rank)
    row_offsets = np.concatenate([[0], np.cumsum(row_counts)]).astype(np.int64)
    a = stats.A
    if hasattr(a, "tocoo"):
      coo = a.tocoo()
      _write_array(out_dir, "A_rows", driver, coo.row.astype(np.int64))
      _write_array(out_dir, "A_cols", driver, coo.col.astype(np.int64))
      _write_array(out_dir, "A_vals", driver, coo.data)
    else:
      _write_array(out_dir, "A", driver, np.asarray(a, np.float64))
    _write_array(out_dir, "G", driver, stats.G)
    _write_array(out_dir, "mu", driver, stats.mu)
    _write_array(out_dir, "g_evals", driver, evals)
    _write_array(out_dir, "g_evecs", driver, evecs)
    _write_array(out_dir, "row_offsets", driver, row_offsets)
    num_tokens = int(row_offsets[-1])
    chunk = min(cache_cfg.chunk_tokens, max(num_tokens, 1))
    k = mcfg.k
    for name, shape, dtype in (("example_id", (num_tokens,), np.int32),
                               ("offset", (num_tokens,), np.int32),
                               ("idx", (num_tokens, k), np.int32),
                               ("act", (num_tokens, k), np.float32),
                               ("g", (num_tokens, rank), np.float32)):
      _store(out_dir, name, driver, shape=shape, dtype=dtype,
             chunks=(chunk,) + shape[1:], create=True)
    meta["stats"] = {"count": int(stats.count), "num_batches": int(stats.num_batches),
                     "fisher": stats.fisher, "sparse_A": hasattr(a, "tocoo")}
    meta["sizes"] = {"num_rows": num_rows, "num_tokens": num_tokens, "K": mcfg.num_prototypes,
                     "k": k, "D": mcfg.d_model, "rank": rank}
    _write_json(meta_path, meta)
    prog = {"pass": 2, "rows_done": 0}
    _write_json(prog_path, prog)
    if os.path.exists(state_path):
      os.remove(state_path)

  if prog["pass"] == 2:
    row_offsets = _store(out_dir, "row_offsets", driver).read().result()
    evecs = _store(out_dir, "g_evecs", driver).read().result().astype(np.float32)
    arrays = {n: _store(out_dir, n, driver) for n in ("example_id", "offset", "idx", "act", "g")}
    bar = _Progress(num_rows, "cache pass 2/2 (records)", prog["rows_done"]) \
        if progress else None
    for start, batch in iter_rows(packed, cache_cfg.split, cache_cfg.batch_rows,
                                  prog["rows_done"], num_rows):
      n = batch["inputs"].shape[0]
      og = cv.output_grads(model, _pad_rows(batch, cache_cfg.batch_rows), cfg.loss)
      valid = batch["mask"].reshape(-1)
      idx = np.asarray(og.idx_Nxk)[:len(valid)][valid]
      act = np.asarray(og.act_Nxk)[:len(valid)][valid].astype(np.float32)
      g = np.asarray(og.g_NxD)[:len(valid)][valid].astype(np.float32) @ evecs
      lo, hi = int(row_offsets[start]), int(row_offsets[start + n])
      if hi - lo != len(idx):
        raise RuntimeError(f"rows {start}:{start + n} hold {len(idx)} valid tokens, pass 1 "
                           f"counted {hi - lo}: the packed data changed during the build")
      if hi > lo:
        futures = [arrays["example_id"][lo:hi].write(batch["example_id"].reshape(-1)[valid]),
                   arrays["offset"][lo:hi].write(batch["offset"].reshape(-1)[valid]),
                   arrays["idx"][lo:hi].write(idx.astype(np.int32)),
                   arrays["act"][lo:hi].write(act), arrays["g"][lo:hi].write(g)]
        for fut in futures:
          fut.result()
      prog = {"pass": 2, "rows_done": start + n}
      _write_json(prog_path, prog)
      if bar:
        bar.update(n)
      if on_batch:
        on_batch(2, start + n)
    if bar:
      bar.close()
    prog = {"pass": 3, "rows_done": 0}
    _write_json(prog_path, prog)

  if prog["pass"] == 3:
    _build_inverted_index(out_dir, driver, mcfg.num_prototypes)
    meta["complete"] = True
    meta["build_seconds_last_run"] = time.time() - t_start
    _write_json(meta_path, meta)
    _write_json(prog_path, {"pass": 4, "rows_done": num_rows})
  return AttributionCache(out_dir, model, cfg)


def _save_pass1(path, acc, row_counts, rows_done):
  state = {k: np.asarray(v) for k, v in acc.state().items() if v is not None}
  tmp = path + ".tmp.npz"
  np.savez(tmp, row_counts=row_counts, rows_done=rows_done, **state)
  os.replace(tmp, path)


def _build_inverted_index(out_dir, driver, num_protos):
  """CSR prototype -> token indices, by decreasing activation within each prototype."""
  idx_Nxk = _store(out_dir, "idx", driver).read().result()
  act_Nxk = _store(out_dir, "act", driver).read().result()
  n, k = idx_Nxk.shape
  proto = idx_Nxk.reshape(-1).astype(np.int64)
  tok = np.repeat(np.arange(n, dtype=np.int64), k)
  act = act_Nxk.reshape(-1)
  keep = act > 0  # a ReLU-zero activation contributes nothing to any score
  proto, tok, act = proto[keep], tok[keep], act[keep]
  order = np.lexsort((tok, -act, proto))
  counts = np.bincount(proto, minlength=num_protos)
  offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
  tok_dtype = np.int32 if n < 2 ** 31 else np.int64
  _write_array(out_dir, "proto_offsets", driver, offsets)
  # proto_acts[j] = a_{t,i} of entry j: block-diagonal queries then never touch idx/act.
  _write_array(out_dir, "proto_tokens", driver, tok[order].astype(tok_dtype) if len(order)
               else np.zeros(1, tok_dtype))
  _write_array(out_dir, "proto_acts", driver, act[order].astype(np.float32) if len(order)
               else np.zeros(1, np.float32))


class AttributionCache:
  """A finished cache: curvature statistics in memory, token records in memory or lazily.

  Refuses (CacheMismatchError) a model whose fingerprint, or a config that, differs from
  the one it was built from; refuses an unfinished build (resume it with build_cache).
  """

  def __init__(self, path: str, model=None, cfg: Config | None = None, *,
               in_memory: bool = True):
    self.path = os.path.abspath(path)
    meta_path = os.path.join(self.path, METADATA)
    if not os.path.exists(meta_path):
      raise FileNotFoundError(f"{self.path} is not an attribution cache (no {METADATA})")
    self.metadata = _read_json(meta_path)
    if not self.metadata.get("complete"):
      raise ValueError(f"the cache in {self.path} is unfinished; run build_cache again with "
                       "the same model and config to resume it")
    ident = self.metadata["identity"]
    if model is not None and model_fingerprint(model) != ident["model_fingerprint"]:
      raise CacheMismatchError(f"the cache in {self.path} was built from another checkpoint "
                               f"(fingerprint {ident['model_fingerprint'][:12]}…); rebuild it "
                               "for this model")
    if cfg is not None:
      diffs = _diff(ident["config"], _relevant_config(cfg))
      if diffs:
        raise CacheMismatchError(f"the cache in {self.path} was built with another config: "
                                 f"{'; '.join(diffs[:5])}")
    self.sizes = self.metadata["sizes"]
    drv = ident["cache"]["driver"]
    rd = lambda n: _store(self.path, n, drv).read().result()
    if self.metadata["stats"]["sparse_A"]:
      import scipy.sparse  # pylint: disable=import-outside-toplevel
      k = self.sizes["K"]
      self.A = scipy.sparse.coo_matrix((rd("A_vals"), (rd("A_rows"), rd("A_cols"))),
                                       shape=(k, k)).tocsr()
      self.a_diag = np.asarray(self.A.diagonal(), np.float64)
    else:
      self.A = rd("A")
      self.a_diag = np.diag(self.A).copy()
    self.G, self.mu = rd("G"), rd("mu")
    self.g_evals, self.g_evecs = rd("g_evals"), rd("g_evecs")
    self.proto_offsets = rd("proto_offsets")
    self.row_offsets = rd("row_offsets")  # token range of each packed row
    self._arrays = {n: _store(self.path, n, drv) for n in (
        "example_id", "offset", "idx", "act", "g", "proto_tokens", "proto_acts")}
    if in_memory:
      self._arrays = {n: a.read().result() for n, a in self._arrays.items()}
    self.num_examples = int(self._read(self._arrays["example_id"], slice(None)).max()) + 1 \
        if self.num_tokens else 0

  @property
  def num_tokens(self) -> int:
    return int(self.sizes["num_tokens"])

  @property
  def rank(self) -> int:
    return int(self.sizes["rank"])

  def _read(self, arr, sel):
    return arr[sel] if isinstance(arr, np.ndarray) else arr[sel].read().result()

  def candidates(self, protos, max_per_proto: int | None = None) -> np.ndarray:
    """Sorted unique training-token indices active on any of `protos` (top-M each)."""
    parts = []
    for i in np.unique(np.asarray(protos, np.int64)):
      lo, hi = int(self.proto_offsets[i]), int(self.proto_offsets[i + 1])
      if max_per_proto is not None:
        hi = min(hi, lo + int(max_per_proto))
      if hi > lo:
        parts.append(np.asarray(self._read(self._arrays["proto_tokens"], slice(lo, hi)),
                                np.int64))
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)

  def proto_entries(self, proto: int, max_per_proto: int | None = None):
    """(token indices, their activations a_{t,i}) of prototype `proto`, by decreasing a."""
    lo, hi = int(self.proto_offsets[proto]), int(self.proto_offsets[proto + 1])
    if max_per_proto is not None:
      hi = min(hi, lo + int(max_per_proto))
    sel = slice(lo, hi)
    return (np.asarray(self._read(self._arrays["proto_tokens"], sel), np.int64),
            np.asarray(self._read(self._arrays["proto_acts"], sel)))

  def gather(self, name: str, tokens: np.ndarray) -> np.ndarray:
    """One record field (example_id, offset, idx, act, g) of the given token indices."""
    return self._read(self._arrays[name], np.asarray(tokens, np.int64))

  def row_of(self, tokens: np.ndarray) -> np.ndarray:
    """Packed-row index (in the split) of each token index."""
    return np.searchsorted(self.row_offsets, np.asarray(tokens, np.int64), "right") - 1

  def records(self, tokens: np.ndarray) -> dict[str, np.ndarray]:
    """example_id, offset, idx, act, g of the given token indices."""
    return {n: self.gather(n, tokens) for n in ("example_id", "offset", "idx", "act", "g")}

  def nbytes_per_token(self) -> float:
    """Bytes on disk per cached token (records + inverted index; stats amortised)."""
    total = 0
    for root, _, files in os.walk(self.path):
      total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total / max(self.num_tokens, 1)
