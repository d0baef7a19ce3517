"""Multiple-choice tasks built from a run's own held-out documents, at a scale where tiny
models beat chance (so controllers can be measured on this machine).

  synthetic_next_span  context: `ctx_tokens` tokens of a val document; options: the true next
                       `span_tokens` tokens and 3 spans of other val documents
  synthetic_cloze      context: the text of a val document up to a word; options: that word
                       and 3 words drawn by frequency from the val split's words
Both are seeded; items are text, scored by the ordinary harness (tasks.Item).
"""

from __future__ import annotations

import re

import numpy as np

from prism_jax.evaluation.tasks import Item

SYNTHETIC_TASKS = ("synthetic_next_span", "synthetic_cloze")
_WORD = re.compile(r"[A-Za-z]{3,}")


def _val_documents(packed) -> list[np.ndarray]:
  docs = [packed.document_tokens(int(i)) for i in packed.document_ids("val")]
  if not docs:
    raise ValueError(f"{packed} has no val documents: synthetic tasks need a held-out split "
                     "(data.val_fraction > 0)")
  return docs


def next_span_items(packed, n: int, *, ctx_tokens: int = 48, span_tokens: int = 8,
                    num_options: int = 4, seed: int = 0) -> list[Item]:
  tok = packed.tokenizer
  docs = _val_documents(packed)
  long_docs = [i for i, d in enumerate(docs) if len(d) >= ctx_tokens + span_tokens]
  if len(long_docs) < 2:
    raise ValueError(f"need >= 2 val documents of >= {ctx_tokens + span_tokens} tokens, "
                     f"have {len(long_docs)}")
  rng = np.random.default_rng(seed)
  items = []
  for doc_id in range(n):
    d = long_docs[rng.integers(len(long_docs))]
    cut = int(rng.integers(ctx_tokens, len(docs[d]) - span_tokens + 1))
    spans = [docs[d][cut:cut + span_tokens]]
    for _ in range(num_options - 1):
      o = long_docs[rng.integers(len(long_docs))]
      while o == d:
        o = long_docs[rng.integers(len(long_docs))]
      at = int(rng.integers(0, len(docs[o]) - span_tokens + 1))
      spans.append(docs[o][at:at + span_tokens])
    perm = rng.permutation(num_options)
    context = tok.decode(docs[d][cut - ctx_tokens:cut])
    conts = tuple(tok.decode(spans[j]) for j in perm)
    items.append(Item("synthetic_next_span", doc_id, (context,) * num_options, conts,
                      int(np.flatnonzero(perm == 0)[0])))
  return items


def cloze_items(packed, n: int, *, ctx_chars: int = 240, num_options: int = 4,
                seed: int = 0) -> list[Item]:
  tok = packed.tokenizer
  texts = [tok.decode(d) for d in _val_documents(packed)]
  spots = [(t, m) for t in range(len(texts)) for m in _WORD.finditer(texts[t])
           if m.start() >= 40 and texts[t][m.start() - 1] == " "]
  words = [m.group() for _, m in spots]
  if len(set(words)) < num_options:
    raise ValueError(f"the val split has {len(set(words))} distinct words; cloze needs "
                     f">= {num_options}")
  rng = np.random.default_rng(seed)
  items = []
  for doc_id in range(n):
    t, m = spots[rng.integers(len(spots))]
    options = [m.group()]
    while len(options) < num_options:  # frequency-matched distractors: draw occurrences
      w = words[rng.integers(len(words))]
      if w.lower() not in {o.lower() for o in options}:
        options.append(w)
    perm = rng.permutation(num_options)
    context = texts[t][max(0, m.start() - 1 - ctx_chars):m.start() - 1]
    items.append(Item("synthetic_cloze", doc_id, (context,) * num_options,
                      tuple(" " + options[j] for j in perm), int(np.flatnonzero(perm == 0)[0])))
  return items


def synthetic_items(name: str, packed, n: int, seed: int = 0) -> list[Item]:
  if name == "synthetic_next_span":
    return next_span_items(packed, n, seed=seed)
  if name == "synthetic_cloze":
    return cloze_items(packed, n, seed=seed)
  raise ValueError(f"unknown synthetic task {name!r}: use one of {SYNTHETIC_TASKS}")
