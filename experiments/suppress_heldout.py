"""Suppression held out for real (issue 30): choices on validation, one measurement on test.

  python -m experiments.suppress_heldout --workdir=RUN --behaviour=planted \
      [--nums=16,32,48,64] [--refills=false,true] [--random_sets=8] \
      [--results_json=docs/results/suppression_heldout.json]

The protocol (prism_jax/control/heldout.py):
  1. Selection texts: planted: topic documents written apart from the training corpus (own
     seed) with selection-half words only, against training rows with no marked word;
     doctest: training rows with `>>>` against rows without. Every selector (contrast over
     prototype activations; logit signature over the selection words' tokens) and the
     token ban (the same contrast statistic over token frequencies) read these only.
  2. Choices: set size (--nums: the contrast ranking's top n, i.e. its threshold) and
     refill (--refills), on the validation prompts' measure (planted: selection-half words;
     doctest: `>>>` lines): among settings within --ppl_budget of neutral perplexity, the
     smallest whose validation fall is within --tol of the best.
  3. Once, at the chosen setting, on the test prompts (disjoint from validation): the
     held-out rate of the unedited model, the contrast set, the logit-signature set of the
     same size, the token ban of as many tokens, and --random_sets random sets of the same
     size; 95% CIs by a bootstrap over prompts (the clusters); neutral perplexity on the
     run's validation split.
"""

import os

from absl import flags, logging

from prism_jax.cli import flag_checks as check
from prism_jax.cli import launcher as cli
from prism_jax.cli import provenance
from prism_jax.cli import sampling_flags

flags.DEFINE_string("workdir", None, "the trained PRISM run (planted corpus for 'planted')")
flags.DEFINE_enum("behaviour", "planted", ["planted", "doctest"], "behaviour")
flags.DEFINE_list("nums", ["16", "32", "48", "64"], "set sizes tried on validation")
flags.DEFINE_list("refills", ["false", "true"], "refill settings tried on validation")
flags.DEFINE_float("ppl_budget", 0.02, "largest neutral perplexity rise a choice may cost")
flags.DEFINE_float("tol", 0.02, "validation falls within this of the best count as ties "
                   "(the smaller set wins)")
flags.DEFINE_integer("selection_texts", 96, "texts per side for the selectors and the ban")
flags.DEFINE_integer("validation_prompts", 16, "planted: validation prompts")
flags.DEFINE_integer("test_prompts", 24, "planted: test prompts")
flags.DEFINE_integer("doctest_validation", 10, "doctest: validation prompts (rest: test)")
flags.DEFINE_integer("num_samples", 16, "generations per prompt")
flags.DEFINE_integer("max_new_tokens", 48, "tokens per generation")
flags.DEFINE_integer("random_sets", 8, "random prototype sets of the chosen size")
flags.DEFINE_float("ban_common", 0.1, "the token ban skips tokens in more than this share "
                   "of the without-texts (fixed, not chosen on validation)")
flags.DEFINE_string("results_json", None, "write the results here (default: "
                    "<workdir>/suppression_heldout_<behaviour>.json)")
flags.mark_flag_as_required("workdir")
FLAGS = flags.FLAGS
sampling_flags.define(temperature=1.0, seed_help="protocol texts, prompts, samples, random sets")


def _bool(text: str) -> bool:
  if text.lower() not in ("true", "false"):
    raise ValueError(f"--refills: expected true/false, got {text!r}")
  return text.lower() == "true"


def _split(packed, tokenizer):
  """The behaviour's HeldoutSplit from the run's training rows (decoded) and the protocol's
  own texts."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from prism_jax.control import behaviours, heldout, planted  # pylint: disable=g-import-not-at-top
  rows = packed.rows("train")["tokens"]
  texts = [tokenizer.decode(r.tolist()) for r in rows]
  rng = np.random.default_rng(FLAGS.seed)
  sample = lambda pool: [pool[i] for i in rng.permutation(len(pool))[:FLAGS.selection_texts]]
  if FLAGS.behaviour == "planted":
    plain = [t for t in texts if not planted.count_words(t, planted.MARKED_WORDS)
             and planted.TITLE.split()[-1] not in t]
    return heldout.planted_split(sample(plain), num_texts=FLAGS.selection_texts,
                                 num_validation=FLAGS.validation_prompts,
                                 num_test=FLAGS.test_prompts, seed=FLAGS.seed)
  has = [t for t in texts if behaviours.doctest_lines(t) or ">>>" in t]
  plain = [t for t in texts if ">>>" not in t]
  return heldout.doctest_split(sample(has), sample(plain),
                               num_validation=FLAGS.doctest_validation, seed=FLAGS.seed)


def _neutral(workdir, cfg):
  from prism_jax import io_guard  # pylint: disable=g-import-not-at-top
  from prism_jax.data import batch as batch_lib  # pylint: disable=g-import-not-at-top
  from prism_jax.data.packed import PackedData  # pylint: disable=g-import-not-at-top
  packed = PackedData(io_guard.find_packed_dir(workdir, cfg.data.packed_dir))
  rows = packed.rows("val")
  return packed, batch_lib.from_rows(rows["tokens"], rows["example_id"], rows["offset"], None)


# The prompt counts of one behaviour; given with the other they would be ignored.
ONLY_FOR = {"validation_prompts": "planted", "test_prompts": "planted",
            "doctest_validation": "doctest"}


def check_flags() -> tuple[list[int], list[bool]]:
  """Every flag combination, before the model loads (one `error:` line); returns --nums
  and --refills parsed."""
  check.not_empty(nums=FLAGS.nums, refills=FLAGS.refills)
  nums, refills = check.numbers("nums", FLAGS.nums, int, low=1), [_bool(r) for r in FLAGS.refills]
  for name, behaviour in ONLY_FOR.items():
    if FLAGS[name].present and FLAGS.behaviour != behaviour:
      raise ValueError(f"--{name}: only with --behaviour={behaviour} (got {FLAGS.behaviour})")
  check.at_least(1, selection_texts=FLAGS.selection_texts,
                 validation_prompts=FLAGS.validation_prompts, test_prompts=FLAGS.test_prompts,
                 doctest_validation=FLAGS.doctest_validation, num_samples=FLAGS.num_samples,
                 max_new_tokens=FLAGS.max_new_tokens)
  check.at_least(0, top_k=FLAGS.top_k, random_sets=FLAGS.random_sets,
                 ppl_budget=FLAGS.ppl_budget, tol=FLAGS.tol, temperature=FLAGS.temperature)
  check.in_range("ban_common", FLAGS.ban_common, 0, 1, low_open=True)
  check.existing("workdir", FLAGS.workdir, "run directory")
  check.output_file("results_json", FLAGS.results_json)
  return nums, refills


def _test_conditions(ranked, n: int, refill: bool, num_k: int) -> list[tuple[str, dict]]:
  """(name, edit) of every test row: unedited, the contrast set, the logit signature's, the
  token ban and --random_sets random sets outside the contrast set (all n, the chosen)."""
  from prism_jax.control import suppression_table  # pylint: disable=g-import-not-at-top
  return suppression_table.conditions(
      [(f"suppress (contrast, top {n})", ranked.contrast.ids[:n]),
       (f"logit signature (top {n})", ranked.logit_signature.ids[:n])],
      (f"token ban (contrast on tokens, {n} tokens)", ranked.ban.ids[:n]), num_k,
      refill=refill, random_sets=FLAGS.random_sets, seed=FLAGS.seed)


def _test_rows(model, tok, split, neutral, gen_kw, conditions) -> list[dict]:
  """Each condition once on the test prompts (control.suppression_table.condition_row, CIs
  over prompts), with the validation measure on test."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from prism_jax.control import behaviour_cis, measure, suppression_table  # pylint: disable=g-import-not-at-top
  num_p = len(split.test_prompts)
  rows, base = [], None
  for name, edit in conditions:
    texts = measure.generations(model, tok, split.test_prompts, **gen_kw, **edit)
    score = np.array([split.test_score(t) for t in texts])
    q = measure.quality(model, neutral["inputs"], neutral["targets"], neutral["mask"], **edit)
    base = score if base is None else base
    row = suppression_table.condition_row(
        name, edit, score, q, base,
        rate_ci=lambda x: behaviour_cis.clustered_mean(x, num_p, seed=FLAGS.seed),
        fall_ci=lambda b, a: behaviour_cis.clustered_fall(b, a, num_p, seed=FLAGS.seed))
    row["validation_measure_on_test"] = float(np.mean([split.validation_score(t)
                                                       for t in texts]))
    rows.append(row)
    logging.info("%s: rate %.3f", name, row["rate"]["mean"])
  return rows


def main(argv):
  del argv
  nums, refills = check_flags()
  import numpy as np  # pylint: disable=g-import-not-at-top
  from prism_jax.control import heldout, suppression_table  # pylint: disable=g-import-not-at-top
  from prism_jax.loading import load_for_inference  # pylint: disable=g-import-not-at-top
  model, cfg, tok = load_for_inference(FLAGS.workdir, needs_prototypes="suppression")
  packed, neutral = _neutral(FLAGS.workdir, cfg)
  split = _split(packed, tok)
  gen_kw = dict(num_samples=FLAGS.num_samples, max_new_tokens=FLAGS.max_new_tokens,
                **sampling_flags.kwargs())  # --greedy included
  ranked = heldout.rankings(model, tok, split, max_num=max(nums), seq_len=cfg.data.seq_len,
                            ban_common=FLAGS.ban_common)

  # 2. The choice, on validation only.
  evaluate = heldout.validation_evaluator(model, tok, split, ranked.contrast, gen_kw, neutral)
  chosen, val_rows = heldout.choose(evaluate, nums, refills, ppl_budget=FLAGS.ppl_budget,
                                    tol=FLAGS.tol)
  n, refill = chosen["num"], chosen["refill"]
  logging.info("chosen on validation: %d prototypes, refill %s", n, refill)

  # 3. Once, on test.
  conditions = _test_conditions(ranked, n, refill, cfg.model.num_prototypes)
  rows = _test_rows(model, tok, split, neutral, gen_kw, conditions)
  result = {
      **provenance.record("experiments.suppress_heldout"), "behaviour": split.behaviour,
      "protocol": {
          "selection_texts": {"with": len(split.with_texts), "without": len(split.without_texts),
                              "select_words": list(split.select_words)},
          "validation": {"measure": split.validation_measure,
                         "prompts": list(split.validation_prompts)},
          "test": {"measure": split.test_measure, "prompts": list(split.test_prompts)},
          "generations_per_prompt": FLAGS.num_samples, "ci": "95% percentile bootstrap over "
          "prompts (2,000 resamples; falls paired over the same prompts)"},
      "choices": {"set_size": {"chosen": n, "from": nums, "on": split.validation_measure},
                  "refill": {"chosen": refill, "from": refills, "on": split.validation_measure},
                  "rule": f"neutral ppl rise <= {FLAGS.ppl_budget:g}; smallest set within "
                          f"{FLAGS.tol:g} of the best validation fall",
                  "validation_rows": val_rows},
      "rankings": {"contrast": list(ranked.contrast.ids), "logit_signature":
                   list(ranked.logit_signature.ids), "ban_tokens": list(ranked.ban.ids),
                   "ban_token_text": [tok.decode([i]) for i in ranked.ban.ids[:n]]},
      "neutral_tokens": int(np.asarray(neutral["mask"]).sum()),
      "rows": rows,
      "random_over_suppression": suppression_table.random_over_suppression(rows),
  }
  _print(result)
  out = FLAGS.results_json or os.path.join(FLAGS.workdir, f"suppression_heldout_{split.behaviour}.json")
  provenance.write_results(out, result)
  print(f"wrote {out}")


def _print(r):
  print("\nvalidation (choices):\n| set | refill | validation rate | fall | neutral ppl |\n"
        "|---|---|---|---|---|")
  for v in r["choices"]["validation_rows"]:
    print(f"| {v['num']} | {v['refill']} | {v['rate']:.3f} (unedited {v['base_rate']:.3f}) | "
          f"{100 * v['fall']:.1f}% | {100 * v['ppl_change']:+.2f}% |")
  c = r["choices"]
  print(f"chosen: {c['set_size']['chosen']} prototypes, refill {c['refill']['chosen']}")
  print("\ntest (once):\n| condition | rate [95% CI, prompts] | fall [95% CI] | neutral ppl | KL |"
        "\n|---|---|---|---|---|")
  for row in r["rows"]:
    rate, fall = row["rate"], row.get("rate_fall")
    f = (f"{100 * fall['mean']:.1f}% [{100 * fall['lo']:.1f}, {100 * fall['hi']:.1f}]"
         if fall else "-")
    print(f"| {row['condition']} | {rate['mean']:.3f} [{rate['lo']:.3f}, {rate['hi']:.3f}] | "
          f"{f} | {row['ppl']:.3f} ({100 * row['ppl_change']:+.2f}%) | {row['kl']:.4f} |")


if __name__ == "__main__":
  cli.run(main)
