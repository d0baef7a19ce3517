"""An interactive, self-contained HTML report of a prompt and its generation (PRISM.md §1, §5).

    data = report_data(model, cfg, decode, prompt_ids, cards, cache=cache, packed=packed,
                       metrics_path="runs/x/metrics.jsonl")
    path = write_report("runs/x/report", data)          # <dir>/index.html, opens from disk

For every token after the first of prompt + generation, `decompose` (model/lm.py) splits the
logit the model gave it at the position before into the k active prototypes' slices and the
residual slice (they sum to the logit). Generation samples with the library's defaults
(prism_jax.generate.SAMPLING: temperature 0.8, top-k 40, seed 0; temperature=0 is greedy)
through prism_jax.generate, or influence.attribute_generation when a cache is given, which
also yields each generated token's top attributed training sequences. The page (report_page.py) shows the text
coloured by top prototype or prototype-path share, a token's stacked bar, its prototypes'
labels / snippets / signatures from the cards, the prototype map, a searchable card list,
the usage over prototypes and the val metrics over training from metrics.jsonl, and the
sample's own faithfulness metrics (prism_jax/faithfulness.py).

The report directory is claimed with io_guard (kind "report"): a directory that is not a
report's (a run, a cache, any non-empty folder without the marker) is refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from prism_jax import faithfulness, io_guard, paths
from prism_jax import generate as gen
from prism_jax.analysis import report_page
from prism_jax.analysis.cards import LABEL_METHOD, CardSet
from prism_jax.attribution.caching import cache_format as fmt
from prism_jax.attribution.scoring import influence
from prism_jax.config import Config
from prism_jax.data.tokenizers import piece_fn
from prism_jax.generate import SAMPLING, sampling_label
from prism_jax.model.lm import decompose
from prism_jax.model.token_ids import check_token_ids
from prism_jax.model.trust import output_trust

REPORT_KIND = "report"  # io_guard marker kind
REPORT_FILE = "index.html"
# metrics.jsonl val keys plotted over training (those present are drawn).
METRIC_KEYS = ("loss", "r1_bar", "r2_bar", "residual_share", "dead_frac", "proto_ce_ratio",
               "agreement", "centred_proto_share", "decisive_share", "agreement_decisive")
CARD_CONTEXTS, CARD_LOGITS = 5, 8  # what each embedded card keeps (the page stays small)


def _generate(model, prompt, max_new_tokens, cache, packed, eos_id, top, sampling):
  """(new tokens, per new token [(example_id, score, snippet)] or None without a cache)."""
  if cache is None:
    out = gen.generate(model, prompt[None], max_new_tokens=max_new_tokens, eos_id=eos_id,
                       **sampling)
    return out.tokens_BxL[0, :int(out.lengths_B[0])].astype(np.int32), None
  new, atts = [], []
  for tok, att in influence.attribute_generation(
      model, cache, prompt, max_new_tokens=max_new_tokens,
      cfg=influence.InfluenceConfig(top=top), packed=packed, eos_id=eos_id, **sampling):
    new.append(tok)
    atts.append([{"example_id": int(e), "score": float(s), "snippet": snip}
                 for e, s, snip in zip(att.example_ids, att.scores, att.snippets)])
  return np.asarray(new, np.int32), atts


def token_decomposition(model, seq: np.ndarray):
  """(Decomposition of seq[1:] at the positions before, activations a_{t,i} (N, k),
  faithfulness metrics of the sequence, per-position trust): one forward of seq[:-1]."""
  inputs = jnp.asarray(seq[None, :-1])
  out = model(inputs)
  parts = decompose(model, out.protos, jnp.asarray(seq[1:]))
  proto = model.proto_path_logits(out.protos, 1, len(seq) - 1)
  vocab = out.logits_BxTxV.shape[-1]
  state = faithfulness.faithfulness_update(faithfulness.faithfulness_init(),
                                           out.logits_BxTxV.reshape(-1, vocab),
                                           proto.reshape(-1, vocab), jnp.asarray(seq[1:]))
  faith = {k: (v if np.isfinite(v) else None)  # JSON has no nan
           for k, v in faithfulness.faithfulness_finalize(state).items()}
  trust = output_trust(model, out)
  return parts, np.asarray(out.protos.act_Nxk, np.float64), faith, type(trust)(
      *(np.asarray(x) for x in trust))


def read_metrics(path: str | None) -> dict:
  """{"steps": [...], "series": {key: [...]}} of the val records of a metrics.jsonl."""
  steps, series = [], {k: [] for k in METRIC_KEYS}
  if path and paths.path(path).is_file():
    with paths.open_file(path, "r") as f:
      for line in f:
        try:
          rec = json.loads(line)
        except ValueError:
          continue  # a torn last line of a running job
        if rec.get("split") != "val":
          continue
        steps.append(int(rec["step"]))
        for k in METRIC_KEYS:
          v = rec.get(k)
          series[k].append(float(v) if isinstance(v, (int, float)) and np.isfinite(v)
                           else None)
  return {"steps": steps, "series": {k: v for k, v in series.items()
                                     if any(x is not None for x in v)}}


def val_faithfulness_line(metrics: dict) -> str:
  """"; val (step S): agreement A%, on decisive tokens (D% of tokens) B%" from the newest
  val record that has them ("" when none has)."""
  series = metrics["series"]
  for j in range(len(metrics["steps"]) - 1, -1, -1):
    got = [series.get(k, [None] * (j + 1))[j]
           for k in ("agreement", "decisive_share", "agreement_decisive")]
    if None not in got:
      agree, share, agree_dec = got
      return (f"; val (step {metrics['steps'][j]}): agreement {100 * agree:.1f}%, on "
              f"decisive tokens ({100 * share:.1f}% of tokens) {100 * agree_dec:.1f}%")
  return ""


def _card_json(c, detail: bool = True) -> dict:
  if not detail:  # enough for the map, the list and its search by label
    return {"label": c.label, "terms": list(c.label_terms), "usage": c.usage,
            "xy": list(c.map_xy), "slim": True, "contexts": []}
  return {"label": c.label, "terms": list(c.label_terms), "usage": c.usage, "xy": list(c.map_xy),
          "promoted": [list(p) for p in c.promoted[:CARD_LOGITS]],
          "demoted": [list(p) for p in c.demoted[:CARD_LOGITS]],
          "contexts": [{"before": x.tokens_before, "trigger": x.trigger,
                        "after": x.tokens_after, "text": x.text, "act": x.activation,
                        "example_id": x.example_id} for x in c.contexts[:CARD_CONTEXTS]],
          "hist": list(c.histogram["counts"]), "neighbours": list(c.neighbours["ids"]),
          "neighbour_cos": list(c.neighbours["cosines"])}


def _usage_hist(usage_K: np.ndarray, bins: int = 24) -> dict:
  used = usage_K[usage_K > 0]
  if not len(used):
    return {"counts": [0] * bins, "edges": [0.0] * (bins + 1), "never": int(len(usage_K))}
  counts, edges = np.histogram(np.log10(used), bins=bins)
  return {"counts": counts.tolist(), "edges": edges.tolist(),
          "never": int((usage_K == 0).sum())}


def detailed_cards(cards: CardSet, shown_ids, limit: int) -> list[int]:
  """The cards whose contexts, signature and neighbours are embedded: all K when K <= limit,
  else the sample's prototypes (always), then their neighbours, then the most used, up to
  `limit`. The rest keep label, usage and map point (a full card is ~2 kB of page)."""
  if limit < 0:
    raise ValueError(f"detail_cards must be >= 0, got {limit}")
  if len(cards) <= limit:
    return list(range(len(cards)))
  keep = dict.fromkeys(sorted(int(i) for i in shown_ids))
  near = [int(j) for i in list(keep) for j in cards.card(i).neighbours["ids"]]
  by_usage = np.argsort([-c.usage for c in cards.cards], kind="stable").tolist()
  for i in near + by_usage:
    if len(keep) >= limit:
      break
    keep.setdefault(int(i))
  return list(keep)


def report_data(model, cfg: Config, decode: Callable, prompt_ids: Sequence[int],
                cards: CardSet, *, cache=None, packed=None, metrics_path: str | None = None,
                max_new_tokens: int = 32, eos_id: int | None = None, top_sequences: int = 3,
                title: str = "PRISM report", detail_cards: int = 1024,
                temperature: float = SAMPLING["temperature"], top_k: int | None = SAMPLING["top_k"],
                seed: int = SAMPLING["seed"]) -> dict:
  """Everything the page shows, as one JSON-able dict (report_page.render draws it).

  temperature / top_k / seed: how the continuation is sampled (temperature 0: greedy).

  `detail_cards` caps the cards embedded in full (see `detailed_cards`): at K 8192 all of
  them would make a ~16 MB page.
  """
  one = piece_fn(decode)  # one token as shown: a partial UTF-8 byte as <0xNN>
  if cfg.model.kind != "prism" or not hasattr(model, "bank"):
    raise ValueError("a PRISM report needs a PRISM run (model.kind='prism'); this one is "
                     f"{cfg.model.kind!r} and has no prototypes")
  if len(cards) != cfg.model.num_prototypes:
    raise ValueError(f"the cards hold {len(cards)} prototypes, the model K="
                     f"{cfg.model.num_prototypes}: build the cards for this model")
  if cards.identity.get("model_fingerprint") not in (None, fmt.model_fingerprint(model)):
    raise ValueError("the cards were built for another model (fingerprint differs); "
                     "rebuild them for this checkpoint")
  prompt = check_token_ids(prompt_ids, cfg.model.vocab_size, "prompt token ids")
  prompt = np.asarray(prompt, np.int32).reshape(-1)
  if not len(prompt):
    raise ValueError("the prompt encodes to no tokens")
  room = cfg.model.max_len - len(prompt)
  if room < 1:
    raise ValueError(f"the prompt has {len(prompt)} tokens, the model's context is "
                     f"{cfg.model.max_len}: shorten it")
  sampling = {"temperature": temperature, "seed": seed,
              "top_k": None if top_k is None else min(top_k, cfg.model.vocab_size)}
  new, atts = _generate(model, prompt, min(max_new_tokens, room), cache, packed, eos_id,
                        top_sequences, sampling)
  seq = np.concatenate([prompt, new]).astype(np.int32)
  if len(seq) < 2:
    raise ValueError("a one-token prompt with nothing generated has no token to decompose")
  parts, act, faith, trust = token_decomposition(model, seq)
  idx, contrib = np.asarray(parts.idx_Nxk), np.asarray(parts.contrib_Nxk, np.float64)
  resid, logit = np.asarray(parts.residual_N, np.float64), np.asarray(parts.logit_N, np.float64)
  tokens = []
  for j in range(len(seq) - 1):
    gen_j = j + 1 - len(prompt)  # index among the generated tokens (< 0: prompt)
    tokens.append({
        "text": one(seq[j + 1]), "id": int(seq[j + 1]), "generated": gen_j >= 0,
        "logit": float(logit[j]), "residual": float(resid[j]),
        "protos": [{"id": int(i), "act": float(a), "contrib": float(c)}
                   for i, a, c in zip(idx[j], act[j], contrib[j])],
        # the model's prediction at this position (its top-1) and whether the prototypes
        # alone pick it, with their share of its lead (None: an exact tie)
        "trust": {"top1": int(trust.top1_N[j]), "top1_text": one(trust.top1_N[j]),
                  "proto_top1": int(trust.proto_top1_N[j]),
                  "proto_top1_text": one(trust.proto_top1_N[j]),
                  "agrees": bool(trust.agrees_N[j]),
                  "share": (float(trust.proto_share_N[j])
                            if np.isfinite(float(trust.proto_share_N[j])) else None)},
        "attributions": atts[gen_j] if (atts is not None and gen_j >= 0) else []})
  usage = np.array([c.usage for c in cards.cards])
  text = decode(seq.tolist())
  detail = set(detailed_cards(cards, np.unique(idx), detail_cards))
  metrics = read_metrics(metrics_path)
  return {
      "title": title, "subtitle": f"K={cfg.model.num_prototypes} prototypes, k="
      f"{cfg.model.k} active; sample ({sampling_label(**sampling)}): {text[:160]!r}",
      "faithfulness_line": "this sample: " + faithfulness.format_line(
          {k: float("nan") if v is None else v for k, v in faith.items()})
      + val_faithfulness_line(metrics),
      "faithfulness": faith, "first_token": one(seq[0]),
      "first_id": int(seq[0]),
      "prompt_len": int(len(prompt)), "tokens": tokens,
      "residual_decided": int(sum(not t["trust"]["agrees"] for t in tokens)),
      "attribution_note": ("top attributed training sequences are listed for generated "
                           "tokens" if atts is not None else
                           "no attribution cache given: no attributed training sequences"),
      "attribution_method": influence.METHOD_LABEL if atts is not None else "",
      "cards": [_card_json(c, i in detail) for i, c in enumerate(cards.cards)],
      "detail_cards": len(detail), "map_method": cards.map_method,
      "label_method": LABEL_METHOD, "usage_hist": _usage_hist(usage),
      "metrics": metrics}


def write_report(out_dir: str, data: dict) -> str:
  """Writes <out_dir>/index.html (atomic) into a claimed report directory; returns its path."""
  out_dir = io_guard.claim_output_dir(out_dir, REPORT_KIND)
  path = paths.join(out_dir, REPORT_FILE)
  paths.write_text_atomic(path, report_page.render(data))  # local or gs://
  return path
