"""What the explorer serves: one run, its cards, its attribution cache, as JSON-ready dicts.

`Explorer` turns checked requests (prism_jax/serve/requests.py) into answers. Model work runs
on the Engine's one thread (`run_on_model`); the attribution cache, when missing, is built on
first use in a thread of its own with its progress in `status()` (or refused when building is
off). Nothing here takes a path from a request: the run directory, its cards
(<workdir>/cards) and its cache (<workdir>/attribution_cache) are fixed at start.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading

import numpy as np

from prism_jax import paths
from prism_jax.control.suppression import model_fingerprint
from prism_jax.data.tokenizers import piece
from prism_jax.generate import SAMPLING, sampling_label
from prism_jax.model.trust import RESIDUAL_DECIDED, prediction_trust, trust_label
from prism_jax.runs import _packed, open_or_build_cache, run_cards
from prism_jax.serve import requests as rq
from prism_jax.serve.engine import Engine

VAL_USAGE_ROWS = 64  # validation rows the usage column is measured on at start


@dataclasses.dataclass
class Generation:
  """One streamed generation: `start` (the prompt line), then `step` until `finished`."""

  explorer: "Explorer"
  ids: list[int]
  prompt_len: int
  max_new: int
  knobs: dict
  gains: dict[int, float]
  steps: int = 0
  stopped: bool = False

  @property
  def finished(self) -> bool:
    return self.stopped or self.steps >= self.max_new

  def start(self) -> dict:
    dec = self.explorer.decode_one
    return {"prompt": [{"id": i, "text": dec(i)} for i in self.ids[:self.prompt_len]],
            "how": sampling_label(0.0 if self.knobs["greedy"] else self.knobs["temperature"],
                                  self.knobs["top_k"], self.knobs["seed"]),
            "gains": {str(i): g for i, g in sorted(self.gains.items())}}

  def step(self) -> dict:
    ex = self.explorer
    s = ex.engine.next_token(self.ids, self.steps, gains_K=ex.engine.gains(self.gains),
                             **self.knobs)
    self.ids.append(s.token)
    self.steps += 1
    self.stopped = s.token == ex.run.tokenizer.eos_id
    return {"i": self.prompt_len + self.steps - 1, "id": s.token, "text": ex.decode_one(s.token),
            "logit": s.logit, "residual": s.residual,
            "slices": ex.slices(s.protos, s.acts, s.contribs, self.gains),
            "prediction": s.prediction, "prediction_text": ex.decode_one(s.prediction),
            "agrees": s.agrees, "share": _finite(s.proto_share),
            "trust": trust_label(s.agrees, s.proto_share)}

  def summary(self) -> dict:
    return {"done": True, "ids": self.ids, "new_tokens": self.steps,
            "compiles": self.explorer.engine.compiles()}


def _finite(x: float):
  return None if not np.isfinite(x) else float(x)


class Explorer:
  """The served run. `build_cache`: build the attribution cache on first use (else refuse)."""

  def __init__(self, run, *, build_cache: bool = True, build_cards: bool = True,
               progress: bool = True):
    if run.config.model.kind != "prism":
      raise ValueError(f"{run.workdir} is a dense run: the explorer needs prototypes")
    self.run, self.engine = run, Engine(run)
    self.mcfg = run.config.model
    self.build_cache_allowed = build_cache
    self.dropped = 0  # streams whose client went away mid-way
    self._cache, self._cache_error, self._cache_progress = None, None, None
    self._cache_lock = threading.Lock()
    self._packed = None
    self.cards = self._cards(build_cards, progress)
    self.val_usage = self._val_usage()
    self.fingerprint = model_fingerprint(run.model)

  # --- start-up ----------------------------------------------------------------------

  def packed(self):
    if self._packed is None:
      self._packed = _packed(self.run)
    return self._packed

  def _cards(self, build: bool, progress: bool):
    # the packed data is read at start-up anyway (the validation usage below)
    return run_cards(self.run, build=build, writer="prism serve", packed=self.packed(),
                     progress=progress)

  def _val_usage(self) -> np.ndarray:
    rows = self.packed().rows("val")["tokens"]
    take = min(VAL_USAGE_ROWS, len(rows))
    if not take:
      return np.zeros(self.mcfg.num_prototypes)
    return self.engine.usage(np.asarray(rows[:take])[:, :-1])

  # --- helpers -------------------------------------------------------------------------

  async def run_on_model(self, fn, *args):
    return await asyncio.wrap_future(self.engine.submit(fn, *args))

  def decode_one(self, i: int) -> str:
    return piece(self.run.tokenizer, i)  # a partial UTF-8 byte as <0xNN>

  def label(self, i: int) -> str:
    return self.cards.card(int(i)).label if self.cards is not None else f"prototype {i}"

  def slices(self, idx, acts, contribs, gains: dict[int, float]) -> list[dict]:
    """The token's prototype slices, largest |contribution| first; a prototype steered to
    gain 0 is gone from the logit and from the slices."""
    out = [{"id": int(i), "act": float(a), "contrib": float(c), "label": self.label(i),
            "gain": gains.get(int(i), 1.0)}
           for i, a, c in zip(idx, acts, contribs) if gains.get(int(i), 1.0) != 0.0]
    return sorted(out, key=lambda s: -abs(s["contrib"]))

  def _ids(self, body: dict, room: int = 0) -> list[int]:
    tok = self.run.tokenizer
    return rq.prompt_ids(body, tok.encode, self.mcfg.vocab_size, self.mcfg.max_len - room)

  # --- the API -------------------------------------------------------------------------

  def status(self) -> dict:
    m = self.mcfg
    return {"run": os.path.basename(self.run.workdir.rstrip("/")), "kind": m.kind,
            "d_model": m.d_model, "layers": m.n_layers, "prototypes": m.num_prototypes,
            "k": m.k, "vocab": m.vocab_size, "context": m.max_len,
            "buckets": list(self.engine.buckets), "compiles": self.engine.compiles(),
            "dropped_streams": self.dropped, "cards": self.cards is not None,
            "cache": self.cache_state(), "sampling": SAMPLING, "limits": rq.LIMITS}

  def generation(self, body: dict) -> Generation:
    rq.only_fields(body, {"prompt", "ids", "max_new_tokens", "temperature", "top_k", "seed",
                          "greedy", "gains", "steering_set"})
    ids = self._ids(body, room=1)
    room = self.mcfg.max_len - len(ids)
    new = rq.integer(body, "max_new_tokens", 32, 1, min(rq.LIMITS["new_tokens"], room))
    knobs = dict(temperature=rq.number(body, "temperature", SAMPLING["temperature"], 0.0,
                                       rq.LIMITS["temperature_max"]),
                 top_k=rq.integer(body, "top_k", SAMPLING["top_k"], 1, self.mcfg.vocab_size),
                 seed=rq.integer(body, "seed", SAMPLING["seed"], 0, rq.LIMITS["seed_max"]),
                 greedy=rq.boolean(body, "greedy", False))
    if knobs["temperature"] == 0.0:
      knobs["greedy"] = True
    gains = rq.gains(body, self.mcfg.num_prototypes, self.fingerprint)
    return Generation(self, ids, len(ids), new, knobs, gains)

  def decompose(self, body: dict) -> dict:
    rq.only_fields(body, {"prompt", "ids", "gains", "steering_set"})
    ids = self._ids(body)
    if len(ids) < 2:
      raise rq.BadRequest("decompose needs at least two tokens (the first has no prediction)")
    gains = rq.gains(body, self.mcfg.num_prototypes, self.fingerprint)
    ex = self.engine.explain(ids, self.engine.gains(gains))
    tokens = []
    for j in range(len(ids) - 1):
      tokens.append({
          "i": j + 1, "id": ids[j + 1], "text": self.decode_one(ids[j + 1]),
          "logit": float(ex["logit"][j]), "logit_unedited": float(ex["logit_unedited"][j]),
          "residual": float(ex["residual"][j]),
          "slices": self.slices(ex["idx"][j], ex["act"][j], ex["contrib"][j], gains),
          "prediction": int(ex["prediction"][j]),
          "prediction_text": self.decode_one(ex["prediction"][j]),
          "agrees": bool(ex["agrees"][j]), "share": _finite(ex["share"][j]),
          "trust": trust_label(bool(ex["agrees"][j]), float(ex["share"][j]))})
    return {"first": {"id": ids[0], "text": self.decode_one(ids[0])}, "tokens": tokens,
            "gains": {str(i): g for i, g in sorted(gains.items())},
            "residual_decided": sum(not t["agrees"] for t in tokens)}

  def prototype(self, pid_text: str) -> dict:
    pid = rq.proto_id(pid_text, self.mcfg.num_prototypes)
    out = {"id": pid, "label": self.label(pid), "usage_val": float(self.val_usage[pid]),
           "val_rows": min(VAL_USAGE_ROWS, int(self.packed().num_rows("val"))),
           "nearest": [{"id": i, "cos": c, "label": self.label(i)}
                       for i, c in self.engine.nearest(pid)]}
    if self.cards is None:
      return {**out, "card": None}
    c = self.cards.card(pid)
    out["card"] = {
        "usage_train": c.usage, "promoted": c.promoted, "demoted": c.demoted,
        "histogram": c.histogram, "terms": list(c.label_terms),
        "contexts": [{"before": x.tokens_before, "trigger": x.trigger, "after": x.tokens_after,
                      "activation": x.activation, "document": x.example_id}
                     for x in c.contexts]}
    return out

  def search(self, query: str) -> dict:
    q = query.strip()
    if not q:
      raise rq.BadRequest("search needs a prototype id, a token or some text")
    if len(q) > rq.LIMITS["search_chars"]:
      raise rq.BadRequest(f"search text over {rq.LIMITS['search_chars']} characters")
    num = self.mcfg.num_prototypes
    if q.lstrip("#").isdigit():
      pid = rq.proto_id(q.lstrip("#"), num)
      return {"query": q, "results": [{"id": pid, "label": self.label(pid), "why": "id"}]}
    if self.cards is None:
      raise rq.BadRequest("no cards for this run: search by id, or restart with cards", 409)
    # a trigger-token hit counts twice a window hit; promoting the text counts as much
    score: dict[int, int] = {}
    why: dict[int, list[str]] = {}
    for where, weight in (("trigger", 2), ("text", 1)):
      for pid, n in self.cards.search(q, where=where):
        score[pid] = score.get(pid, 0) + weight * n
        why.setdefault(pid, []).append(f"{n} {where} hits")
    low = q.lower()
    for c in self.cards.cards:
      if any(low in t.lower() for t, _ in c.promoted):
        score[c.proto_id] = score.get(c.proto_id, 0) + 2 * len(c.contexts)
        why.setdefault(c.proto_id, []).append("promotes it")
    ranked = sorted(score, key=lambda p: (-score[p], p))[:30]
    return {"query": q, "results": [{"id": p, "label": self.label(p),
                                     "why": ", ".join(why[p])} for p in ranked]}

  # --- attribution (the cache, built on first use) ---------------------------------------

  def cache_state(self) -> dict:
    from prism_jax.attribution.caching import cache_format  # pylint: disable=g-import-not-at-top  (deferred: scipy.sparse, as in runs.py)
    if self._cache is not None:
      return {"state": "ready"}
    if self._cache_error:
      return {"state": "failed", "error": self._cache_error}
    if self._cache_progress is not None:
      return {"state": "building", **self._cache_progress}
    present = cache_format.is_cache_dir(paths.join(self.run.workdir, "attribution_cache"))
    return {"state": "on disk" if present else ("absent" if self.build_cache_allowed
                                                 else "absent, building off")}

  def _open_cache(self):
    packed = self.packed()
    total = packed.num_rows("train")

    def on_batch(pass_index, rows_done):
      self._cache_progress = {"pass": int(pass_index), "rows_done": int(rows_done),
                              "rows": int(total)}
    try:
      self._cache_progress = {"pass": 0, "rows_done": 0, "rows": int(total)}
      self._cache = open_or_build_cache(self.run, packed, "prism serve", progress=False,
                                        on_batch=on_batch)
    except Exception as e:  # pylint: disable=broad-except
      self._cache_error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    finally:
      self._cache_progress = None

  def _cache_or_start(self):
    """The open cache, or None after starting (or while running) its build / open."""
    from prism_jax.attribution.caching import cache_format  # pylint: disable=g-import-not-at-top  (deferred: scipy.sparse, as in runs.py)
    with self._cache_lock:
      if self._cache is not None:
        return self._cache
      if self._cache_error:
        raise rq.BadRequest(f"the attribution cache could not be built: {self._cache_error}",
                            409)
      present = cache_format.is_cache_dir(paths.join(self.run.workdir, "attribution_cache"))
      if not present and not self.build_cache_allowed:
        raise rq.BadRequest("no attribution cache for this run and building is off: run "
                            "`prism attribute --build_only` or restart with --build_cache",
                            409)
      if self._cache_progress is None:
        self._cache_progress = {"pass": 0, "rows_done": 0, "rows": 0}
        threading.Thread(target=self._open_cache, daemon=True, name="prism-cache").start()
      return None

  async def attribute(self, body: dict) -> tuple[dict, int]:
    rq.only_fields(body, {"prompt", "ids", "position", "top"})
    ids = self._ids(body)
    if len(ids) < 2:
      raise rq.BadRequest("attribution needs at least two tokens (a token with one before it)")
    pos = rq.integer(body, "position", len(ids) - 1, 1, len(ids) - 1)
    top = rq.integer(body, "top", 5, 1, rq.LIMITS["top_attributions"])
    cache = self._cache_or_start()
    if cache is None:
      return {"building": True, **self.cache_state()}, 202
    return await self.run_on_model(self._attribute, cache, ids, pos, top), 200

  def _attribute(self, cache, ids, pos, top) -> dict:
    from prism_jax.attribution.scoring import influence  # pylint: disable=g-import-not-at-top  (deferred: scipy.sparse, as in runs.py)
    att = influence.attribute(self.run.model, cache, np.asarray(ids[:pos + 1], np.int32), [pos],
                              cfg=influence.InfluenceConfig(top=top), packed=self.packed())
    agrees = bool(prediction_trust(self.run.model, np.asarray(ids, np.int32),
                                   [pos]).agrees_N[0])
    seqs = []
    for e, s, snip, br in zip(att.example_ids, att.scores, att.snippets, att.breakdown):
      name, _, rest = snip.partition(": ")
      before, _, tail = rest.partition("[[")
      span, _, after = tail.partition("]]")
      seqs.append({"document": int(e), "score": float(s), "name": os.path.basename(name),
                   "before": before,
                   "span": span, "after": after,
                   "prototypes": [{"id": p, "share": v} for p, v in list(br.items())[:4]]})
    return {"position": pos, "token": self.decode_one(ids[pos]), "sequences": seqs,
            "query_prototypes": [int(i) for i in att.query_protos], "agrees": agrees,
            "note": "" if agrees else RESIDUAL_DECIDED, "method": influence.METHOD_LABEL}
