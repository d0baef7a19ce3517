"""Prototype cards: what each prototype of a PrismLM *is* (PRISM.md §1, §5).

    cards = build_cards(model, cfg, packed, cache=cache)      # or cache=None: records pass
    cards.card(17).contexts[0].text; cards.search(["for"]); cards.save("runs/x/cards")

Per prototype i a `Card` holds: its top-m training contexts by activation a_{t,i} (± window
tokens, the trigger token marked), its logit signature (top promoted / demoted tokens of
W p_i), its usage (fraction of training tokens where a_{t,i} > 0) and an activation
histogram, its nearest prototypes by cosine, an automatic label (TF-IDF of its contexts'
trigger tokens and trigger bigrams against all prototypes' contexts: a heuristic, no LLM; the
label says so) and its (x, y) on a 2-D map of the bank (PCA of the unit prototypes; UMAP
when `umap-learn` is importable and map_method="umap" or "auto").

Token t of the training split is the hidden state z_t at input token x_t (the *trigger*),
predicting the target x_{t+1}: the cache's (example_id, offset) is the target's place, so
the trigger is document token offset - 1 and `tokens_after` starts with the target.

Sources. With `cache` (an AttributionCache) the contexts come from its prototype -> token
index (already sorted by decreasing activation, ties by token index). Without, a
records-only pass (`cache_build.write_records`, resumable, with progress) writes idx/act of
every training token into `<out_dir>/records` (a temporary directory if out_dir is None),
and `cache_build.index_pass` inverts it the same way.

On-disk format (`CardSet.save(dir)`; the directory is claimed with io_guard, kind
"prototype cards"): `cards.json`, UTF-8 JSON
  {"format": 1, "identity": {"model_fingerprint": sha256, "num_prototypes": K, "k",
   "vocab_size", "top_m", "window", "source": "cache" | "records", "num_tokens"},
   "label_method": str, "map_method": "pca" | "umap",
   "cards": [{"proto_id", "usage", "label", "label_terms": [str],
              "map_xy": [x, y], "promoted": [[text, value]], "demoted": [[text, value]],
              "histogram": {"edges": [B + 1 floats], "counts": [B ints]},
              "neighbours": {"ids": [int], "cosines": [float]},
              "contexts": [{"example_id", "row", "position", "activation",
                            "tokens_before", "trigger", "tokens_after", "text"}]}]}
with cards[i].proto_id == i. `CardSet.to_neuronpedia(i)` gives the Neuronpedia feature
dict (activations, pos/neg logits, frequency and logit histograms, explanation).
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import numpy as np
from absl import logging

from prism_jax import io_guard, paths
from prism_jax.analysis.card_stats import bank_map, neighbours, signatures, tfidf_labels
from prism_jax.attribution.caching import cache_build
from prism_jax.attribution.caching import cache_format as fmt
from prism_jax.config import Config

CARDS_KIND = "prototype cards"  # io_guard marker kind
CARDS_FILE = "cards.json"
FORMAT_VERSION = 1
LABEL_METHOD = ("heuristic: TF-IDF of trigger tokens and trigger bigrams of the top "
                "contexts against all prototypes' contexts (no LLM)")
HIST_BINS = 20


class CardsMismatchError(ValueError):
  """A card set built for another model (fingerprint differs)."""


class Context(NamedTuple):
  example_id: int  # document id
  row: int  # packed training row
  position: int  # column of the trigger (input) token in that row
  activation: float  # a_{t,i}
  tokens_before: str  # the `window` tokens before the trigger
  trigger: str  # the input token whose hidden state activates the prototype
  tokens_after: str  # the target token and the ones after it (`window` in all)
  text: str  # tokens_before + trigger + tokens_after


@dataclasses.dataclass(frozen=True)
class Card:
  proto_id: int
  contexts: tuple[Context, ...]  # best first
  promoted: tuple[tuple[str, float], ...]  # top entries of W p_i
  demoted: tuple[tuple[str, float], ...]  # bottom entries of W p_i (most negative first)
  usage: float  # fraction of training tokens where a_{t,i} > 0
  histogram: dict  # {"edges": (B + 1,), "counts": (B,)} of its nonzero activations
  neighbours: dict  # {"ids": (n,), "cosines": (n,)} by decreasing cosine
  label: str  # "heuristic: ..." (see LABEL_METHOD)
  map_xy: tuple[float, float]
  label_terms: tuple[str, ...] = ()


def _card_to_json(c: Card) -> dict:
  # The fields as they are (json writes tuples as lists): dataclasses.asdict's deep copy
  # took 4 of the 6 s that saving the demo's 16384 cards took.
  d = {f.name: getattr(c, f.name) for f in dataclasses.fields(c)}
  d["contexts"] = [ctx._asdict() for ctx in c.contexts]
  return d


def _card_from_json(d: dict) -> Card:
  return Card(proto_id=int(d["proto_id"]),
              contexts=tuple(Context(**ctx) for ctx in d["contexts"]),
              promoted=tuple((str(t), float(v)) for t, v in d["promoted"]),
              demoted=tuple((str(t), float(v)) for t, v in d["demoted"]),
              usage=float(d["usage"]), histogram=d["histogram"], neighbours=d["neighbours"],
              label=str(d["label"]), map_xy=tuple(d["map_xy"]),
              label_terms=tuple(d.get("label_terms", ())))


class CardSet:
  """Every prototype's card (`cards[i].proto_id == i`) plus the identity it was built for."""

  def __init__(self, cards: Sequence[Card], identity: dict, map_method: str = "pca"):
    self.cards = tuple(cards)
    self.identity = dict(identity)
    self.map_method = map_method
    if any(c.proto_id != i for i, c in enumerate(self.cards)):
      raise ValueError("cards must be indexed by prototype id (cards[i].proto_id == i)")

  def __len__(self) -> int:
    return len(self.cards)

  def card(self, i) -> Card:
    """The card of prototype i; a clear error for an id outside [0, K)."""
    if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
      raise TypeError(f"prototype id must be an int, got {i!r}")
    if not 0 <= int(i) < len(self.cards):
      raise IndexError(f"prototype id {int(i)} is out of range: this model has "
                       f"K={len(self.cards)} prototypes (ids 0..{len(self.cards) - 1})")
    return self.cards[int(i)]

  def save(self, directory: str) -> str:
    """Writes cards.json (format in the module docstring) into a claimed directory."""
    directory = io_guard.claim_output_dir(directory, CARDS_KIND)
    obj = {"format": FORMAT_VERSION, "identity": self.identity, "label_method": LABEL_METHOD,
           "map_method": self.map_method, "cards": [_card_to_json(c) for c in self.cards]}
    path = paths.join(directory, CARDS_FILE)
    paths.write_text_atomic(path, json.dumps(obj, ensure_ascii=False))  # local or gs://
    return path

  @classmethod
  def load(cls, directory: str, model=None) -> "CardSet":
    """Reads a saved set; with `model`, refuses one built for another checkpoint."""
    path = paths.join(directory, CARDS_FILE)
    if io_guard.read_kind(directory) != CARDS_KIND or not paths.path(path).is_file():
      raise FileNotFoundError(f"{paths.resolve(directory)} is not a prototype-card "
                              f"directory (no {io_guard.MARKER} of kind {CARDS_KIND!r} "
                              f"and {CARDS_FILE})")
    obj = json.loads(paths.path(path).read_text(encoding="utf-8"))
    if obj.get("format") != FORMAT_VERSION:
      raise ValueError(f"{path} has card format {obj.get('format')!r}, this code reads "
                       f"{FORMAT_VERSION}; rebuild the cards")
    ident = obj["identity"]
    if model is not None:
      have = fmt.model_fingerprint(model)
      if have != ident["model_fingerprint"]:
        raise CardsMismatchError(
            f"the cards in {directory} were built for another model (fingerprint "
            f"{ident['model_fingerprint'][:12]}…, this model {have[:12]}…); rebuild them")
    return cls([_card_from_json(d) for d in obj["cards"]], ident, obj.get("map_method", "pca"))

  def search(self, keywords: str | Iterable[str], where: str = "text"
             ) -> list[tuple[int, int]]:
    """(proto_id, hits) of cards whose contexts contain any keyword (case-insensitive),
    hits = number of matching contexts, most first (ties: lower id). `where`: "text"
    (the whole window) or "trigger" (the trigger token only)."""
    if where not in ("text", "trigger"):
      raise ValueError(f"where={where!r}; use 'text' or 'trigger'")
    words = [keywords] if isinstance(keywords, str) else list(keywords)
    words = [w.strip().lower() for w in words if w.strip()]
    if not words:
      raise ValueError("search needs at least one non-blank keyword")
    out = []
    for c in self.cards:
      hits = sum(any(w in getattr(ctx, where).lower() for w in words) for ctx in c.contexts)
      if hits:
        out.append((c.proto_id, hits))
    return sorted(out, key=lambda ph: (-ph[1], ph[0]))

  def to_neuronpedia(self, i, model_id: str = "prism_jax", layer: str = "prototypes"
                     ) -> dict:
    """Prototype i as a Neuronpedia feature JSON (the shape SAE dashboards read). Per
    context only the trigger's activation is known; the other tokens read 0."""
    c = self.card(i)
    acts = []
    for ctx in c.contexts:
      toks = [ctx.tokens_before, ctx.trigger, ctx.tokens_after]
      acts.append({"tokens": toks, "values": [0.0, ctx.activation, 0.0],
                   "maxValue": ctx.activation, "maxValueTokenIndex": 1,
                   "example_id": ctx.example_id})
    edges = np.asarray(c.histogram["edges"], np.float64)
    logit_vals = [v for _, v in c.promoted] + [v for _, v in c.demoted]
    l_counts, l_edges = np.histogram(logit_vals, bins=min(HIST_BINS, max(1, len(logit_vals))))
    return {"modelId": model_id, "layer": layer, "index": str(c.proto_id),
            "activations": acts,
            "pos_str": [t for t, _ in c.promoted], "pos_values": [v for _, v in c.promoted],
            "neg_str": [t for t, _ in c.demoted], "neg_values": [v for _, v in c.demoted],
            "frac_nonzero": c.usage,
            "freq_hist_data_bar_heights": [int(n) for n in c.histogram["counts"]],
            "freq_hist_data_bar_values": ((edges[:-1] + edges[1:]) / 2).tolist(),
            "logits_hist_data_bar_heights": l_counts.tolist(),
            "logits_hist_data_bar_values": ((l_edges[:-1] + l_edges[1:]) / 2).tolist(),
            "explanations": [{"description": c.label, "typeName": "heuristic-tfidf"}],
            "neighbors": [{"index": str(j), "cosine": s} for j, s in
                          zip(c.neighbours["ids"], c.neighbours["cosines"])]}


class _Index:
  """The prototype -> token index and per-token example_id/offset/row, from a full cache
  or from a records-only directory (inverted here with cache_build.index_pass)."""

  def __init__(self, cache=None, records_dir: str | None = None):
    if cache is not None:
      self.offsets = np.asarray(cache.proto_offsets, np.int64)
      self._entries, self._gather = cache.proto_entries, cache.gather
      self.row_offsets = np.asarray(cache.row_offsets, np.int64)
      self.num_tokens = cache.num_tokens
      return
    drv = fmt.read_json(paths.join(records_dir, fmt.METADATA))["identity"]["cache"]["driver"]
    rd = lambda n: fmt.store(records_dir, n, drv).read().result()
    self.offsets = np.asarray(rd("proto_offsets"), np.int64)
    proto_tokens, proto_acts = rd("proto_tokens"), rd("proto_acts")
    ids = {"example_id": rd("example_id"), "offset": rd("offset")}
    self.row_offsets = np.asarray(rd("row_offsets"), np.int64)
    self.num_tokens = int(self.row_offsets[-1])

    def entries(i, m=None):
      lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
      hi = hi if m is None else min(hi, lo + int(m))
      return (np.asarray(proto_tokens[lo:hi], np.int64), np.asarray(proto_acts[lo:hi]))

    self._entries = entries
    self._gather = lambda name, tok: ids[name][np.asarray(tok, np.int64)]

  def entries(self, i: int, m: int | None = None):
    return self._entries(i, m)

  def gather(self, name: str, tok: np.ndarray) -> np.ndarray:
    return self._gather(name, tok)

  def rows(self, tok: np.ndarray) -> np.ndarray:
    return np.searchsorted(self.row_offsets, np.asarray(tok, np.int64), side="right") - 1


def _records_index(model, cfg: Config, packed, records_dir: str, progress: bool,
                   records_cfg: fmt.CacheConfig | None = None) -> _Index:
  """Resumable records-only pass (idx/act/ids of every training token) + its inversion."""
  cache_build.write_records(model, cfg, packed, records_dir,
                            records_cfg or fmt.CacheConfig(rank=None), progress=progress)
  if not paths.path(paths.join(records_dir, "proto_offsets")).exists():
    cache_build.index_pass(records_dir, fmt.CacheConfig().driver, cfg.model.num_prototypes)
  return _Index(records_dir=records_dir)


class _Docs:
  """Document tokens (with EOS) read once per document, decoded with `decode`."""

  def __init__(self, packed, decode: Callable):
    self.packed, self.decode, self._tokens = packed, decode, {}

  def tokens(self, example_id: int) -> np.ndarray:
    if example_id not in self._tokens:
      self._tokens[example_id] = self.packed.document_tokens(example_id, with_eos=True)
    return self._tokens[example_id]

  def context(self, example_id: int, offset: int, window: int):
    """(before, trigger, after) text and the trigger's token id."""
    toks = self.tokens(example_id)
    trig = offset - 1  # the input token of the target at `offset`
    dec = self.decode
    return (dec(toks[max(0, trig - window):trig]), dec(toks[trig:trig + 1]),
            dec(toks[trig + 1:trig + 1 + window]), int(toks[trig]))


def _positions(rows: dict, row_M: np.ndarray, eid_M: np.ndarray, off_M: np.ndarray,
               block: int = 4096) -> np.ndarray:
  """Column of each trigger in its packed row (targets are columns 1..T of the row; -1 where
  absent). Each distinct row is read once, `block` rows at a time: one read per context
  was most of the cards' time at K 8192."""
  out = np.full(len(row_M), -1, np.int64)
  uniq, inv = np.unique(np.asarray(row_M, np.int64), return_inverse=True)
  for lo in range(0, len(uniq), block):
    sel = np.flatnonzero((inv >= lo) & (inv < lo + block))
    local = inv[sel] - lo
    hit_MxT = ((rows["example_id"][uniq[lo:lo + block], 1:][local] == eid_M[sel, None])
               & (rows["offset"][uniq[lo:lo + block], 1:][local] == off_M[sel, None]))
    out[sel] = np.where(hit_MxT.any(1), hit_MxT.argmax(1), -1)
  return out


def _with_positions(rows: dict, contexts: list[tuple], offsets: list[int]) -> list[tuple]:
  """`contexts` with each trigger's position (`offsets`: their targets' document offsets,
  flat in the same order)."""
  flat = [c for ctxs in contexts for c in ctxs]
  pos = _positions(rows, np.array([c.row for c in flat], np.int64),
                   np.array([c.example_id for c in flat], np.int64),
                   np.array(offsets, np.int64)) if flat else []
  it = iter(pos)
  return [tuple(c._replace(position=int(next(it))) for c in ctxs) for ctxs in contexts]


def _identity(fingerprint: str, cfg: Config, top_m: int, window: int, source: str,
              num_tokens: int):
  return {"model_fingerprint": fingerprint,
          "num_prototypes": cfg.model.num_prototypes, "k": cfg.model.k,
          "vocab_size": cfg.model.vocab_size, "top_m": top_m, "window": window,
          "source": source, "num_tokens": int(num_tokens)}


def _card_contexts(index, packed, split: str, docs: _Docs, num_protos: int, top_m: int,
                   window: int, progress: bool, t0: float):
  """Per prototype: its top_m contexts (with their row positions), trigger ids, the
  bigrams before them, its usage and its activation histogram."""
  contexts, offsets, trig_ids, bigrams, usage, hists = [], [], [], [], [], []
  for i in range(num_protos):
    tok_all, act_all = index.entries(i)
    usage.append(len(tok_all) / max(index.num_tokens, 1))
    top = max(float(act_all.max()), 1e-12) if len(act_all) else 1.0
    counts, edges = np.histogram(act_all, bins=HIST_BINS, range=(0.0, top))
    hists.append({"edges": edges.tolist(), "counts": counts.tolist()})
    tok, act = tok_all[:top_m], act_all[:top_m]
    ex, off, row = index.gather("example_id", tok), index.gather("offset", tok), index.rows(tok)
    ctxs, trig, bg = [], [], []
    for t, a, e, o, r in zip(tok, act, ex, off, row):
      before, trigger, after, trig_id = docs.context(int(e), int(o), window)
      ctxs.append(Context(int(e), int(r), -1, float(a), before, trigger, after,
                          before + trigger + after))  # its position: after the loop
      offsets.append(int(o))
      trig.append(trig_id)
      prev = docs.tokens(int(e))[max(0, int(o) - 2):int(o)]
      if len(prev) == 2:
        bg.append((int(prev[0]), int(prev[1])))
    contexts.append(tuple(ctxs))
    trig_ids.append(trig)
    bigrams.append(bg)
    if progress and (i + 1) % max(1, num_protos // 10) == 0:
      logging.info("cards: %d/%d prototypes (%.1fs)", i + 1, num_protos, time.time() - t0)
  rows = packed.rows(split)  # the rows the index's tokens come from
  return _with_positions(rows, contexts, offsets), trig_ids, bigrams, usage, hists


def build_cards(model, cfg: Config, packed, *, cache=None, top_m: int = 16, window: int = 8,
                decode: Callable | None = None, out_dir: str | None = None,
                progress: bool = True, n_logits: int = 10, n_neighbours: int = 8,
                records_cfg: fmt.CacheConfig | None = None,
                map_method: str = "auto") -> CardSet:
  """Every prototype's card (module docstring). `cache`: an AttributionCache of this model
  (its index is used); otherwise a records-only pass over the training split, resumable in
  `<out_dir>/records` (its options: `records_cfg`, default CacheConfig(rank=None); resume
  granularity is its chunk_tokens). With out_dir the set is also saved there."""
  if cfg.model.kind != "prism" or not hasattr(model, "bank"):
    raise ValueError("prototype cards need a PRISM run (model.kind='prism'); this one is "
                     f"{cfg.model.kind!r} and has no prototypes")
  for name, v in (("top_m", top_m), ("window", window), ("n_logits", n_logits),
                  ("n_neighbours", n_neighbours)):
    if not isinstance(v, (int, np.integer)) or v <= 0:
      raise ValueError(f"{name} must be a positive int, got {v!r}")
  decode = decode or packed.tokenizer.decode
  t0 = time.time()
  if out_dir is not None:
    out_dir = io_guard.claim_output_dir(out_dir, CARDS_KIND)
  fingerprint = fmt.model_fingerprint(model)
  if cache is not None:
    have = cache.metadata["identity"]["model_fingerprint"]
    if have != fingerprint:
      raise CardsMismatchError(f"the attribution cache {cache.path} was built from another "
                               f"checkpoint (fingerprint {have[:12]}…); pass this model's "
                               "cache, or cache=None for a records-only pass")
    index, source = _Index(cache=cache), "cache"
    split = cache.metadata["identity"]["cache"]["split"]
  else:
    tmp = None if out_dir is not None else tempfile.TemporaryDirectory(prefix="cards_")
    rec_dir = paths.join(out_dir if tmp is None else tmp.name, "records")
    index, source = _records_index(model, cfg, packed, rec_dir, progress, records_cfg), "records"
    split = fmt.CacheConfig().split
  num_protos = cfg.model.num_prototypes
  contexts, trig_ids, bigrams, usage, hists = _card_contexts(
      index, packed, split, _Docs(packed, decode), num_protos, top_m, window, progress, t0)
  protos_KxD = np.asarray(model.bank.protos[...], np.float64)
  sigs = signatures(np.asarray(model.proto_logit_signatures(), np.float64), decode, n_logits)
  nb_ids, nb_cos = neighbours(protos_KxD, n_neighbours)
  xy, used = bank_map(protos_KxD, map_method)
  terms = tfidf_labels(trig_ids, bigrams, decode)
  cards = [Card(proto_id=i, contexts=contexts[i], promoted=sigs[i][0], demoted=sigs[i][1],
                usage=float(usage[i]), histogram=hists[i],
                neighbours={"ids": nb_ids[i].tolist(), "cosines": nb_cos[i].tolist()},
                label=("heuristic: " + " · ".join(terms[i])) if terms[i]
                else "heuristic: (never active on the training split)",
                map_xy=(float(xy[i, 0]), float(xy[i, 1])), label_terms=terms[i])
           for i in range(num_protos)]
  ident = _identity(fingerprint, cfg, top_m, window, source, index.num_tokens)
  card_set = CardSet(cards, ident, used)
  if out_dir is not None:
    card_set.save(out_dir)
  if progress:
    logging.info("cards: %d prototypes from the %s in %.1fs", num_protos, source,
                 time.time() - t0)
  return card_set
