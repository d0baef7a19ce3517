"""Offline packer: documents -> tokens + EOS -> fixed rows of seq_len + 1 tokens.

Each split (train/val, split BY DOCUMENT) is one token stream: a leading EOS, then every
document's tokens followed by EOS. Row r holds stream[r*T : r*T + T + 1] (T = seq_len),
so consecutive rows overlap by one token and every stream token after the first is a
target exactly once; the last partial row is padded with PAD. For every token we store
(example id, offset within its document), -1 on the leading EOS and on padding.

Layout of a packed directory (written to a temp dir, then renamed: a killed run leaves
no half-finished directory, and a rerun starts over):
  metadata.json                config, source hash, tokenizer, counts
  tokenizer.json               reload with load_tokenizer(dir)
  {split}_tokens.npy           int32 (R, T+1)
  {split}_example_id.npy       int32 (R, T+1)
  {split}_offset.npy           int32 (R, T+1)
  documents.npy                int64 (n_docs, 3): split (0 train, 1 val), stream start,
                               length in tokens including the EOS
  names.txt                    one document name per line ("file:line", "pydoc:topic")
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
from typing import Any, Iterator, NamedTuple

from absl import logging
import numpy as np

from prism_jax import paths
from prism_jax.data import sources as sources_lib
from prism_jax.data import tokenizers as tok_lib

FORMAT_VERSION = 1
SPLITS = ("train", "val")
FIELDS = ("tokens", "example_id", "offset")
METADATA = "metadata.json"
# BPE trains on at most this many characters of the train split (seconds, not minutes).
BPE_MAX_TRAIN_CHARS = 50_000_000
_ENCODE_CHUNK = 512  # documents per encode_batch call
_PROGRESS_EVERY_S = 10.0


def pack_config(data_cfg, vocab_size: int) -> dict[str, Any]:
  """Everything that determines the packed bytes (packed_dir excluded)."""
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
      "split_seed": int(data_cfg.split_seed),  # data.seed (the shuffle) does not enter
  }


def _upgrade(stored: dict) -> dict:
  """A pack written before val_sources / txt_documents / split_seed existed: its split
  used data.seed, and it had no val files and paragraph documents."""
  stored = dict(stored)
  if "split_seed" not in stored and "seed" in stored:
    stored["split_seed"] = stored.pop("seed")
  stored.setdefault("val_sources", [])
  stored.setdefault("txt_documents", "paragraphs")
  return stored


def _differences(stored: dict, wanted: dict) -> list[str]:
  keys = sorted(set(stored) | set(wanted))
  return [f"{k} (stored {stored.get(k)!r}, requested {wanted.get(k)!r})"
          for k in keys if stored.get(k) != wanted.get(k)]


def check_existing(out_dir: str, config: dict, source_hash: str) -> bool:
  """True if out_dir is a finished pack of this config; raises if it holds another."""
  if not paths.path(out_dir).exists():
    return False
  meta_path = paths.join(out_dir, METADATA)
  if not paths.path(meta_path).is_file():
    raise ValueError(f"{out_dir} exists but is not a finished packed dataset (no "
                     f"{METADATA}); remove it or choose another data.packed_dir")
  meta = json.loads(paths.path(meta_path).read_text())
  if not isinstance(meta, dict) or not {"config", "source_hash"} <= set(meta):
    raise ValueError(f"{meta_path} is not the metadata of a packed dataset (no config / "
                     "source_hash); something else wrote into data.packed_dir. Remove "
                     f"{out_dir} to repack, or choose another data.packed_dir")
  stored = dict(_upgrade(meta["config"]), source_hash=meta["source_hash"])
  diff = _differences(stored, dict(config, source_hash=source_hash))
  if diff:
    raise ValueError(f"packed data in {out_dir} was built with a different config: "
                     + "; ".join(diff) + ". Remove it or choose another data.packed_dir")
  return True


class _SplitWriter:
  """Streams one split's tokens into (T+1)-token rows with a one-token overlap."""

  def __init__(self, directory: str, split: str, seq_len: int, eos_id: int, pad_id: int):
    self.T, self.pad_id = seq_len, pad_id
    self.paths = {f: os.path.join(directory, f"{split}_{f}.bin") for f in FIELDS}
    self.files = {f: open(p, "wb") for f, p in self.paths.items()}
    self.pending = {f: [np.array([v], np.int32)] for f, v in
                    zip(FIELDS, (eos_id, -1, -1))}  # the leading EOS: input only
    self.pending_len = 1
    self.stream_len = 1  # tokens in the stream so far
    self.rows = 0
    self.documents = 0

  def add(self, tokens_L: np.ndarray, example_id: int) -> int:
    """Appends one document (EOS included); returns its start in the stream."""
    start, n = self.stream_len, len(tokens_L)
    self.pending["tokens"].append(tokens_L.astype(np.int32))
    self.pending["example_id"].append(np.full(n, example_id, np.int32))
    self.pending["offset"].append(np.arange(n, dtype=np.int32))
    self.pending_len += n
    self.stream_len += n
    self.documents += 1
    if self.pending_len >= 64 * (self.T + 1):
      self._flush(final=False)
    return start

  def _flush(self, final: bool) -> None:
    T = self.T
    arrays = {f: np.concatenate(v) for f, v in self.pending.items()}
    m = len(arrays["tokens"])
    if final and m > 1:  # pad the last partial row to T+1
      k, pad = -(-(m - 1) // T), -(m - 1) % T
      fills = {"tokens": self.pad_id, "example_id": -1, "offset": -1}
      arrays = {f: np.concatenate([a, np.full(pad, fills[f], np.int32)])
                for f, a in arrays.items()}
    else:
      k = (m - 1) // T
    idx_RxT1 = np.arange(k)[:, None] * T + np.arange(T + 1)[None, :]
    for f, a in arrays.items():
      self.files[f].write(np.ascontiguousarray(a[idx_RxT1]).tobytes())
      self.pending[f] = [a[k * T:]]
    self.rows += k
    self.pending_len = m - k * T

  def finish(self) -> None:
    self._flush(final=True)
    for f, fh in self.files.items():
      fh.close()
      out = np.lib.format.open_memmap(self.paths[f][:-4] + ".npy", mode="w+",
                                      dtype=np.int32, shape=(self.rows, self.T + 1))
      raw = np.memmap(self.paths[f], dtype=np.int32, mode="r") if self.rows else None
      if raw is not None:
        step = max(1, (1 << 24) // (self.T + 1))
        for r in range(0, self.rows, step):
          out[r:r + step] = raw[r * (self.T + 1):(r + step) * (self.T + 1)].reshape(
              -1, self.T + 1)
        del raw
      out.flush()
      del out
      os.remove(self.paths[f])


def _split_documents(n_docs: int, val_fraction: float, seed: int) -> np.ndarray:
  """Boolean is_val per document: a seeded choice of round(val_fraction * n) docs."""
  if val_fraction <= 0:
    return np.zeros(n_docs, bool)
  if n_docs < 2:
    raise ValueError(f"the corpus has {n_docs} document(s): a train/val split by document "
                     "needs at least 2 (add text or set data.val_fraction=0)")
  n_val = int(np.clip(round(val_fraction * n_docs), 1, n_docs - 1))
  is_val = np.zeros(n_docs, bool)
  is_val[np.random.default_rng(seed).permutation(n_docs)[:n_val]] = True
  return is_val


class _SourcedDocument(NamedTuple):
  example_id: int
  name: str
  text: str
  from_val_sources: bool


def _documents(data_cfg, warn: bool) -> Iterator[_SourcedDocument]:
  """Every document of the training sources, then of the validation sources (ids go on)."""
  kw = dict(text_field=data_cfg.text_field, on_decode_error=data_cfg.on_decode_error,
            txt_documents=data_cfg.txt_documents, warn=warn)
  next_id = 0
  for d in sources_lib.iter_documents(tuple(data_cfg.sources), **kw):
    next_id = d.example_id + 1
    yield _SourcedDocument(d.example_id, d.name, d.text, False)
  if data_cfg.val_sources:
    for d in sources_lib.iter_documents(tuple(data_cfg.val_sources), first_id=next_id, **kw):
      yield _SourcedDocument(d.example_id, d.name, d.text, True)


def _training_texts(docs: Iterator, is_val: np.ndarray) -> Iterator[str]:
  """The train split's texts, up to BPE_MAX_TRAIN_CHARS: what BPE and char learn from."""
  budget = BPE_MAX_TRAIN_CHARS
  for d in docs:
    if not is_val[d.example_id]:
      yield d.text
      budget -= len(d.text)
      if budget <= 0:
        return


def _chunks(it, n):
  chunk = []
  for x in it:
    chunk.append(x)
    if len(chunk) == n:
      yield chunk
      chunk = []
  if chunk:
    yield chunk


def _write_pack(tmp: str, data_cfg, vocab_size: int, config: dict, src_hash: str) -> None:
  srcs = tuple(data_cfg.sources)
  t0 = time.time()
  # Pass 1: names and the document count (this pass logs the non-UTF-8 warnings).
  n_docs, n_train_docs = 0, 0
  with open(os.path.join(tmp, "names.txt"), "w", encoding="utf-8") as f:
    for d in _documents(data_cfg, warn=True):
      f.write(d.name.replace("\n", " ") + "\n")
      n_docs += 1
      n_train_docs += not d.from_val_sources
  if n_docs == 0:
    raise ValueError(f"no documents in data sources {list(srcs) or sources_lib.DEFAULT_CORPUS}")
  if data_cfg.val_sources:  # the split is the files: val_fraction does not apply
    is_val = np.arange(n_docs) >= n_train_docs
  else:
    is_val = _split_documents(n_docs, data_cfg.val_fraction, data_cfg.split_seed)
  # Pass 2: the tokenizer (BPE and char learn from the train split only).
  texts = None
  if data_cfg.tokenizer in ("bpe", "char"):
    texts = _training_texts(_documents(data_cfg, warn=False), is_val)
  tok = tok_lib.make_tokenizer(data_cfg.tokenizer, vocab_size, texts)
  tok.save(tmp)
  logging.info("packing: %d documents, %s tokenizer (vocab %d) ready in %.1f s", n_docs,
               tok.kind, tok.vocab_size, time.time() - t0)
  # Pass 3: tokenize and write rows.
  T = data_cfg.seq_len
  writers = {s: _SplitWriter(tmp, s, T, tok.eos_id, tok.pad_id) for s in SPLITS}
  docs_Nx3 = np.zeros((n_docs, 3), np.int64)
  n_tokens, done, last_log = 0, 0, time.time()
  for chunk in _chunks(_documents(data_cfg, warn=False), _ENCODE_CHUNK):
    for d, ids in zip(chunk, tok.encode_batch([d.text for d in chunk])):
      tokens_L = np.asarray(ids + [tok.eos_id], np.int32)
      split = int(is_val[d.example_id])
      start = writers[SPLITS[split]].add(tokens_L, d.example_id)
      docs_Nx3[d.example_id] = (split, start, len(tokens_L))
      n_tokens += len(tokens_L)
    done += len(chunk)
    if time.time() - last_log > _PROGRESS_EVERY_S:
      last_log = time.time()
      logging.info("packing: %d/%d documents, %d tokens, %.0f s", done, n_docs, n_tokens,
                   last_log - t0)
  if n_tokens < T + 1:
    raise ValueError(f"corpus has {n_tokens} tokens, fewer than seq_len+1={T + 1} (one "
                     f"packed row); add text or lower data.seq_len")
  for w in writers.values():
    w.finish()
  np.save(os.path.join(tmp, "documents.npy"), docs_Nx3)
  counts = {s: {"documents": w.documents, "rows": w.rows, "tokens": w.stream_len - 1}
            for s, w in writers.items()}
  meta = {"config": config, "source_hash": src_hash,
          "tokenizer": {"kind": tok.kind, "vocab_size": tok.vocab_size,
                        "eos_id": tok.eos_id, "pad_id": tok.pad_id},
          "counts": dict(counts, documents=n_docs, tokens=n_tokens),
          "seconds": round(time.time() - t0, 2)}
  with open(os.path.join(tmp, METADATA), "w") as f:
    json.dump(meta, f, indent=2, sort_keys=True)
  logging.info("packing: done, %d documents, %d tokens, rows train=%d val=%d, %.1f s",
               n_docs, n_tokens, counts["train"]["rows"], counts["val"]["rows"],
               time.time() - t0)


def _remove_stale_temps(out_dir: str) -> None:
  """Removes temp dirs that a killed packer on this host left behind."""
  parent, base = os.path.split(os.path.abspath(out_dir))
  prefix = f"{base}.tmp-{socket.gethostname()}-"
  for name in os.listdir(parent):
    if not name.startswith(prefix):
      continue
    try:
      pid = int(name[len(prefix):].split("-")[0])
      os.kill(pid, 0)
    except ProcessLookupError:
      shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
    except (ValueError, PermissionError):
      pass


def pack(data_cfg, vocab_size: int, out_dir: str) -> str:
  """Packs the sources into out_dir, or reuses a finished pack of the same config.

  Idempotent: a finished directory with the same config and source hash is a no-op;
  one with a different config is refused, naming the differing fields.
  """
  out_dir = paths.resolve(out_dir)
  paths.check_access(out_dir)
  config = pack_config(data_cfg, vocab_size)
  if data_cfg.val_sources:
    sources_lib.check_disjoint(data_cfg.sources, data_cfg.val_sources)
  src_hash = sources_lib.source_hash(data_cfg.sources, data_cfg.text_field,
                                     data_cfg.val_sources)
  if check_existing(out_dir, config, src_hash):
    logging.info("packing: reusing %s", out_dir)
    return out_dir
  if paths.is_remote(out_dir):
    return _pack_remote(data_cfg, vocab_size, out_dir, config, src_hash)
  os.makedirs(os.path.dirname(out_dir), exist_ok=True)
  _remove_stale_temps(out_dir)
  tmp = f"{out_dir}.tmp-{socket.gethostname()}-{os.getpid()}-{time.time_ns()}"
  os.makedirs(tmp)
  try:
    _write_pack(tmp, data_cfg, vocab_size, config, src_hash)
    try:
      os.rename(tmp, out_dir)
    except OSError:
      # Another process finished the same pack first: keep theirs if it matches.
      if not check_existing(out_dir, config, src_hash):
        raise
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return out_dir


def _pack_remote(data_cfg, vocab_size: int, out_dir: str, config: dict, src_hash: str
                 ) -> str:
  """Packs into a local temp dir, then uploads it, metadata.json last: its presence is
  what marks a finished pack, so a killed upload is never taken for one."""
  with tempfile.TemporaryDirectory(prefix="prism_pack-") as tmp:
    _write_pack(tmp, data_cfg, vocab_size, config, src_hash)
    dst = paths.path(out_dir)
    dst.mkdir(parents=True, exist_ok=True)
    names = sorted(os.listdir(tmp), key=lambda n: n == METADATA)
    for name in names:
      with open(os.path.join(tmp, name), "rb") as f:
        (dst / name).write_bytes(f.read())
  logging.info("packing: uploaded to %s", out_dir)
  return out_dir
