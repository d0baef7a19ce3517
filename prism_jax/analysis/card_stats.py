"""The bank-level statistics of the prototype cards (cards.py): logit signatures, nearest
prototypes, the 2-D map and the TF-IDF labels. Pure NumPy on the bank's arrays."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from prism_jax.data.tokenizers import piece_fn


def signatures(sig_KxV: np.ndarray, decode: Callable, n: int):
  """(promoted, demoted) per prototype: the n largest / smallest entries of W p_i (each
  token shown as its tokenizer's piece: a partial UTF-8 byte as <0xNN>, not U+FFFD)."""
  one = piece_fn(decode)
  part_hi = np.argpartition(-sig_KxV, n - 1, axis=1)[:, :n]
  part_lo = np.argpartition(sig_KxV, n - 1, axis=1)[:, :n]
  out = []
  for i in range(len(sig_KxV)):
    hi = part_hi[i][np.argsort(-sig_KxV[i, part_hi[i]])]
    lo = part_lo[i][np.argsort(sig_KxV[i, part_lo[i]])]
    out.append((tuple((one(t), float(sig_KxV[i, t])) for t in hi),
                tuple((one(t), float(sig_KxV[i, t])) for t in lo)))
  return out


def neighbours(protos_KxD: np.ndarray, n: int, chunk: int = 1024):
  """(ids_Kxn, cosines_Kxn): each prototype's n nearest others by cosine, in row chunks
  (never a K×K matrix at once)."""
  unit = protos_KxD / np.maximum(np.linalg.norm(protos_KxD, axis=1, keepdims=True), 1e-12)
  num = len(unit)
  n = min(n, num - 1)
  ids, cos = np.zeros((num, n), np.int64), np.zeros((num, n), np.float64)
  for lo in range(0, num, chunk):
    sim = unit[lo:lo + chunk] @ unit.T
    sim[np.arange(len(sim)), np.arange(lo, lo + len(sim))] = -np.inf  # not itself
    top = _top_n_stable(sim, n)
    ids[lo:lo + len(sim)] = top
    cos[lo:lo + len(sim)] = np.take_along_axis(sim, top, axis=1)
  return ids, cos


def _top_n_stable(sim_MxK: np.ndarray, n: int) -> np.ndarray:
  """np.argsort(-sim, kind="stable")[:, :n] (ties: the lower id first) without sorting
  whole rows: a partition finds each row's n largest, which alone are sorted; rows with a
  tie across the n-th place take the full stable sort (a full sort of K 16384 rows was
  most of the cards' time)."""
  num = sim_MxK.shape[1]
  if n >= num:
    return np.argsort(-sim_MxK, axis=1, kind="stable")[:, :n]
  part = np.argpartition(-sim_MxK, n - 1, axis=1)[:, :n]
  vals = np.take_along_axis(sim_MxK, part, axis=1)
  top = np.take_along_axis(part, np.lexsort((part, -vals), axis=1), axis=1)
  tied = np.flatnonzero(np.sum(sim_MxK >= vals.min(1, keepdims=True), axis=1) > n)
  if tied.size:
    top[tied] = np.argsort(-sim_MxK[tied], axis=1, kind="stable")[:, :n]
  return top


def bank_map(protos_KxD: np.ndarray, method: str = "auto") -> tuple[np.ndarray, str]:
  """(xy_Kx2, method used): PCA of the unit prototypes, or UMAP (cosine) when asked for
  ("umap") or available ("auto") via the optional `umap-learn`."""
  if method not in ("auto", "pca", "umap"):
    raise ValueError(f"map_method={method!r}; use 'auto', 'pca' or 'umap'")
  unit = protos_KxD / np.maximum(np.linalg.norm(protos_KxD, axis=1, keepdims=True), 1e-12)
  if method in ("auto", "umap"):
    try:
      import umap  # pylint: disable=import-outside-toplevel  (deferred: umap-learn, optional)
      return np.asarray(umap.UMAP(n_components=2, metric="cosine", random_state=0)
                        .fit_transform(unit), np.float64), "umap"
    except ImportError:
      if method == "umap":
        raise ImportError("map_method='umap' needs the optional extra: pip install "
                          "-e '.[umap]'") from None
  centred = unit - unit.mean(0)
  _, _, vt = np.linalg.svd(centred, full_matrices=False)
  xy = centred @ vt[:2].T
  xy = xy * np.sign(xy[np.argmax(np.abs(xy), axis=0), [0, 1]])  # deterministic sign
  return np.pad(xy, ((0, 0), (0, 2 - xy.shape[1]))), "pca"


def tfidf_labels(trigger_ids: Sequence[Sequence[int]], bigrams: Sequence[Sequence[tuple]],
                 decode: Callable, n_terms: int = 3) -> list[tuple[str, ...]]:
  """Distinctive terms per prototype: tf (share of its contexts) × idf over prototypes."""
  docs = [Counter(list(map(lambda t: (t,), trig)) + list(bg))
          for trig, bg in zip(trigger_ids, bigrams)]
  df = Counter(term for d in docs for term in d)
  num = max(len(docs), 1)
  out = []
  for d in docs:
    total = max(sum(d.values()), 1)
    scored = sorted(d, key=lambda t: (-(d[t] / total) * math.log((1 + num) / (1 + df[t])),
                                      t))
    out.append(tuple(repr(decode(list(t))) for t in scored[:n_terms]))
  return out
