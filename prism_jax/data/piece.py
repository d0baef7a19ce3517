"""Packs one piece of the plan: read its documents once, tokenize, split, write rows.

Runs in the packing process or in a worker process (`pack_piece_in_worker`). The piece's
tokens are held until its train/val draw (which needs its document count), so a worker's
memory is bounded by the piece size (plan.py), not by the corpus. The piece's arrays and
index are written first and `done.json` last: a killed piece is redone whole on resume,
a finished one is never redone.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np

from prism_jax import children
from prism_jax import paths
from prism_jax.data import pack_format as fmt
from prism_jax.data import plan as plan_lib
from prism_jax.data import tokenizers as tok_lib

ENCODE_DOCS = 512  # documents per encode_batch call


def _encode(tok, texts: list[str], dtype) -> list[np.ndarray]:
  eos = np.array([tok.eos_id], dtype)
  if tok.kind == "byte":  # ids are the UTF-8 bytes
    return [np.concatenate([np.frombuffer(t.encode("utf-8"), np.uint8).astype(dtype), eos])
            for t in texts]
  return [np.concatenate([np.asarray(ids, dtype), eos]) for ids in tok.encode_batch(texts)]


def pack_piece(out_dir: str, piece: dict[str, Any], k: int, settings: dict[str, Any], tok
               ) -> dict[str, Any]:
  """Writes piece k under out_dir/pieces/<k>; returns (and writes as done.json) its counts."""
  dtype = fmt.token_dtype(settings["vocab_size"])
  tokens_D, unit_docs = [], [0] * len(piece["units"])
  batch, names = [], []

  def flush():
    tokens_D.extend(_encode(tok, batch, dtype))
    batch.clear()

  for u, name, text in plan_lib.iter_piece(piece, settings):
    batch.append(text)
    names.append(name)
    unit_docs[u] += 1
    if len(batch) == ENCODE_DOCS:
      flush()
  if batch:
    flush()
  is_val = plan_lib.is_val(k, len(tokens_D), settings["val_fraction"], settings["split_seed"],
                           piece["val_files"])
  length_D = np.array([len(t) for t in tokens_D], np.int64)
  directory = fmt.piece_dir(out_dir, k)
  rows, docs, tokens = [], [], []
  for s in range(len(fmt.SPLITS)):
    ids = np.flatnonzero(is_val == bool(s))
    stream = np.concatenate([np.array([tok.eos_id], dtype)] + [tokens_D[i] for i in ids])
    if s == 0:  # the train stream holds most tokens: free them before the val stream
      tokens_D = [t if is_val[i] else None for i, t in enumerate(tokens_D)]
    rows.append(fmt.write_rows(directory, fmt.SPLITS[s], stream, settings["seq_len"],
                               tok.pad_id))
    docs.append(len(ids))
    tokens.append(int(length_D[ids].sum()))
    del stream
  fmt.write_index(directory, is_val.astype(np.uint8), length_D, names, unit_docs)
  summary = {"piece": k, "documents": len(length_D), "rows": rows, "split_documents": docs,
             "split_tokens": tokens, "unit_docs": unit_docs}
  fmt.write_json(paths.join(directory, fmt.DONE), summary)
  return summary


@functools.lru_cache(maxsize=2)
def _tokenizer(out_dir: str):
  return tok_lib.load_tokenizer(out_dir)


def worker_init(parent_pid: int | None = None) -> None:
  """A worker process tokenizes on one core: the pool, not the tokenizer, is parallel; it
  ends when the packing process dies, however it dies (prism_jax/children.py)."""
  if parent_pid is not None:
    children.die_with_parent(parent_pid)
  os.environ["TOKENIZERS_PARALLELISM"] = "false"
  os.environ["RAYON_NUM_THREADS"] = "1"


def pack_piece_in_worker(out_dir: str, piece: dict[str, Any], k: int,
                         settings: dict[str, Any]) -> dict[str, Any]:
  return pack_piece(out_dir, piece, k, settings, _tokenizer(out_dir))
