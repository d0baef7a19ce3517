"""The suppression table's procedure: which conditions a prototype set is measured beside,
and one row per condition (the procedure of `prism suppress` and
`experiments.suppress_heldout`, which differ only in where the set comes from and how a
rate's CI is drawn).

    sel = selection_from_spec("contrast", model, packed=packed, words=b.select_words, num=24)
    conds = conditions([("suppress (contrast)", sel.ids)], ("token ban", ban_ids), num_k,
                       refill=False, random_sets=3, seed=0)
    rows = [condition_row(name, edit, scores[name], quality[name], scores["unedited"],
                          rate_ci=behaviour_cis.bootstrap_mean,
                          fall_ci=behaviour_cis.bootstrap_ratio_change) for name, edit in conds]
    random_over_suppression(rows)   # the random sets' mean |fall| over the set's fall

The conditions, in order: the unedited model; each named prototype set (the first is the
one suppressed, whose size the random sets take); the token ban of the behaviour's tokens
(the baseline); `random_sets` sets of as many prototypes drawn outside the first set. A
condition is an `edit`: keyword arguments of `control.measure.generations` / `quality`
(`ids` and `refill` for a prototype set, `ban` for the token ban).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from prism_jax.control import selection as selection_lib
from prism_jax.control.suppression import ProtoSet

def selection_from_spec(spec: str, model, *, ban_ids: Sequence[int] = (), packed=None,
                        words: Sequence[str] = (), num: int, contrast_rows: int = 96,
                        seed: int = 0, cards=None, keywords_in: str = "text"
                        ) -> selection_lib.Selection:
  """The prototype set a `--select` spec names, ranked, its top `num`:
  logit_signature (W p_i promotes `ban_ids`, the behaviour's tokens), contrast or probe
  (activations on `packed`'s training rows with vs without `words`), keywords:W1,W2 (a
  CardSet `cards`, matched in a card's `keywords_in`: text, trigger or next; no words:
  `words`), file:PATH (a saved ProtoSet of this model)."""
  kind, _, arg = spec.partition(":")
  if kind == "logit_signature":
    return selection_lib.by_logit_signature(model, ban_ids, num=num)
  if kind in ("contrast", "probe"):
    with_BxK, without_BxK = selection_lib.row_contrast_features(
        model, packed, words, num_rows=contrast_rows, seed=seed)
    fn = selection_lib.by_contrast if kind == "contrast" else selection_lib.by_probe
    return fn(with_BxK, without_BxK, num=num)
  if kind == "keywords":
    if cards is None:
      raise ValueError("--select=keywords: needs the run's cards (--cards_dir=DIR)")
    return selection_lib.by_keywords(cards, [w for w in arg.split(",") if w] or list(words),
                                     where=keywords_in, num=num)
  if kind == "file":
    pset = ProtoSet.load(arg, model)
    return selection_lib.Selection(pset.ids, pset.scores, pset.method, pset.query)
  raise ValueError(f"unknown --select={spec!r}: use logit_signature, contrast, probe, "
                   "keywords:W1,W2 or file:PATH")


def conditions(sets: Sequence[tuple[str, Sequence[int]]], ban: tuple[str, Sequence[int]],
               num_k: int, *, refill: bool, random_sets: int, seed: int
               ) -> list[tuple[str, dict[str, Any]]]:
  """(name, edit) of every row, in the module doc's order; the random sets are drawn by
  `np.random.default_rng(seed)`, without replacement, outside the first set."""
  if not sets or not len(sets[0][1]):
    raise ValueError("conditions: the first prototype set (the suppressed one) is empty")
  first = np.asarray(sets[0][1], np.int64)
  outside = np.setdiff1d(np.arange(num_k), first)
  if random_sets and len(outside) < len(first):
    raise ValueError(f"conditions: {len(first)} random prototypes outside the set do not "
                     f"fit a bank of {num_k}")
  rng = np.random.default_rng(seed)
  out = [("unedited", {})]
  out += [(name, {"ids": tuple(int(i) for i in ids), "refill": refill}) for name, ids in sets]
  out.append((ban[0], {"ban": tuple(int(i) for i in ban[1])}))
  out += [(f"random #{r}", {"ids": tuple(int(i) for i in rng.choice(outside, len(first),
                                                                     False)),
                            "refill": refill}) for r in range(random_sets)]
  return out


def condition_row(name: str, edit: Mapping[str, Any], scores, quality: Mapping[str, float],
                  base_scores, *, rate_ci: Callable, fall_ci: Callable) -> dict[str, Any]:
  """One row: the condition's rate (`rate_ci(scores)`), its fall against the unedited
  model's `base_scores` (`fall_ci(base, scores)`; not for the unedited row, nor when the
  behaviour never occurs unedited), and neutral-text quality (`measure.quality`)."""
  scores, base = np.asarray(scores, np.float64), np.asarray(base_scores, np.float64)
  row = {"condition": name, "prototypes": len(edit.get("ids", ())),
         "banned_tokens": len(edit.get("ban", ())), "rate": rate_ci(scores)._asdict(),
         "ppl": quality["ppl_after"],
         "ppl_change": quality["ppl_after"] / quality["ppl_before"] - 1,
         "kl": quality["kl"], "argmax_change": quality["argmax_change"]}
  if name != "unedited" and base.mean() > 0:
    row["rate_fall"] = fall_ci(base, scores)._asdict()
  return row


def random_over_suppression(rows: Sequence[Mapping[str, Any]]) -> float | None:
  """The random sets' mean |fall| over the suppressed set's |fall| (rows[1], the first
  set); None without random rows or a fall to compare."""
  randoms = [r for r in rows if r["condition"].startswith("random")]
  if not randoms or len(rows) < 2 or "rate_fall" not in rows[1]:
    return None
  return (float(np.mean([abs(r["rate_fall"]["mean"]) for r in randoms]))
          / max(abs(rows[1]["rate_fall"]["mean"]), 1e-12))
