"""Parallel, resumable packer: sources -> pieces of tokenized rows (pack_format.py).

  pack(data_cfg, vocab_size, out_dir)    # every process of a job calls it; they cooperate

Process 0 writes the plan (plan.py: pieces from the sources alone) and builds the
tokenizer (BPE / char learn from a bounded, seeded sample of training documents); each
process then packs the pieces k with k % P == its index, with `workers` worker
processes; process 0 writes metadata.json once every piece is done. Rows depend on the
sources, the config and the seeds only: the same bits for any number of processes and
workers. A killed pack resumes: finished pieces (done.json) are kept, the rest redone.
Memory (the bound, measured by benchmarks/bench_pack.py at 0.25 and 1 GB of text): a
worker holds one piece (PIECE_BYTES of text, streamed in batches of documents; its tokens;
one 8 MB shard of rows), a packing process the plan and the pieces' counts (~1 KB per
piece); with GPT-2's BPE at T = 1024 each stays under 512 MB whatever the corpus size, so
a host packing with W workers under (1 + W) x 512 MB. A source unit larger than a piece
(a .txt/.jsonl file, a parquet row group over PIECE_BYTES) is a piece alone: the worker's
memory then grows with that unit, not with the corpus. A gs:// pack is written object
by object, with no local copy.

Processes of a multi-host job share the work when they share the directory (gs://, or a
local path on a shared filesystem: checked by a probe file); with a host-local directory
each host packs the whole corpus itself, and a warning says so.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import time
from typing import Any, Iterator

from absl import logging
import numpy as np

from prism_jax import paths
from prism_jax.data import coordination
from prism_jax.data import pack_format as fmt
from prism_jax.data import piece as piece_lib
from prism_jax.data import plan as plan_lib
from prism_jax.data import sources as sources_lib
from prism_jax.data import tokenizers as tok_lib

FORMAT_VERSION = fmt.FORMAT_VERSION
SPLITS, FIELDS, METADATA = fmt.SPLITS, fmt.FIELDS, fmt.METADATA
PIECE_BYTES = 32 << 20  # text per piece: a worker's memory, the resume granularity
# BPE and char learn from at most this many characters of training documents.
BPE_MAX_TRAIN_CHARS = 50_000_000
_PROGRESS_EVERY_S = 10.0


def pack_config(data_cfg, vocab_size: int, piece_bytes: int = PIECE_BYTES) -> dict[str, Any]:
  """Everything that determines the packed bytes (packed_dir and data.seed excluded)."""
  return {
      "format_version": FORMAT_VERSION,
      "sources": list(data_cfg.sources),
      "text_field": data_cfg.text_field,
      "tokenizer": data_cfg.tokenizer,
      "vocab_size": int(vocab_size),
      "seq_len": int(data_cfg.seq_len),
      "val_fraction": float(data_cfg.val_fraction),
      "on_decode_error": data_cfg.on_decode_error,
      "val_sources": list(data_cfg.val_sources),
      "txt_documents": data_cfg.txt_documents,
      "split_seed": int(data_cfg.split_seed),
      "piece_bytes": int(piece_bytes),
  }


def _differences(stored: dict, wanted: dict) -> list[str]:
  keys = sorted(set(stored) | set(wanted))
  return [f"{k} (stored {stored.get(k)!r}, requested {wanted.get(k)!r})"
          for k in keys if stored.get(k) != wanted.get(k)]


def _check_same(what: str, out_dir: str, meta: dict, config: dict, source_hash: str):
  stored = dict(meta["config"], source_hash=meta["source_hash"])
  diff = _differences(stored, dict(config, source_hash=source_hash))
  if diff:
    raise ValueError(f"{what} in {out_dir} was built with a different config: "
                     + "; ".join(diff) + ". Remove it or choose another data.packed_dir")


def check_existing(out_dir: str, config: dict, source_hash: str) -> str | None:
  """"finished", "partial" (a killed pack of this config) or None (nothing there);
  raises for another config, a format-1 pack or a directory that is not a pack."""
  if not paths.path(out_dir).exists():
    return None
  meta_path = paths.join(out_dir, METADATA)
  if paths.path(meta_path).is_file():
    meta = fmt.read_json(meta_path)
    if not isinstance(meta, dict) or not {"config", "source_hash"} <= set(meta):
      raise ValueError(f"{meta_path} is not the metadata of a packed dataset (no config / "
                       "source_hash); something else wrote into data.packed_dir. Remove "
                       f"{out_dir} to repack, or choose another data.packed_dir")
    fmt.check_format(out_dir, meta)
    _check_same("packed data", out_dir, meta, config, source_hash)
    return "finished"
  plan_path = paths.join(out_dir, fmt.PLAN)
  if paths.path(plan_path).is_file():
    _check_same("an unfinished pack", out_dir, fmt.read_json(plan_path), config, source_hash)
    return "partial"
  if {p.name for p in paths.path(out_dir).iterdir()} == {tok_lib.TOKENIZER_FILE}:
    return None  # a tokenizer given before the pack (an imported checkpoint's, or a run's
    # own after its format-1 arrays were removed): the pack uses it
  raise ValueError(f"{out_dir} exists but is not a finished packed dataset (no {METADATA}); "
                   "remove it or choose another data.packed_dir")


def _settings(data_cfg, vocab_size: int) -> dict[str, Any]:
  """What a piece worker needs (picklable)."""
  return {"text_field": data_cfg.text_field, "on_decode_error": data_cfg.on_decode_error,
          "txt_documents": data_cfg.txt_documents, "seq_len": int(data_cfg.seq_len),
          "vocab_size": int(vocab_size), "split_seed": int(data_cfg.split_seed),
          # with validation files the split is the files: val_fraction does not apply
          "val_fraction": 0.0 if data_cfg.val_sources else float(data_cfg.val_fraction)}


def training_texts(plan: dict, settings: dict, budget: int = BPE_MAX_TRAIN_CHARS
                   ) -> Iterator[str]:
  """Training documents of the pieces in a seeded order, up to `budget` characters: the
  bounded sample BPE and char learn from (one piece's texts in memory at a time)."""
  pieces = plan["pieces"]
  for k in np.random.default_rng(settings["split_seed"]).permutation(len(pieces)):
    docs = [text for _, _, text in plan_lib.iter_piece(pieces[k], settings, warn=False)]
    val = plan_lib.is_val(int(k), len(docs), settings["val_fraction"],
                          settings["split_seed"], pieces[k]["val_files"])
    for text, v in zip(docs, val):
      if not v:
        yield text
        budget -= len(text)
        if budget <= 0:
          return


def _shares_directory(out_dir: str, procs) -> bool:
  """True if every process sees what process 0 writes into out_dir."""
  if procs.count == 1 or paths.is_remote(out_dir):
    return True
  nonce = procs.broadcast_int(int(np.random.default_rng().integers(1 << 62)))
  probe = paths.join(out_dir, f".probe-{nonce}")
  if procs.index == 0:
    paths.path(out_dir).mkdir(parents=True, exist_ok=True)
    paths.write_text_atomic(probe, "")
  procs.barrier("probe")
  shared = procs.all_true(paths.path(probe).exists())
  procs.barrier("probe_read")
  if procs.index == 0:
    paths.path(probe).unlink()
  return shared


def pack(data_cfg, vocab_size: int, out_dir: str, *, workers: int | None = None,
         piece_bytes: int = PIECE_BYTES, processes: coordination.Processes | None = None
         ) -> str:
  """Packs the sources into out_dir, resumes a killed pack, or reuses a finished one.

  Every process of a job calls this (`processes`: jax.distributed's by default);
  `workers`: worker processes per process (default: the CPU count; 0 or 1 packs in this
  process). A finished directory of another config is refused, naming the differences.
  """
  t0 = time.time()
  out_dir = paths.resolve(out_dir)
  paths.check_access(out_dir)
  procs = processes or coordination.current()
  config = pack_config(data_cfg, vocab_size, piece_bytes)
  if data_cfg.val_sources:
    sources_lib.check_disjoint(data_cfg.sources, data_cfg.val_sources)
  src_hash = procs.broadcast_hex(lambda: sources_lib.source_hash(
      data_cfg.sources, data_cfg.text_field, data_cfg.val_sources))
  state = check_existing(out_dir, config, src_hash)
  if procs.all_true(state == "finished"):  # (a collective: every process decides alike)
    logging.info("packing: reusing %s", out_dir)
    return out_dir
  if not _shares_directory(out_dir, procs):
    logging.warning("packing: the processes do not share %s, so each packs the whole corpus "
                    "itself; pack into gs:// (or a shared filesystem) to split the work",
                    out_dir)
    if state == "finished":  # this host's own copy is done
      return out_dir
    procs = coordination.Processes()
  settings = _settings(data_cfg, vocab_size)
  if procs.index == 0:
    if state is None:
      fmt.write_json(paths.join(out_dir, fmt.PLAN), {
          "config": config, "source_hash": src_hash,
          "plan": plan_lib.make_plan(data_cfg, piece_bytes)})
    if not paths.path(paths.join(out_dir, tok_lib.TOKENIZER_FILE)).is_file():
      plan = fmt.read_json(paths.join(out_dir, fmt.PLAN))["plan"]
      texts = (training_texts(plan, settings) if data_cfg.tokenizer in ("bpe", "char")
               else None)
      tok_lib.make_tokenizer(data_cfg.tokenizer, vocab_size, texts).save(out_dir)
  procs.barrier("plan")
  plan = fmt.read_json(paths.join(out_dir, fmt.PLAN))["plan"]
  tok = tok_lib.load_tokenizer(out_dir)
  pieces = plan["pieces"]
  mine = [k for k in range(procs.index, len(pieces), procs.count)
          if not paths.path(paths.join(fmt.piece_dir(out_dir, k), fmt.DONE)).is_file()]
  logging.info("packing: %d pieces, %d to do here (process %d of %d), %s tokenizer (vocab "
               "%d)", len(pieces), len(mine), procs.index, procs.count, tok.kind,
               tok.vocab_size)
  _pack_pieces(out_dir, pieces, mine, settings, tok, workers)
  procs.barrier("pieces")
  try:
    meta = _metadata(out_dir, plan, config, src_hash, tok, data_cfg)
  except ValueError:
    if procs.index == 0:  # the corpus itself is unusable: leave nothing half-written
      paths.path(out_dir).rmtree()
    raise
  if procs.index == 0:
    meta["seconds_last_run"] = round(time.time() - t0, 2)
    fmt.write_json(paths.join(out_dir, METADATA), meta)
    c = meta["counts"]
    logging.info("packing: done, %d documents, %d tokens, rows train=%d val=%d, %.1f s",
                 c["documents"], c["tokens"], c["train"]["rows"], c["val"]["rows"],
                 time.time() - t0)
  procs.barrier("metadata")
  return out_dir


def _pack_pieces(out_dir, pieces, todo, settings, tok, workers) -> None:
  workers = os.cpu_count() if workers is None else workers
  workers = min(workers, len(todo))
  t0 = last = time.time()
  tokens = 0

  def progress(i, summary):
    nonlocal tokens, last
    tokens += sum(summary["split_tokens"])
    if time.time() - last > _PROGRESS_EVERY_S:
      last = time.time()
      logging.info("packing: %d/%d pieces here, %d tokens, %.0f tokens/s", i + 1, len(todo),
                   tokens, tokens / (last - t0))

  if workers <= 1:
    for i, k in enumerate(todo):
      progress(i, piece_lib.pack_piece(out_dir, pieces[k], k, settings, tok))
    return
  ctx = multiprocessing.get_context("spawn")  # never fork a process that runs JAX
  with cf.ProcessPoolExecutor(workers, mp_context=ctx,
                              initializer=piece_lib.worker_init,
                              initargs=(os.getpid(),)) as pool:
    futures = [pool.submit(piece_lib.pack_piece_in_worker, out_dir, pieces[k], k, settings)
               for k in todo]
    try:
      for i, f in enumerate(cf.as_completed(futures)):
        progress(i, f.result())
    except BaseException:
      pool.shutdown(wait=True, cancel_futures=True)
      raise


def _read_summaries(out_dir: str, n: int) -> list[dict]:
  with cf.ThreadPoolExecutor(16) as pool:  # many small reads: latency-bound on gs://
    return list(pool.map(lambda k: fmt.read_json(paths.join(fmt.piece_dir(out_dir, k),
                                                            fmt.DONE)), range(n)))


def _metadata(out_dir, plan, config, src_hash, tok, data_cfg) -> dict[str, Any]:
  """metadata.json from the pieces' summaries; raises if the corpus cannot be used."""
  summaries = _read_summaries(out_dir, len(plan["pieces"]))
  file_docs = np.zeros(len(plan["files"]), np.int64)
  for piece, s in zip(plan["pieces"], summaries):
    for unit, n in zip(piece["units"], s["unit_docs"]):
      file_docs[unit["file"]] += n
  n_docs = int(file_docs.sum())
  if n_docs == 0:
    raise ValueError(f"no documents in data sources {list(data_cfg.sources) or sources_lib.DEFAULT_CORPUS}")
  empty = [f for f, n in zip(plan["files"], file_docs) if n == 0]
  if empty:
    raise ValueError(f"data source {empty[0]!r} holds no non-blank documents")
  split_docs = np.sum([s["split_documents"] for s in summaries], axis=0)
  if data_cfg.val_fraction > 0 and not data_cfg.val_sources and 0 in split_docs:
    if n_docs < 2:
      raise ValueError(f"the corpus has {n_docs} document(s): a train/val split by document "
                       "needs at least 2 (add text or set data.val_fraction=0)")
    raise ValueError(f"no document of the {n_docs} was drawn for "
                     f"{SPLITS[int(np.argmin(split_docs))]}; change data.split_seed or "
                     "data.val_fraction")
  split_tokens = np.sum([s["split_tokens"] for s in summaries], axis=0)
  n_tokens, T = int(split_tokens.sum()), int(data_cfg.seq_len)
  if n_tokens < T + 1:
    raise ValueError(f"corpus has {n_tokens} tokens, fewer than seq_len+1={T + 1} (one "
                     f"packed row); add text or lower data.seq_len")
  rows = [[s["rows"][i] for s in summaries] for i in range(len(SPLITS))]
  counts = {split: {"documents": int(split_docs[i]), "rows": int(sum(rows[i])),
                    "tokens": int(split_tokens[i])} for i, split in enumerate(SPLITS)}
  return {"format_version": FORMAT_VERSION, "config": config, "source_hash": src_hash,
          "tokenizer": {"kind": tok.kind, "vocab_size": tok.vocab_size,
                        "eos_id": tok.eos_id, "pad_id": tok.pad_id},
          "counts": dict(counts, documents=n_docs, tokens=n_tokens),
          "pieces": {"documents": [s["documents"] for s in summaries],
                     **{f"{split}_rows": rows[i] for i, split in enumerate(SPLITS)}}}
