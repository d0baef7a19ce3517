"""Pass 3 of the cache build: the inverted index (CSR) prototype -> tokens, split over
processes, with the same bits for any process count.

The index (format in cache.py): proto_offsets (K+1,), proto_tokens and proto_acts, each
prototype's entries by decreasing activation, ties by token index. (prototype, token) is
unique (a token's k prototypes are distinct), so the key (prototype, -act, token) is a
total order and the sorted index does not depend on how the entries were split. Under
jax.distributed (any process count P, one process alike):

  1. part: process p reads the idx/act records of its token share (chunk-aligned, as in
     pass 2) and writes them sorted by the key as its own CSR part
     (index_part-<p>-{offsets,tokens,acts}).
  2. create: the global offsets are the sum of the parts' per-prototype counts; process 0
     creates proto_tokens / proto_acts, chunked by (records chunk)·k entries.
  3. write: the entry axis is cut at chunk boundaries into P shares; process p merges, a
     group of whole prototypes at a time, the parts' slices of those prototypes (reading
     only them) and writes the entries of its share in whole chunks (no chunk has two
     writers). Memory: a group (>= 16 chunks of entries, or one prototype) and a chunk.
  4. finish (process 0): num_examples into metadata.json (the parts' largest example ids),
     then proto_offsets, whose presence marks the index complete; parts and index progress
     files are deleted.

Each process's progress (progress-index-<p>.json) records its finished steps and entries
written after each write; a rerun with the same process count resumes where it stopped.
"""

from __future__ import annotations

import numpy as np

from prism_jax import paths
from prism_jax.attribution.caching import cache_format as fmt
from prism_jax.attribution.caching import cache_shards as shards

OFFSETS = "proto_offsets"  # written last: its presence means the index is complete
GROUP_CHUNKS = 16  # entries merged per group: at least this many chunks (or one prototype)


def progress_name(pid: int) -> str:
  return f"progress-index-{pid}.json"  # a build file (cache_shards.is_build_file)


def part_name(pid: int, field: str) -> str:
  return f"index_part-{pid:05d}-{field}"


def index_pass(out_dir: str, driver: str, num_protos: int, *, on_block=None) -> None:
  """Builds (or resumes) the inverted index of out_dir's idx/act records; every process
  of a jax.distributed job calls it. `on_block(entries_done)` after every write."""
  pid, count = shards.process()
  if fmt.exists(paths.join(out_dir, OFFSETS)):
    return
  write_part(out_dir, driver, num_protos, pid, count)
  shards.sync(f"cache index parts {out_dir}")
  if pid == 0:
    create_outputs(out_dir, driver, count)
  shards.sync(f"cache index created {out_dir}")
  write_share(out_dir, driver, pid, count, on_block=on_block)
  shards.sync(f"cache index written {out_dir}")
  if pid == 0:
    finish(out_dir, driver, count)
  shards.sync(f"cache index complete {out_dir}")


def _prog(out_dir: str, pid: int) -> dict:
  path = paths.join(out_dir, progress_name(pid))
  return fmt.read_json(path) if fmt.exists(path) else {}


def _save_prog(out_dir: str, pid: int, prog: dict) -> None:
  fmt.write_json(paths.join(out_dir, progress_name(pid)), prog)


def _entry_chunk(idx_store) -> int:
  """Index chunk length: a records chunk's worth of entries (tokens x k)."""
  return int(idx_store.chunk_layout.write_chunk.shape[0]) * int(idx_store.shape[1])


def write_part(out_dir: str, driver: str, num_protos: int, pid: int, count: int) -> None:
  """Step 1: process pid's token share of idx/act as a sorted CSR part."""
  prog = _prog(out_dir, pid)
  if prog.get("count", count) != count:
    raise ValueError(f"{out_dir}: the index pass was started with {prog['count']} "
                     f"processes, now {count}; resume it with the same number of processes")
  if prog.get("part"):
    return
  idx_store = fmt.store(out_dir, "idx", driver)
  num_tokens, k = (int(s) for s in idx_store.shape)
  lo, hi = shards.token_share(num_tokens, int(idx_store.chunk_layout.write_chunk.shape[0]),
                              pid, count)
  if hi > lo:
    reads = [idx_store[lo:hi].read(), fmt.store(out_dir, "act", driver)[lo:hi].read(),
             fmt.store(out_dir, "example_id", driver)[lo:hi].read()]
    idx_Nxk, act_Nxk, ids = (r.result() for r in reads)
  else:
    idx_Nxk, act_Nxk, ids = (np.zeros((0, k), np.int32), np.zeros((0, k), np.float32),
                             np.zeros(0, np.int32))
  proto = idx_Nxk.reshape(-1).astype(np.int64)
  tok = lo + np.repeat(np.arange(hi - lo, dtype=np.int64), k)
  act = act_Nxk.reshape(-1)
  keep = act > 0  # a ReLU-zero activation contributes nothing to any score
  proto, tok, act = proto[keep], tok[keep], act[keep]
  order = np.lexsort((tok, -act, proto))
  offsets = np.concatenate([[0], np.cumsum(np.bincount(proto, minlength=num_protos))])
  chunk = _entry_chunk(idx_store)
  fmt.write_array(out_dir, part_name(pid, "offsets"), driver, offsets.astype(np.int64))
  for field, values in (("tokens", tok[order].astype(_token_dtype(num_tokens))),
                        ("acts", act[order].astype(np.float32))):
    _write_chunked(out_dir, part_name(pid, field), driver, values, chunk)
  _save_prog(out_dir, pid, {"count": count, "part": True,
                            "max_example_id": int(ids.max()) if len(ids) else -1})


def _token_dtype(num_tokens: int):
  return np.int32 if num_tokens < 2 ** 31 else np.int64


def _write_chunked(out_dir, name, driver, values, chunk) -> None:
  """A 1-D array in chunks of `chunk` (an empty one as one placeholder element)."""
  values = values if len(values) else np.zeros(1, values.dtype)
  fmt.store(out_dir, name, driver, shape=values.shape, dtype=values.dtype,
            chunks=(min(chunk, len(values)),), create=True).write(values).result()


def _global_offsets(out_dir: str, driver: str, count: int) -> tuple[np.ndarray, list]:
  """(global proto_offsets, each part's offsets): a prototype's entries are the sum of
  the parts' entries."""
  parts = [fmt.store(out_dir, part_name(q, "offsets"), driver).read() for q in range(count)]
  parts = [np.asarray(p.result(), np.int64) for p in parts]
  counts = sum(np.diff(p) for p in parts)
  return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), parts


def create_outputs(out_dir: str, driver: str, count: int) -> None:
  """Step 2 (process 0): the empty proto_tokens / proto_acts arrays, chunked."""
  prog = _prog(out_dir, 0)
  if prog.get("created"):  # never again: other processes may have written their shares
    return
  offsets, _ = _global_offsets(out_dir, driver, count)
  idx_store = fmt.store(out_dir, "idx", driver)
  total, chunk = max(int(offsets[-1]), 1), _entry_chunk(idx_store)
  for name, dtype in (("proto_tokens", _token_dtype(int(idx_store.shape[0]))),
                      ("proto_acts", np.float32)):
    arr = fmt.store(out_dir, name, driver, shape=(total,), dtype=dtype,
                    chunks=(min(chunk, total),), create=True)
    if not offsets[-1]:  # no entries: one placeholder element, as before
      arr.write(np.zeros(1, dtype)).result()
  _save_prog(out_dir, 0, {**prog, "created": True})


def write_share(out_dir: str, driver: str, pid: int, count: int, *, on_block=None) -> None:
  """Step 3: process pid's chunk-aligned share of the sorted entries, merged from the
  parts one group of whole prototypes at a time and written in whole chunks."""
  prog = _prog(out_dir, pid)
  offsets, part_offsets = _global_offsets(out_dir, driver, count)
  out = {f: fmt.store(out_dir, f"proto_{f}", driver) for f in ("tokens", "acts")}
  chunk = int(out["tokens"].chunk_layout.write_chunk.shape[0])
  lo, hi = shards.token_share(int(offsets[-1]), chunk, pid, count)
  done = int(prog.get("entries_done", lo))
  if prog.get("share", [lo, hi]) != [lo, hi]:
    raise ValueError(f"{out_dir}: the index was being written with another process count "
                     f"(share {prog['share']}, now {[lo, hi]}); resume with the same number")
  parts = [{f: fmt.store(out_dir, part_name(q, f), driver) for f in ("tokens", "acts")}
           for q in range(count)]
  num_protos = len(offsets) - 1
  i = int(np.searchsorted(offsets, done, side="right")) - 1 if done < hi else num_protos
  buf = {"tokens": [], "acts": []}
  buf_hi = done  # the buffer holds entries [done, buf_hi)
  while i < num_protos and offsets[i] < hi:
    j = i + 1  # the group: prototypes [i, j)
    while j < num_protos and offsets[j] < hi and offsets[j] - offsets[i] < GROUP_CHUNKS * chunk:
      j += 1
    tok, act = _merge(parts, part_offsets, i, j)
    a, b = max(int(offsets[i]), buf_hi), min(int(offsets[j]), hi)  # new entries of the group
    buf["tokens"].append(tok[a - offsets[i]:b - offsets[i]])
    buf["acts"].append(act[a - offsets[i]:b - offsets[i]])
    buf_hi, i = b, j
    end = buf_hi if buf_hi == hi else done + (buf_hi - done) // chunk * chunk
    if end > done:
      futures = []
      for f, pieces in buf.items():
        block = np.concatenate(pieces)
        futures.append(out[f][done:end].write(block[:end - done]))
        buf[f] = [block[end - done:]]
      for fut in futures:
        fut.result()
      done = end
      _save_prog(out_dir, pid, {**prog, "share": [lo, hi], "entries_done": done})
      if on_block:
        on_block(done)
  if done < hi:
    raise RuntimeError(f"{out_dir}: index share {lo}:{hi} ended at {done} (parts changed?)")


def _merge(parts, part_offsets, i: int, j: int) -> tuple[np.ndarray, np.ndarray]:
  """(tokens, acts) of prototypes [i, j) from every part, sorted by the index's key."""
  reads, protos = [], []
  for part, offs in zip(parts, part_offsets):
    lo, hi = int(offs[i]), int(offs[j])
    if hi > lo:
      reads.append((part["tokens"][lo:hi].read(), part["acts"][lo:hi].read()))
      protos.append(np.repeat(np.arange(i, j, dtype=np.int64), np.diff(offs[i:j + 1])))
  if not reads:  # (a group always holds entries of some part; kept for safety)
    return (np.zeros(0, parts[0]["tokens"].dtype.numpy_dtype),
            np.zeros(0, np.float32))
  tok = np.concatenate([t.result() for t, _ in reads])
  act = np.concatenate([a.result() for _, a in reads])
  order = np.lexsort((tok, -act, np.concatenate(protos)))
  return tok[order], act[order]


def finish(out_dir: str, driver: str, count: int) -> None:
  """Step 4 (process 0): num_examples into metadata.json, then proto_offsets (the index
  is complete), then the parts and index progress files are removed."""
  progs = [_prog(out_dir, q) for q in range(count)]
  offsets, _ = _global_offsets(out_dir, driver, count)
  meta_path = paths.join(out_dir, fmt.METADATA)
  meta = fmt.read_json(meta_path)
  num_tokens = int(fmt.store(out_dir, "idx", driver).shape[0])
  meta["num_examples"] = max(p["max_example_id"] for p in progs) + 1 if num_tokens else 0
  fmt.write_json(meta_path, meta)  # stored, so opening the cache reads no record chunk
  fmt.write_array(out_dir, OFFSETS, driver, offsets)
  cleanup(out_dir)


def cleanup(out_dir: str) -> None:
  """Removes the index parts and progress files left in out_dir (idempotent)."""
  for entry in paths.path(out_dir).iterdir():
    if entry.name.startswith("index_part-"):
      entry.rmtree()
    elif entry.name.startswith("progress-index-"):
      entry.unlink()
