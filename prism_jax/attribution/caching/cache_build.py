"""Building the attribution cache: three resumable passes over the packed training rows.

PRISM.md §5 step 1 (the format is described in cache.py; cache_format.py holds the shared
pieces). Passes, in row order:

  1. curvature: A (K×K co-usage), G (D×D), μ (K) with
     prism_jax.attribution.hessians.curvature_stats.CurvatureAccumulator; its float64 sums are saved
     every few batches, so a resumed pass adds the same batches in the same order (exact).
     Then G = U E Uᵀ; the top `rank` eigenvectors U_r (rank = D: a rotation, exact).
  2. records of every valid training token; each row's token range is known from pass 1's
     per-row counts, so every batch is written at a fixed place; `progress.json` records the
     rows done *after* the write completed.
  3. the inverted index (CSR) prototype -> tokens, by decreasing activation: each
     process inverts its token share, then writes its share of the merged index
     (cache_index.py).

Each pass is a function (curvature_pass, records_pass, index_pass); `write_cache` runs all
three, `write_records` the records alone (no curvature: g in a given basis, raw by default).
"""

from __future__ import annotations

import sys
import time

import numpy as np
from absl import logging

from prism_jax import io_guard, paths
from prism_jax.attribution.caching import cache_format as fmt
from prism_jax.attribution.caching import cache_index
from prism_jax.attribution.caching import cache_shards as shards
from prism_jax.attribution.hessians import curvature as cv
from prism_jax.attribution.hessians import curvature_stats as cs
from prism_jax.config import Config
from prism_jax.data import batch as batch_lib

index_pass = cache_index.index_pass  # pass 3 (its own module: split over processes)


class _Progress:
  """tqdm on a terminal, otherwise absl log lines every ~10%."""

  def __init__(self, total: int, desc: str, initial: int = 0):
    self.total, self.desc, self.n, self.t0 = total, desc, initial, time.time()
    self.bar, self.next_log = None, 0.1
    if sys.stderr.isatty():
      import tqdm  # pylint: disable=import-outside-toplevel  (deferred: tqdm, only on a terminal)
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
  cv.check_model(model)  # a clear error for a model without a prototype head
  return num_rows, rank


def _open_dir(out_dir: str, ident: dict, overwrite: bool, records_only: bool):
  """(metadata, progress of the global pass) of out_dir; clears it when new or
  `overwrite`, refuses another identity or the other kind of build. Process 0 claims and
  clears; the others wait for it."""
  pid, _ = shards.process()
  meta_path = paths.join(out_dir, fmt.METADATA)
  prog_path = paths.join(out_dir, fmt.PROGRESS)
  if pid == 0:
    _claim(out_dir, ident, overwrite, records_only, meta_path)
  shards.sync(f"cache claim {out_dir}")
  meta = fmt.read_json(meta_path)
  diffs = fmt.diff(meta["identity"], ident) if pid != 0 else []
  if diffs:
    raise fmt.CacheMismatchError(f"process {pid} builds another model/config than process "
                                 f"0 into {out_dir}: {'; '.join(diffs[:5])}")
  prog = fmt.read_json(prog_path) if fmt.exists(prog_path) else {"pass": 1, "rows_done": 0}
  return meta, prog


def _claim(out_dir, ident, overwrite, records_only, meta_path) -> None:
  # Claimed before any write: never a run's or the packed data's directory.
  io_guard.claim_output_dir(out_dir, fmt.CACHE_KIND, rebuild=overwrite,
                            legacy=fmt.is_cache_dir)
  meta = fmt.read_json(meta_path) if fmt.exists(meta_path) and not overwrite else None
  if meta is not None and fmt.keyed_on_path(meta["identity"], ident):
    logging.info("%s: rebuilding the attribution cache: it names its data by path (an older "
                 "prism_jax), which cannot be checked against the data's content", out_dir)
    meta = None
  if meta is not None:
    diffs = fmt.diff(meta["identity"], ident)
    if diffs:
      raise fmt.CacheMismatchError(f"{out_dir} holds a cache of another model/config "
                                   f"({'; '.join(diffs[:5])}); pass overwrite=True or "
                                   "another directory")
    if bool(meta.get("records_only")) != records_only:
      kind = "a records-only build" if meta.get("records_only") else "a full cache"
      raise fmt.CacheMismatchError(f"{out_dir} holds {kind}; pass overwrite=True or "
                                   "another directory")
    return
  for full in paths.path(out_dir).iterdir():  # a previous cache's files and arrays
    if shards.is_build_file(full.name):
      full.unlink()
    elif full.is_dir() and any((full / m).exists() for m in ("zarr.json", ".zarray")):
      full.rmtree()
  fmt.write_json(meta_path, {"identity": ident, "complete": False,
                             **({"records_only": True} if records_only else {})})


def _finish(out_dir: str, meta: dict, t_start: float, final_prog: dict) -> None:
  """Process 0 marks the cache complete; every process returns once it is."""
  if shards.process()[0] == 0:
    meta["complete"] = True
    meta["build_seconds_last_run"] = time.time() - t_start
    fmt.write_json(paths.join(out_dir, fmt.METADATA), meta)
    fmt.write_json(paths.join(out_dir, fmt.PROGRESS), final_prog)
  shards.sync(f"cache complete {out_dir}")


def write_cache(model, cfg: Config, packed, out_dir: str,
                cache_cfg: fmt.CacheConfig = fmt.CacheConfig(), *, overwrite: bool = False,
                progress: bool = True, on_batch=None) -> None:
  """Builds (or resumes building) the cache of `model` over `packed`'s split into out_dir.

  Under jax.distributed every process calls this with the same arguments and writes its
  own share (cache_shards.py); one process builds the same bits alone.
  `on_batch(pass_index, rows_done)` is called after every batch (tests, monitoring); in
  pass 3 after every index write, with the entries written.
  cache.build_cache wraps this and opens the result.
  """
  out_dir = paths.resolve(out_dir)
  num_rows, rank = _check(model, cfg, packed, cache_cfg, cache_cfg.rank)
  shards.check_processes(cache_cfg.stat_shards, shards.process()[1])
  meta, prog = _open_dir(out_dir, fmt.identity(model, cfg, cache_cfg, packed), overwrite,
                         records_only=False)
  if meta.get("complete"):
    return
  t_start = time.time()
  # Pass 1's per-token outputs, kept for pass 2 when they fit (one model pass, not two);
  # a resumed pass 2 recomputes them with the same program (the same bits).
  held = {} if _fits_in_memory(cfg, num_rows, cache_cfg) else None
  if prog["pass"] == 1:
    curvature_pass(model, cfg, packed, out_dir, cache_cfg, num_rows, rank, meta,
                   progress=progress, on_batch=on_batch, held=held)
    prog = {"pass": 2, "rows_done": 0}
  if prog["pass"] == 2:
    records_pass(model, cfg, packed, out_dir, cache_cfg, num_rows, progress=progress,
                 on_batch=on_batch, held=held)
    prog = {"pass": 3, "rows_done": 0}
    if shards.process()[0] == 0:
      fmt.write_json(paths.join(out_dir, fmt.PROGRESS), prog)
  if prog["pass"] == 3:  # every process inverts its share (cache_index.py)
    index_pass(out_dir, cache_cfg.driver, cfg.model.num_prototypes, on_block=(
        (lambda done: on_batch(3, done)) if on_batch else None))
    if shards.process()[0] == 0:
      cache_index.cleanup(out_dir)  # (left by a kill after the index was complete)
      # with num_examples; process 0 alone reads it: it rewrites it next (_finish), with no
      # barrier between, and another process's read raced that write (the test emulator
      # served it half written)
      meta = fmt.read_json(paths.join(out_dir, fmt.METADATA))
    _finish(out_dir, meta, t_start, {"pass": 4, "rows_done": num_rows})


def write_records(model, cfg: Config, packed, out_dir: str,
                  cache_cfg: fmt.CacheConfig = fmt.CacheConfig(), *,
                  basis_DxR: np.ndarray | None = None, overwrite: bool = False,
                  progress: bool = True, on_batch=None) -> None:
  """Records-only build (resumable): row_offsets and every valid token's example_id,
  offset, idx, act and g = basis_DxRᵀ g_t (None: the raw D-dim g_t), with no curvature
  pass and no inverted index. Given a full cache's g_evecs as the basis, its records equal
  that cache's. `on_batch(2, rows_done)` after every batch."""
  out_dir = paths.resolve(out_dir)
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
  if prog["pass"] == 1:  # the token ranges need only the masks: no model pass
    if shards.process()[0] == 0:
      row_counts = np.zeros(num_rows, np.int64)
      for start, batch in fmt.iter_rows(packed, cache_cfg.split, cache_cfg.batch_rows, 0,
                                        num_rows):
        row_counts[start:start + len(batch["mask"])] = batch["mask"].sum(1)
      fmt.write_array(out_dir, "g_evecs", cache_cfg.driver, basis)
      _create_records(out_dir, cache_cfg, cfg.model.k, rank, row_counts)
      meta["sizes"] = _sizes(cfg.model, num_rows, row_counts, rank)
      fmt.write_json(paths.join(out_dir, fmt.METADATA), meta)
      fmt.write_json(paths.join(out_dir, fmt.PROGRESS), {"pass": 2, "rows_done": 0})
    shards.sync(f"cache records arrays {out_dir}")
    meta = fmt.read_json(paths.join(out_dir, fmt.METADATA))
  records_pass(model, cfg, packed, out_dir, cache_cfg, num_rows, progress=progress,
               on_batch=on_batch)
  _finish(out_dir, meta, t_start, {"pass": 3, "rows_done": num_rows})


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


def _fits_in_memory(cfg: Config, num_rows: int, cache_cfg: fmt.CacheConfig) -> bool:
  per_token = 8 * cfg.model.k + 4 * cfg.model.d_model  # idx, act, raw g
  return num_rows * cfg.data.seq_len * per_token <= cache_cfg.hold_bytes


def _token_outputs(og, mask_BxT: np.ndarray) -> dict[str, np.ndarray]:
  """idx, act and raw g of a batch's valid tokens, on the host (the records before g's
  projection)."""
  valid = mask_BxT.reshape(-1)
  n = len(valid)
  return {"idx": np.asarray(og.idx_Nxk)[:n][valid].astype(np.int32),
          "act": np.asarray(og.act_Nxk)[:n][valid].astype(np.float32),
          "g": np.asarray(og.g_NxD)[:n][valid].astype(np.float32)}


def curvature_pass(model, cfg: Config, packed, out_dir: str, cache_cfg: fmt.CacheConfig,
                   num_rows: int, rank: int, meta: dict, *, progress: bool = True,
                   on_batch=None, held: dict | None = None) -> None:
  """Pass 1: A, G, μ, G's top-`rank` eigenpairs and each row's valid-token count. This
  process sums its stat shards (each resumed from its float64 snapshot, then saved whole);
  all shards are folded in shard order; process 0 writes the statistics and the empty
  record arrays, updates metadata.json and marks pass 2 in progress.json. `held` (a dict)
  receives each batch's token outputs, keyed by (first row, rows), for `records_pass`."""
  mcfg = cfg.model
  pid, count = shards.process()
  ranges = shards.stat_shards(num_rows, cache_cfg.batch_rows, cache_cfg.stat_shards)
  new_acc = lambda: cs.CurvatureAccumulator(mcfg.num_prototypes, mcfg.d_model, cfg.loss,
                                            fisher=cache_cfg.fisher)
  mine = [i for i in shards.own_shards(cache_cfg.stat_shards, pid, count)
          if not fmt.exists(paths.join(out_dir, shards.shard_name(i)))]
  state_path = paths.join(out_dir, shards.state_name(pid))
  prog_path = paths.join(out_dir, shards.progress_name(pid))
  snap = shards.load_npz(state_path) if fmt.exists(state_path) else None
  todo = sum(ranges[i][1] - ranges[i][0] for i in mine)
  bar = _Progress(todo, "cache pass 1/2 (curvature)") if progress else None
  batches = 0
  for i in mine:
    lo, hi = ranges[i]
    acc, row_counts, rows_done = new_acc(), np.zeros(hi - lo, np.int64), lo
    if snap is not None and int(snap["shard"]) == i:  # the snapshot carries its row count
      acc.load_state(snap)
      row_counts, rows_done = snap["row_counts"], int(snap["rows_done"])
      if bar:
        bar.update(rows_done - lo)
    for start, batch in fmt.iter_rows(packed, cache_cfg.split, cache_cfg.batch_rows,
                                      rows_done, hi):
      n = batch["inputs"].shape[0]
      og = acc.update(model, batch_lib.pad_batch(batch, cache_cfg.batch_rows))
      if held is not None:
        held[(start, n)] = _token_outputs(og, batch["mask"])
      row_counts[start - lo:start - lo + n] = batch["mask"].sum(1)
      done, batches = start + n, batches + 1
      if bar:
        bar.update(n)
      if on_batch:
        on_batch(1, done)
      if batches % cache_cfg.save_every == 0:  # (the shard file follows at its end)
        _save_pass1(state_path, acc, row_counts, done, i)
        fmt.write_json(prog_path, {"pass": 1, "rows_done": done})
    shards.save_npz(paths.join(out_dir, shards.shard_name(i)), row_counts=row_counts,
                    **acc.state())
  if bar:
    bar.close()
  shards.sync(f"cache pass 1 {out_dir}")
  if pid == 0:
    _write_stats(out_dir, cache_cfg, cfg, num_rows, rank, meta, new_acc, ranges)
  shards.sync(f"cache pass 1 written {out_dir}")
  meta.update(fmt.read_json(paths.join(out_dir, fmt.METADATA)))
  for name in {shards.state_name(pid)} | ({shards.shard_name(i) for i in range(len(ranges))}
                                          if pid == 0 else set()):
    if fmt.exists(paths.join(out_dir, name)):  # after pass 2 is marked: never needed again
      paths.path(out_dir).joinpath(name).unlink()


def _write_stats(out_dir, cache_cfg, cfg, num_rows, rank, meta, new_acc, ranges) -> None:
  """Folds the shard sums in shard order; writes the statistics and the record arrays."""
  mcfg, driver = cfg.model, cache_cfg.driver
  acc, row_counts = new_acc(), np.zeros(num_rows, np.int64)
  for i, (lo, hi) in enumerate(ranges):
    part = shards.load_npz(paths.join(out_dir, shards.shard_name(i)))
    acc.merge(new_acc().load_state(part))
    row_counts[lo:hi] = part["row_counts"]
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
  fmt.write_json(paths.join(out_dir, fmt.METADATA), meta)
  fmt.write_json(paths.join(out_dir, fmt.PROGRESS), {"pass": 2, "rows_done": 0})


def records_pass(model, cfg: Config, packed, out_dir: str, cache_cfg: fmt.CacheConfig,
                 num_rows: int, *, progress: bool = True, on_batch=None,
                 held: dict | None = None) -> None:
  """Pass 2: every valid token of this process's token share, at the place row_offsets
  gives; g is projected on the stored g_evecs. Records are buffered and written in whole
  chunks, each once (no read-modify-write of a chunk, which object stores make slow and
  racy); this process's progress file records the tokens written after each write, and
  a resume reruns from the batch holding the first unwritten token (exact)."""
  driver = cache_cfg.driver
  pid, count = shards.process()
  prog_path = paths.join(out_dir, shards.progress_name(pid))
  row_offsets = fmt.store(out_dir, "row_offsets", driver).read().result()
  evecs = fmt.store(out_dir, "g_evecs", driver).read().result().astype(np.float32)
  arrays = {n: fmt.store(out_dir, n, driver) for n in _RECORD_FIELDS}
  chunk = arrays["g"].chunk_layout.write_chunk.shape[0]
  share = list(shards.token_share(int(row_offsets[-1]), chunk, pid, count))
  prog = fmt.read_json(prog_path) if fmt.exists(prog_path) else {}
  done_tok = share[0]
  if prog.get("pass") == 2:
    if prog.get("share", share) != share:
      raise ValueError(f"{out_dir}: pass 2 was started with another process count "
                       f"(share {prog['share']}, now {share}); resume it with the same "
                       "number of processes")
    done_tok = int(prog.get("tokens_done", done_tok))
  row_lo, row_hi = shards.share_rows(row_offsets, done_tok, share[1], cache_cfg.batch_rows)
  bar = _Progress(row_hi - row_lo, "cache pass 2/2 (records)") if progress else None
  buf = {n: [] for n in _RECORD_FIELDS}
  buf_hi = done_tok  # the buffer holds tokens [done_tok, buf_hi)
  for start, batch in fmt.iter_rows(packed, cache_cfg.split, cache_cfg.batch_rows, row_lo,
                                    row_hi):
    n = batch["inputs"].shape[0]
    out = (held or {}).pop((start, n), None)
    if out is None:  # pass 1's program (batch_curvature), so the same bits as held ones
      out = _token_outputs(cs.batch_output_grads(
          model, batch_lib.pad_batch(batch, cache_cfg.batch_rows), cfg.loss,
          cache_cfg.fisher), batch["mask"])
    valid = batch["mask"].reshape(-1)
    rec = {"example_id": batch["example_id"].reshape(-1)[valid],
           "offset": batch["offset"].reshape(-1)[valid],
           "idx": out["idx"], "act": out["act"], "g": out["g"] @ evecs}
    lo, hi = int(row_offsets[start]), int(row_offsets[start + n])
    if hi - lo != len(rec["idx"]):
      raise RuntimeError(f"rows {start}:{start + n} hold {len(rec['idx'])} valid tokens, "
                         f"pass 1 counted {hi - lo}: the packed data changed during the build")
    a, b = max(lo, buf_hi), min(hi, share[1])  # this process's new tokens of the batch
    if b > a:
      for name, v in rec.items():
        buf[name].append(v[a - lo:b - lo])
      buf_hi = b
    full = done_tok + (buf_hi - done_tok) // chunk * chunk
    end = buf_hi if buf_hi == share[1] else full  # whole chunks (the array's last: short)
    if end > done_tok:
      _write_records(arrays, buf, done_tok, end)
      done_tok = end
      fmt.write_json(prog_path, {"pass": 2, "rows_done": start + n, "share": share,
                                 "tokens_done": done_tok})
    if bar:
      bar.update(n)
    if on_batch:
      on_batch(2, start + n)
  if bar:
    bar.close()
  shards.sync(f"cache pass 2 {out_dir}")


_RECORD_FIELDS = ("example_id", "offset", "idx", "act", "g")


def _write_records(arrays, buf, lo: int, hi: int) -> None:
  """Writes buffered tokens [lo, hi) and keeps the rest in the buffer."""
  futures = []
  for name, parts in buf.items():
    block = np.concatenate(parts)
    futures.append(arrays[name][lo:hi].write(block[:hi - lo]))
    buf[name][:] = [block[hi - lo:]]
  for fut in futures:
    fut.result()


def _save_pass1(path, acc, row_counts, rows_done, shard):
  shards.save_npz(path, row_counts=row_counts, rows_done=rows_done, shard=shard,
                  **acc.state())
