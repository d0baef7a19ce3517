"""Building the attribution cache: three resumable passes over the packed training rows.

PRISM.md §5 step 1 (the format is described in cache.py; cache_format.py holds the shared
pieces). Passes, in row order:

  1. curvature: A (K×K co-usage), G (D×D), μ (K) with
     prism_jax.attribution.curvature_stats.CurvatureAccumulator; its float64 sums are saved
     every few batches, so a resumed pass adds the same batches in the same order (exact).
     Then G = U E Uᵀ; the top `rank` eigenvectors U_r (rank = D: a rotation, exact).
  2. records of every valid training token; each row's token range is known from pass 1's
     per-row counts, so every batch is written at a fixed place; `progress.json` records the
     rows done *after* the write completed.
  3. the inverted index (CSR) prototype -> tokens, by decreasing activation.

Each pass is a function (curvature_pass, records_pass, index_pass); `write_cache` runs all
three, `write_records` the records alone (no curvature: g in a given basis, raw by default).
"""

from __future__ import annotations

import os
import shutil
import sys
import time

import numpy as np
from absl import logging

from prism_jax import io_guard
from prism_jax.attribution import cache_format as fmt
from prism_jax.attribution import curvature as cv
from prism_jax.attribution import curvature_stats as cs
from prism_jax.config import Config
from prism_jax.data import batch as batch_lib


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


def _check(model, cfg: Config, packed, cache_cfg: fmt.CacheConfig, rank: int | None
           ) -> tuple[int, int]:
  """(rows to cache, rank of g) after the checks every build shares."""
  if cfg.model.kind != "prism":
    raise ValueError("the attribution cache needs a PrismLM (model.kind='prism')")
  mcfg = cfg.model
  num_rows = packed.num_rows(cache_cfg.split)
  if cache_cfg.max_rows is not None:
    num_rows = min(num_rows, cache_cfg.max_rows)
  if num_rows == 0:
    raise ValueError(f"split {cache_cfg.split!r} has no rows to cache")
  rank = mcfg.d_model if rank is None else rank
  if rank > mcfg.d_model:
    raise ValueError(f"cache.rank={rank} exceeds d_model={mcfg.d_model}")
  cv.HeadSpec.from_model(model)  # a clear error for a model without a prototype head
  return num_rows, rank


def _open_dir(out_dir: str, ident: dict, overwrite: bool, records_only: bool):
  """(metadata, progress) of out_dir; clears it when new or `overwrite`, refuses another
  identity or the other kind of build."""
  # Claimed before any write: never a run's or the packed data's directory.
  io_guard.claim_output_dir(out_dir, fmt.CACHE_KIND, rebuild=overwrite,
                            legacy=fmt.is_cache_dir)
  meta_path = os.path.join(out_dir, fmt.METADATA)
  prog_path = os.path.join(out_dir, fmt.PROGRESS)
  if os.path.exists(meta_path) and not overwrite:
    meta = fmt.read_json(meta_path)
    diffs = fmt.diff(meta["identity"], ident)
    if diffs:
      raise fmt.CacheMismatchError(f"{out_dir} holds a cache of another model/config "
                                   f"({'; '.join(diffs[:5])}); pass overwrite=True or "
                                   "another directory")
    if bool(meta.get("records_only")) != records_only:
      kind = "a records-only build" if meta.get("records_only") else "a full cache"
      raise fmt.CacheMismatchError(f"{out_dir} holds {kind}; pass overwrite=True or "
                                   "another directory")
  if overwrite or not os.path.exists(meta_path):
    for name in os.listdir(out_dir):  # a previous cache's files and arrays
      full = os.path.join(out_dir, name)
      if name in (fmt.METADATA, fmt.PROGRESS, fmt.PASS1_STATE):
        os.remove(full)
      elif os.path.isdir(full) and any(os.path.exists(os.path.join(full, m))
                                       for m in ("zarr.json", ".zarray")):
        shutil.rmtree(full)
    fmt.write_json(meta_path, {"identity": ident, "complete": False,
                               **({"records_only": True} if records_only else {})})
  prog = fmt.read_json(prog_path) if os.path.exists(prog_path) else {"pass": 1, "rows_done": 0}
  return fmt.read_json(meta_path), prog


def write_cache(model, cfg: Config, packed, out_dir: str,
                cache_cfg: fmt.CacheConfig = fmt.CacheConfig(), *, overwrite: bool = False,
                progress: bool = True, on_batch=None) -> None:
  """Builds (or resumes building) the cache of `model` over `packed`'s split into out_dir.

  `on_batch(pass_index, rows_done)` is called after every batch (tests, monitoring).
  cache.build_cache wraps this and opens the result.
  """
  num_rows, rank = _check(model, cfg, packed, cache_cfg, cache_cfg.rank)
  meta, prog = _open_dir(out_dir, fmt.identity(model, cfg, cache_cfg, packed), overwrite,
                         records_only=False)
  if meta.get("complete"):
    return
  t_start = time.time()
  prog_path = os.path.join(out_dir, fmt.PROGRESS)
  if prog["pass"] == 1:
    curvature_pass(model, cfg, packed, out_dir, cache_cfg, num_rows, rank, meta,
                   progress=progress, on_batch=on_batch)
    prog = {"pass": 2, "rows_done": 0}
  if prog["pass"] == 2:
    records_pass(model, cfg, packed, out_dir, cache_cfg, num_rows, prog["rows_done"],
                 progress=progress, on_batch=on_batch)
    prog = {"pass": 3, "rows_done": 0}
    fmt.write_json(prog_path, prog)
  if prog["pass"] == 3:
    index_pass(out_dir, cache_cfg.driver, cfg.model.num_prototypes)
    meta["complete"] = True
    meta["build_seconds_last_run"] = time.time() - t_start
    fmt.write_json(os.path.join(out_dir, fmt.METADATA), meta)
    fmt.write_json(prog_path, {"pass": 4, "rows_done": num_rows})


def write_records(model, cfg: Config, packed, out_dir: str,
                  cache_cfg: fmt.CacheConfig = fmt.CacheConfig(), *,
                  basis_DxR: np.ndarray | None = None, overwrite: bool = False,
                  progress: bool = True, on_batch=None) -> None:
  """Records-only build (resumable): row_offsets and every valid token's example_id,
  offset, idx, act and g = basis_DxRᵀ g_t (None: the raw D-dim g_t), with no curvature
  pass and no inverted index. Given a full cache's g_evecs as the basis, its records equal
  that cache's. `on_batch(2, rows_done)` after every batch."""
  d_model = cfg.model.d_model
  basis = np.eye(d_model, dtype=np.float64) if basis_DxR is None else np.asarray(basis_DxR)
  if basis.ndim != 2 or basis.shape[0] != d_model:
    raise ValueError(f"basis_DxR must have shape (D={d_model}, rank), got {basis.shape}")
  num_rows, rank = _check(model, cfg, packed, cache_cfg, basis.shape[1])
  meta, prog = _open_dir(out_dir, fmt.identity(model, cfg, cache_cfg, packed), overwrite,
                         records_only=True)
  if meta.get("complete"):
    return
  t_start = time.time()
  prog_path = os.path.join(out_dir, fmt.PROGRESS)
  if prog["pass"] == 1:  # the token ranges need only the masks: no model pass
    row_counts = np.zeros(num_rows, np.int64)
    for start, batch in fmt.iter_rows(packed, cache_cfg.split, cache_cfg.batch_rows, 0,
                                      num_rows):
      row_counts[start:start + len(batch["mask"])] = batch["mask"].sum(1)
    fmt.write_array(out_dir, "g_evecs", cache_cfg.driver, basis)
    _create_records(out_dir, cache_cfg, cfg.model.k, rank, row_counts)
    meta["sizes"] = _sizes(cfg.model, num_rows, row_counts, rank)
    fmt.write_json(os.path.join(out_dir, fmt.METADATA), meta)
    prog = {"pass": 2, "rows_done": 0}
    fmt.write_json(prog_path, prog)
  records_pass(model, cfg, packed, out_dir, cache_cfg, num_rows, prog["rows_done"],
               progress=progress, on_batch=on_batch)
  meta["complete"] = True
  meta["build_seconds_last_run"] = time.time() - t_start
  fmt.write_json(os.path.join(out_dir, fmt.METADATA), meta)
  fmt.write_json(prog_path, {"pass": 3, "rows_done": num_rows})


def _sizes(mcfg, num_rows: int, row_counts: np.ndarray, rank: int) -> dict[str, int]:
  return {"num_rows": num_rows, "num_tokens": int(row_counts.sum()),
          "K": mcfg.num_prototypes, "k": mcfg.k, "D": mcfg.d_model, "rank": rank}


def _create_records(out_dir: str, cache_cfg: fmt.CacheConfig, k: int, rank: int,
                    row_counts: np.ndarray) -> None:
  """row_offsets (each row's token range) and the empty per-token record arrays."""
  driver = cache_cfg.driver
  row_offsets = np.concatenate([[0], np.cumsum(row_counts)]).astype(np.int64)
  fmt.write_array(out_dir, "row_offsets", driver, row_offsets)
  num_tokens = int(row_offsets[-1])
  chunk = min(cache_cfg.chunk_tokens, max(num_tokens, 1))
  for name, shape, dtype in (("example_id", (num_tokens,), np.int32),
                             ("offset", (num_tokens,), np.int32),
                             ("idx", (num_tokens, k), np.int32),
                             ("act", (num_tokens, k), np.float32),
                             ("g", (num_tokens, rank), np.float32)):
    fmt.store(out_dir, name, driver, shape=shape, dtype=dtype, chunks=(chunk,) + shape[1:],
              create=True)


def curvature_pass(model, cfg: Config, packed, out_dir: str, cache_cfg: fmt.CacheConfig,
                   num_rows: int, rank: int, meta: dict, *, progress: bool = True,
                   on_batch=None) -> None:
  """Pass 1: A, G, μ, G's top-`rank` eigenpairs and each row's valid-token count (resumed
  from its float64 snapshot), then the empty record arrays; updates metadata.json and
  marks pass 2 in progress.json."""
  mcfg, driver = cfg.model, cache_cfg.driver
  prog_path = os.path.join(out_dir, fmt.PROGRESS)
  acc = cs.CurvatureAccumulator(mcfg.num_prototypes, mcfg.d_model, cfg.loss,
                                fisher=cache_cfg.fisher)
  state_path = os.path.join(out_dir, fmt.PASS1_STATE)
  row_counts, rows_done = np.zeros(num_rows, np.int64), 0
  if os.path.exists(state_path):  # the snapshot carries its own row count (atomic)
    with np.load(state_path, allow_pickle=False) as f:
      acc.load_state({k: f[k] for k in f.files})
      row_counts, rows_done = f["row_counts"], int(f["rows_done"])
  bar = _Progress(num_rows, "cache pass 1/2 (curvature)", rows_done) if progress else None
  rows = fmt.iter_rows(packed, cache_cfg.split, cache_cfg.batch_rows, rows_done, num_rows)
  for step, (start, batch) in enumerate(rows):
    n = batch["inputs"].shape[0]
    acc.update(model, batch_lib.pad_batch(batch, cache_cfg.batch_rows))
    row_counts[start:start + n] = batch["mask"].sum(1)
    if bar:
      bar.update(n)
    done = start + n
    if on_batch:
      on_batch(1, done)
    if (step + 1) % cache_cfg.save_every == 0 and done < num_rows:
      _save_pass1(state_path, acc, row_counts, done)
      fmt.write_json(prog_path, {"pass": 1, "rows_done": done})
  if bar:
    bar.close()
  stats = acc.finalize()
  evals, evecs = cs.eig_G(stats, rank)
  a = stats.A
  if hasattr(a, "tocoo"):
    coo = a.tocoo()
    fmt.write_array(out_dir, "A_rows", driver, coo.row.astype(np.int64))
    fmt.write_array(out_dir, "A_cols", driver, coo.col.astype(np.int64))
    fmt.write_array(out_dir, "A_vals", driver, coo.data)
  else:
    fmt.write_array(out_dir, "A", driver, np.asarray(a, np.float64))
  fmt.write_array(out_dir, "G", driver, stats.G)
  fmt.write_array(out_dir, "mu", driver, stats.mu)
  fmt.write_array(out_dir, "g_evals", driver, evals)
  fmt.write_array(out_dir, "g_evecs", driver, evecs)
  _create_records(out_dir, cache_cfg, mcfg.k, rank, row_counts)
  meta["stats"] = {"count": int(stats.count), "num_batches": int(stats.num_batches),
                   "fisher": stats.fisher, "sparse_A": hasattr(a, "tocoo")}
  meta["sizes"] = _sizes(mcfg, num_rows, row_counts, rank)
  fmt.write_json(os.path.join(out_dir, fmt.METADATA), meta)
  fmt.write_json(prog_path, {"pass": 2, "rows_done": 0})  # before the snapshot goes
  if os.path.exists(state_path):
    os.remove(state_path)


def records_pass(model, cfg: Config, packed, out_dir: str, cache_cfg: fmt.CacheConfig,
                 num_rows: int, rows_done: int = 0, *, progress: bool = True,
                 on_batch=None) -> None:
  """Pass 2: every valid token's record, written at the place row_offsets gives (so a
  resume from `rows_done`, recorded in progress.json after each write, is exact); g is
  projected on the stored g_evecs."""
  driver = cache_cfg.driver
  prog_path = os.path.join(out_dir, fmt.PROGRESS)
  row_offsets = fmt.store(out_dir, "row_offsets", driver).read().result()
  evecs = fmt.store(out_dir, "g_evecs", driver).read().result().astype(np.float32)
  arrays = {n: fmt.store(out_dir, n, driver)
            for n in ("example_id", "offset", "idx", "act", "g")}
  bar = _Progress(num_rows, "cache pass 2/2 (records)", rows_done) if progress else None
  for start, batch in fmt.iter_rows(packed, cache_cfg.split, cache_cfg.batch_rows,
                                    rows_done, num_rows):
    n = batch["inputs"].shape[0]
    og = cv.output_grads(model, batch_lib.pad_batch(batch, cache_cfg.batch_rows), cfg.loss)
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
    fmt.write_json(prog_path, {"pass": 2, "rows_done": start + n})
    if bar:
      bar.update(n)
    if on_batch:
      on_batch(2, start + n)
  if bar:
    bar.close()


def _save_pass1(path, acc, row_counts, rows_done):
  state = {k: np.asarray(v) for k, v in acc.state().items() if v is not None}
  tmp = path + ".tmp.npz"
  np.savez(tmp, row_counts=row_counts, rows_done=rows_done, **state)
  os.replace(tmp, path)


def index_pass(out_dir: str, driver: str, num_protos: int) -> None:
  """Pass 3: the inverted index (CSR) prototype -> token indices, by decreasing activation
  within each prototype (ties: token index), from the stored idx/act records."""
  idx_Nxk = fmt.store(out_dir, "idx", driver).read().result()
  act_Nxk = fmt.store(out_dir, "act", driver).read().result()
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
  fmt.write_array(out_dir, "proto_offsets", driver, offsets)
  # proto_acts[j] = a_{t,i} of entry j: block-diagonal queries then never touch idx/act.
  fmt.write_array(out_dir, "proto_tokens", driver, tok[order].astype(tok_dtype)
                  if len(order) else np.zeros(1, tok_dtype))
  fmt.write_array(out_dir, "proto_acts", driver, act[order].astype(np.float32)
                  if len(order) else np.zeros(1, np.float32))
