"""Suppression of a behaviour's prototypes: the paper-shaped table, before and after.

  prism suppress --workdir=runs/planted --behaviour=planted \
      --select=logit_signature --num=24 [--dense_workdir=runs/planted_dense] \
      [--results_json=docs/results/suppression.json]

--select: logit_signature (W p_i promotes the behaviour's tokens), contrast or probe
(activations on the run's training rows with vs without the behaviour's words; probe = L1
logistic), keywords:W1,W2 (the run's cards, --cards_dir=DIR), or file:PATH (a saved set).
Rows: the unedited model, the suppressed set, the token ban of the same words (the
baseline), and --random_sets sets of as many random prototypes (outside the set). Each
row: behaviour rate (mean score per generation, 95% bootstrap CI), its fall, quality on the
run's validation split (neutral text): perplexity, KL to the unedited model, argmax change.
The set is saved beside the run (<workdir>/suppression_sets/); the table goes to --results_json.
"""

import os
import time

import numpy as np
from absl import flags, logging

from prism_jax.cli import launcher
from prism_jax.cli import provenance
from prism_jax.cli import sampling_flags

# The rest of the library (orbax, tensorstore, scipy) is imported inside main() and its helpers: a
# bad flag or --help is answered before it loads (~0.5 s).

flags.DEFINE_string("workdir", None, "the trained PRISM run")
flags.DEFINE_string("behaviour", "planted", "planted | doctest | profanity | negative_sentiment")
flags.DEFINE_string("select", "logit_signature",
                    "logit_signature | contrast | probe | keywords:W1,W2 | file:PATH")
flags.DEFINE_integer("num", 24, "prototypes to suppress (the top of the selection)")
flags.DEFINE_list("sweep", [], "extra set sizes: suppression rows for the top n of a "
                  "selection ranked to max(sweep) (e.g. 8,16,32,64)")
flags.DEFINE_string("cards_dir", None, "the run's cards for --select=keywords: (prism "
                    "cards; built there when it holds none)")
flags.DEFINE_enum("keywords_in", "text", ["text", "trigger", "next"], "where a card's "
                  "context must hold a keyword: its window, trigger or next token")
flags.DEFINE_integer("num_samples", 32, "generations per prompt")
flags.DEFINE_integer("max_new_tokens", 48, "tokens per generation")
flags.DEFINE_integer("random_sets", 3, "random prototype sets of the same size")
flags.DEFINE_integer("contrast_rows", 96, "training rows per side for contrast/probe")
flags.DEFINE_bool("refill", False, "fill freed top-k slots with the next prototypes")
flags.DEFINE_string("dense_workdir", None, "the trained dense twin (same data, equal tokens)")
flags.DEFINE_bool("dense_only", False, "only the dense twin's row (--dense_workdir): its "
                  "behaviour rate and validation perplexity")
flags.DEFINE_string("results_json", None, "write the table to this JSON file (default: "
                    "<workdir>/suppression_<behaviour>.json)")
flags.mark_flag_as_required("workdir")
FLAGS = flags.FLAGS
sampling_flags.define(temperature=1.0, seed_help="generation seed and random sets")


def _val_batch(workdir, cfg):
  from prism_jax import io_guard  # pylint: disable=g-import-not-at-top
  from prism_jax.data import batch as batch_lib  # pylint: disable=g-import-not-at-top
  from prism_jax.data.packed import PackedData  # pylint: disable=g-import-not-at-top
  packed = PackedData(io_guard.find_packed_dir(workdir, cfg.data.packed_dir))
  rows = packed.rows("val")
  return packed, batch_lib.from_rows(rows["tokens"], rows["example_id"], rows["offset"],
                                     None)


def select(model, packed, b, ban_ids, num):
  """The --select spec's ranked set (the run's cards loaded, or built, for keywords:)."""
  from prism_jax.control import suppression_table  # pylint: disable=g-import-not-at-top
  cards = None
  if FLAGS.select.startswith("keywords"):
    if not FLAGS.cards_dir:
      raise ValueError("--select=keywords: needs --cards_dir=DIR (built there when missing)")
    from prism_jax.analysis import cards as cards_lib  # pylint: disable=g-import-not-at-top
    from prism_jax.loading import load_config  # pylint: disable=g-import-not-at-top
    if os.path.isfile(os.path.join(FLAGS.cards_dir, cards_lib.CARDS_FILE)):
      cards = cards_lib.CardSet.load(FLAGS.cards_dir, model)
    else:
      cards = cards_lib.build_cards(model, load_config(FLAGS.workdir), packed,
                                    out_dir=FLAGS.cards_dir)
  return suppression_table.selection_from_spec(
      FLAGS.select, model, ban_ids=ban_ids, packed=packed, words=b.select_words, num=num,
      contrast_rows=FLAGS.contrast_rows, seed=FLAGS.seed, cards=cards,
      keywords_in=FLAGS.keywords_in)


def _last_eval(workdir):
  """The run's last validation record (metrics.jsonl, local or gs://), or {}."""
  from prism_jax.train.metrics import read_metrics  # pylint: disable=g-import-not-at-top
  vals = read_metrics(workdir, "val")
  return vals[-1] if vals else {}


def _condition(model, tokenizer, b, val, gen_kw, **edit):
  from prism_jax.control import measure  # pylint: disable=g-import-not-at-top
  t0 = time.time()
  scores = measure.behaviour_scores(model, tokenizer, b, **gen_kw, **edit)
  q = measure.quality(model, val["inputs"], val["targets"], val["mask"], **edit)
  logging.info("condition %s: rate %.3f, ppl %.3f (%.0f s)", sorted(edit),
               scores["score"].mean(), q["ppl_after"], time.time() - t0)
  return scores, q


def _row(name, edit, measured, base, num_k, seed) -> dict:
  """One table row (control.suppression_table.condition_row, CIs over generations) with
  the set's share of the bank and the selection-half rate."""
  from prism_jax.control import behaviour_cis  # pylint: disable=g-import-not-at-top
  from prism_jax.control import suppression_table  # pylint: disable=g-import-not-at-top
  scores, q = measured
  row = suppression_table.condition_row(
      name, edit, scores["score"], q, base[0]["score"],
      rate_ci=lambda x: behaviour_cis.bootstrap_mean(x, seed=seed),
      fall_ci=lambda b, a: behaviour_cis.bootstrap_ratio_change(b, a, seed=seed))
  row["share_of_bank"] = row["prototypes"] / num_k
  if "score_selection" in scores:
    row["rate_selection_half"] = float(np.mean(scores["score_selection"]))
  return row


def _dense_only(b, gen_kw) -> None:
  """--dense_only: the dense twin's row alone, written beside it."""
  if not FLAGS.dense_workdir:
    raise ValueError("--dense_only needs --dense_workdir")
  dense = {"behaviour": b.name, "score": b.description, "dense_twin": _dense_twin(b, gen_kw)}
  d = dense["dense_twin"]
  print(f"dense twin {d['workdir']}: val ppl {d['val_perplexity']:.3f} at step "
        f"{d['step']}, rate {d['rate']['mean']:.3f} "
        f"[{d['rate']['lo']:.3f}, {d['rate']['hi']:.3f}]")
  out = FLAGS.results_json or os.path.join(FLAGS.dense_workdir, f"dense_{b.name}.json")
  provenance.write_results(out, dense, "prism suppress")


@launcher.writes_into_run  # one writer per run (its cache, cards, report, sets)
def main(argv):
  del argv
  from prism_jax.control import behaviours, suppression_table  # pylint: disable=g-import-not-at-top
  from prism_jax.control.suppression import ProtoSet  # pylint: disable=g-import-not-at-top
  from prism_jax.loading import load_for_inference  # pylint: disable=g-import-not-at-top
  b = behaviours.behaviour(FLAGS.behaviour)
  gen_kw = dict(num_samples=FLAGS.num_samples, max_new_tokens=FLAGS.max_new_tokens,
                **sampling_flags.kwargs())  # --greedy included
  if FLAGS.dense_only:
    _dense_only(b, gen_kw)
    return
  rec = provenance.record("prism suppress")
  model, cfg, tokenizer = load_for_inference(FLAGS.workdir, needs_prototypes="suppression")
  packed, val = _val_batch(FLAGS.workdir, cfg)
  ban_ids = behaviours.word_token_ids(tokenizer, b.select_words)
  sweep = sorted(int(n) for n in FLAGS.sweep)
  ranked = select(model, packed, b, ban_ids, max([FLAGS.num] + sweep))
  sel = ranked.top(FLAGS.num)
  saved = ProtoSet.create(model, sel.ids, sel.scores, sel.method, sel.query).save(
      FLAGS.workdir, name=f"{b.name}_{sel.method}_{len(sel.ids)}")
  num_k = cfg.model.num_prototypes
  conditions = suppression_table.conditions(
      [(f"suppress ({sel.method})", sel.ids)], ("token ban", ban_ids), num_k,
      refill=FLAGS.refill, random_sets=FLAGS.random_sets, seed=FLAGS.seed)
  results = {}
  for name, edit in conditions:
    results[name] = _condition(model, tokenizer, b, val, gen_kw, **edit)
  base = results["unedited"]
  rows = [_row(name, edit, results[name], base, num_k, FLAGS.seed)
          for name, edit in conditions]
  for n in sweep:
    if n > len(ranked.ids):
      continue  # the selection ranked fewer prototypes
    measured = _condition(model, tokenizer, b, val, gen_kw, ids=ranked.ids[:n],
                          refill=FLAGS.refill)
    rows.append(_row(f"sweep: top {n}", {"ids": ranked.ids[:n]}, measured, base, num_k,
                     seed=0))  # CIs: seed 0
  summary = {
      **rec,
      "behaviour": b.name, "score": b.description, "selection": {
          "method": sel.method, "query": sel.query, "ids": list(sel.ids),
          "scores": list(sel.scores), "saved": saved},
      "generations_per_condition": len(base[0]["score"]), "neutral_tokens": base[1]["tokens"],
      "faithfulness": {k: _last_eval(FLAGS.workdir).get(k) for k in
                       ("agreement", "proto_ce_ratio", "centred_proto_share", "residual_share",
                        "r1_bar", "r2_bar", "perplexity")},
      "rows": rows,
      "random_over_suppression": suppression_table.random_over_suppression(rows),
      "samples": {name: results[name][0]["texts"][:3] for name, _ in conditions[:3]},
  }
  if FLAGS.dense_workdir:
    summary["dense_twin"] = _dense_twin(b, gen_kw)
  _print_table(summary)
  out = FLAGS.results_json or os.path.join(FLAGS.workdir, f"suppression_{b.name}.json")
  provenance.write_results(out, summary)
  print(f"wrote {out}")


def _dense_twin(b, gen_kw):
  from prism_jax.control import behaviour_cis, measure  # pylint: disable=g-import-not-at-top
  from prism_jax.loading import load_for_inference  # pylint: disable=g-import-not-at-top
  dense, cfg, tokenizer = load_for_inference(FLAGS.dense_workdir)
  texts = measure.generations(dense, tokenizer, b.prompts, **gen_kw)
  ev = _last_eval(FLAGS.dense_workdir)
  return {"workdir": FLAGS.dense_workdir, "val_perplexity": ev.get("perplexity"),
          "val_loss": ev.get("loss"), "step": ev.get("step"),
          "generations": len(texts),
          "rate": behaviour_cis.bootstrap_mean([b.score(t) for t in texts], seed=FLAGS.seed)._asdict()}


def _print_table(s):
  print(f"\nbehaviour {s['behaviour']}: {s['score']}; {s['generations_per_condition']} "
        f"generations per row; quality on {s['neutral_tokens']} neutral tokens")
  sel_col = "rate_selection_half" in s["rows"][0]
  print("| condition | prototypes (share) | rate [95% CI] | fall [95% CI] |"
        + (" selection-half rate |" if sel_col else "") + " ppl (change) | KL | argmax change |")
  print("|---|---|---|---|" + ("---|" if sel_col else "") + "---|---|---|")
  for r in s["rows"]:
    rate, fall = r["rate"], r.get("rate_fall")
    protos = (f"{r['prototypes']} ({100 * r['share_of_bank']:.2f}%)" if r["prototypes"]
              else (f"{r['banned_tokens']} tokens banned" if r["banned_tokens"] else "-"))
    fall_s = f"{100 * fall['mean']:.1f}% [{100 * fall['lo']:.1f}, {100 * fall['hi']:.1f}]" if fall else "-"
    print(f"| {r['condition']} | {protos} | {rate['mean']:.3f} [{rate['lo']:.3f}, {rate['hi']:.3f}] | "
          f"{fall_s} |" + (f" {r['rate_selection_half']:.3f} |" if sel_col else "")
          + f" {r['ppl']:.3f} ({100 * r['ppl_change']:+.2f}%) | {r['kl']:.4f} | "
          f"{100 * r['argmax_change']:.2f}% |")
  if s.get("random_over_suppression") is not None:
    print(f"random sets' mean |fall| / suppression's fall: {s['random_over_suppression']:.3f}")
  f = s["faithfulness"]
  print("faithfulness (last eval): " + ", ".join(f"{k} {v:.4g}" for k, v in f.items() if v is not None))
  if "dense_twin" in s:
    d = s["dense_twin"]
    print(f"dense twin: val ppl {d['val_perplexity']:.3f} at step {d['step']}, "
          f"rate {d['rate']['mean']:.3f} [{d['rate']['lo']:.3f}, {d['rate']['hi']:.3f}]")


if __name__ == "__main__":
  launcher.run(main)
