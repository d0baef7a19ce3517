"""LDS and removal-and-retrain curves of every attribution method (PRISM.md §5 quality).

  python -m experiments.lds --out=/tmp/prism_lds [--subsets=32] [--queries=64]
      [--ceiling_subsets=6] [--removal_queries=2] [--results_json=docs/results/lds.json]
      [--plot=docs/lds_removal.png]
  python -m experiments.lds --plot_from=docs/results/lds.json --plot=docs/lds_removal.png

The model: experiments/lds_recipe.py's RECIPE (every model option and loss weight pinned;
--set changes them) trained with the model's own recipe (attribution/quality/retrain.py) on the
first --num_rows training rows, seed 0. Every method scores
every (query, row) pair on it (attribution/quality/methods.py). Then the protocol
(attribution/quality/protocol.py):
  LDS      --subsets random subsets at --alpha, each retrained (seed 0); per query the
           Spearman of the predicted loss (−Σ kept scores) with the measured summed loss;
           mean ± bootstrap CI over queries. Noise ceiling: the first --ceiling_subsets
           retrained with seed 1 too (Spearman between the two seeds' measurements).
  removal  for the first --removal_queries queries, each method's top-m rows removed
           (m in --removal_m) and the model retrained (seed 0): the query loss change
           against the full model (m = 0); the random method removes m random rows;
           mean and bootstrap CI over those queries.
Each retrain's measurements are saved under <out>/retrains (a rerun skips them; the
scores under <out>/scores), both claimed by a content key (the training rows, the
queries, the whole config, --num_rows/--alpha/--seed/--rank, the code commit): an
interrupted run resumes, and a rerun whose key differs (another --set, flag, data or
commit) is refused with one line before anything is trained. --dry_run resolves and claims
the key, prints it and stops. Prints the tables (markdown).
"""

import json
import os

import numpy as np
from absl import flags, logging

from experiments import lds_recipe
from prism_jax.cli import flag_checks as check
from results_md.lds_removal import removal_section
from prism_jax.cli import launcher
from prism_jax.cli import provenance

flags.DEFINE_string("out", "/tmp/prism_lds", "directory written: data, scores, retrains, "
                    "results.md")
flags.DEFINE_integer("num_rows", 2048, "training sequences (the first packed rows)")
flags.DEFINE_integer("subsets", 32, "LDS subsets M (one retrain each)")
flags.DEFINE_float("alpha", 0.5, "fraction of the training rows each subset keeps")
flags.DEFINE_integer("queries", 64, "query rows (validation)")
flags.DEFINE_integer("targets", 4, "target tokens per query (its measured loss is their sum)")
flags.DEFINE_integer("ceiling_subsets", 6, "subsets retrained with a second seed")
flags.DEFINE_integer("removal_queries", 2, "queries with removal curves")
flags.DEFINE_list("removal_m", ["16", "32", "64", "128"], "rows removed per curve point")
flags.DEFINE_list("methods", ["prism", "full", "ekfac", "grad_dot", "trak", "random"], "methods")
flags.DEFINE_list("removal_methods", [], "methods with removal curves (default: --methods)")
flags.DEFINE_list("choose_among", [], "methods (variants: groups, projection) the choose half "
                  "of the queries picks from; every method is then reported on the other half")
flags.DEFINE_integer("rank", 32, "cached PRISM's projection rank")
flags.DEFINE_integer("seed", 0, "subsets, queries and random scores")
flags.DEFINE_multi_string("set", [], "config overrides on top of RECIPE")
flags.DEFINE_string("results_json", None, "also write the headline rows here (reproduce.py)")
flags.DEFINE_string("plot", None, "removal curves PNG")
flags.DEFINE_string("plot_from", None, "only draw --plot from this run's --results_json "
                    "(its removal_ci): no data, training or scoring")
flags.DEFINE_bool("dry_run", False, "resolve the recipe, data, queries and content key, "
                  "claim the workdir for them, print the key and stop (trains nothing)")
FLAGS = flags.FLAGS


RETENTION_M = 100  # the retention of the top-m rows (the cache's projection vs none)


def _write_plot(path, ms, removal_ci):
  """Removal curves: per method the mean and bootstrap CI (removal_ci: per m (mean, lo,
  hi)) at each m, from 0 at m = 0."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(6, 4))
  for name, ci in removal_ci.items():
    mean = [0.0] + [c[0] for c in ci]
    err = [[0.0] + [c[0] - c[1] for c in ci], [0.0] + [c[2] - c[0] for c in ci]]
    ax.errorbar([0] + list(ms), mean, yerr=err, marker="o", capsize=3, label=name)
  ax.axhline(0, color="gray", lw=0.5)
  ax.set_xlabel("training rows removed (m)")
  ax.set_ylabel("query loss change (nats)\nmean and 95% CI over queries")
  ax.set_title("Removal and retrain: top-m attributed rows")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


METHODS = ("prism", "full", "ekfac", "ekfac[bank]", "ekfac[last]", "ekfac[early]",
           "ekfac[bank+last]", "ekfac[last+early]", "ekfac_cached[early]",
           "ekfac_cached[last+early]", "ekfac_cached[bank+last+early]",
           "ekfac_cached_r1024[early]", "grad_dot", "trak", "random")


def check_flags() -> list[int]:
  """Every flag combination that needs no data, before any work (one `error:` line);
  returns --removal_m as integers. --removal_m < the data's train rows is checked once
  the data is prepared."""
  check.output_file("plot", FLAGS.plot)
  if FLAGS.plot_from:
    if not FLAGS.plot:
      raise ValueError("--plot_from needs --plot (the PNG to write)")
    check.existing("plot_from", FLAGS.plot_from, "results file")
    return []
  if FLAGS.subsets < 3:
    raise ValueError(f"--subsets={FLAGS.subsets}: a Spearman correlation needs >= 3")
  if FLAGS.ceiling_subsets and not 3 <= FLAGS.ceiling_subsets <= FLAGS.subsets:
    raise ValueError(f"--ceiling_subsets={FLAGS.ceiling_subsets} must be 0 or in [3, "
                     f"--subsets={FLAGS.subsets}]")
  check.at_least(1, num_rows=FLAGS.num_rows, queries=FLAGS.queries, targets=FLAGS.targets,
                 rank=FLAGS.rank)
  check.in_range("alpha", FLAGS.alpha, 0, 1, low_open=True, high_open=True)
  check.in_range("removal_queries", FLAGS.removal_queries, 0, FLAGS.queries)
  check.not_empty(methods=FLAGS.methods)
  unknown = sorted(set(FLAGS.methods) - set(METHODS))
  if unknown:
    raise ValueError(f"--methods: unknown {unknown}")
  if set(FLAGS.choose_among) - set(FLAGS.methods):
    raise ValueError(f"--choose_among {sorted(set(FLAGS.choose_among) - set(FLAGS.methods))} "
                     "are not in --methods")
  if FLAGS.choose_among and FLAGS.queries < 4:
    raise ValueError(f"--choose_among needs --queries >= 4 (two halves), got {FLAGS.queries}")
  removal_methods = FLAGS.removal_methods or FLAGS.methods
  if set(removal_methods) - set(FLAGS.methods):
    raise ValueError(f"--removal_methods {sorted(set(removal_methods) - set(FLAGS.methods))} "
                     "are not in --methods")
  ms = check.numbers("removal_m", FLAGS.removal_m, int, low=1)
  if FLAGS.removal_queries and not ms:
    raise ValueError("--removal_m is empty: give the rows removed per curve point")
  if any(m >= FLAGS.num_rows for m in ms):
    raise ValueError(f"--removal_m {ms}: every m must be below --num_rows={FLAGS.num_rows}")
  check.output_file("results_json", FLAGS.results_json)
  return ms


def _plot_from(path: str) -> None:
  """--plot_from: draw --plot from a results file's removal curves (nothing trained)."""
  with open(path) as f:
    results = json.load(f)
  if not {"removal_ci", "removal_m"} <= set(results):
    raise ValueError(f"--plot_from={path}: no removal_ci/removal_m (not an "
                     "experiments.lds results file)")
  if not results["removal_ci"]:
    raise ValueError(f"--plot_from={path}: it was run with removal curves off "
                     "(--removal_queries=0): nothing to draw")
  _write_plot(FLAGS.plot, results["removal_m"], results["removal_ci"])
  print(f"wrote {FLAGS.plot}")


def _lds_table(cfg, packed, E: int, scores, cost, measured) -> tuple[list[str], list[dict]]:
  """The LDS table's markdown lines and its results rows (with the ceiling and, with both
  prism and full scored, the cache's top-m retention)."""
  from prism_jax.attribution.quality import lds  # pylint: disable=g-import-not-at-top
  ceiling = measured.ceiling
  # Two seeds' measurements correlate at ρ ≈ reliability; the best possible predictor of one
  # seed's measurement correlates with it at ≈ √ρ: that is the LDS ceiling.
  ceil_txt = "–" if ceiling is None else (
      f"√{ceiling[0]:.3f} = {np.sqrt(max(ceiling[0], 0)):.3f} (two-seed ρ CI "
      f"[{ceiling[1]:.3f}, {ceiling[2]:.3f}])")
  lines = [f"model: d={cfg.model.d_model}, layers={cfg.model.n_layers}, "
           f"K={cfg.model.num_prototypes}, k={cfg.model.k}, {cfg.train.steps} steps; "
           f"{E} training rows × {packed.seq_len} tokens; {FLAGS.queries} queries × "
           f"{FLAGS.targets} target tokens; M = {FLAGS.subsets} subsets at α = {FLAGS.alpha}; "
           f"noise ceiling from {FLAGS.ceiling_subsets} subsets × 2 seeds", "",
           "| method | LDS mean [95% CI] | noise ceiling √ρ(seed A, seed B) | scoring s (all "
           "queries) |",
           "|---|---|---|---|"]
  rows_json = []
  for name in FLAGS.methods:
    mean, lo, hi = lds.bootstrap_ci(measured.per_query[name])
    lines.append(f"| {name} | {mean:.3f} [{lo:.3f}, {hi:.3f}] | {ceil_txt} | "
                 f"{cost[name]:.1f} |")
    rows_json.append({"metric": f"LDS ({name})", "paper": "not reported", "ours": round(mean, 4),
                      "ci": [round(lo, 4), round(hi, 4)], "section": "§5"})
  if ceiling is not None:
    rows_json.append({"metric": "LDS noise ceiling √ρ(seed A, seed B)", "paper": "not reported",
                      "ours": round(float(np.sqrt(max(ceiling[0], 0))), 4), "section": "§5",
                      "note": f"two-seed Spearman ρ {ceiling[0]:.3f}"})
  if "prism" in scores and "full" in scores:  # the cache's projection against no projection
    from prism_jax.attribution.scoring.influence import top_overlap  # pylint: disable=g-import-not-at-top
    ids = np.arange(E)
    ret = [top_overlap(ids, scores["prism"][q], ids, scores["full"][q], RETENTION_M)
           for q in range(len(scores["prism"]))]
    mean, lo, hi = lds.bootstrap_ci(np.asarray(ret))
    lines += ["", f"Top-{RETENTION_M} retention of cached PRISM (rank {FLAGS.rank}) against full "
                  f"prototype space, over {len(ret)} queries × {E} rows: {100 * mean:.1f}% "
                  f"[{100 * lo:.1f}, {100 * hi:.1f}]"]
    rows_json.append({"metric": f"top-{RETENTION_M} retention, cached PRISM vs full prototype "
                                "space", "paper": "not reported", "ours": round(mean, 4),
                      "ci": [round(lo, 4), round(hi, 4)], "section": "§5",
                      "note": f"{len(ret)} queries × {E} rows, rank {FLAGS.rank}"})
  return lines, rows_json


def _held_out_choice(measured) -> tuple[list[str], list[dict]]:
  """--choose_among: the variant the choose half of the queries picks, and every method's
  LDS on the report half (the chosen one's measured there once)."""
  from prism_jax.attribution.quality import lds  # pylint: disable=g-import-not-at-top
  per_q = measured.per_query
  choose_q, report_q = lds.query_halves(FLAGS.queries, FLAGS.seed)
  best, means = lds.choose_best(per_q, list(FLAGS.choose_among), choose_q)
  lines = ["", f"Held-out choice: the choose half ({len(choose_q)} queries) picks **{best}** "
               "among " + ", ".join(f"{m} {v:.3f}" for m, v in means.items())
           + f"; every method on the report half ({len(report_q)} queries):", "",
           "| method | LDS on the report half [95% CI] |", "|---|---|"]
  rows = []
  for name in FLAGS.methods:
    mean, lo, hi = lds.bootstrap_ci(per_q[name][report_q])
    mark = " (chosen)" if name == best else ""
    lines.append(f"| {name}{mark} | {mean:.3f} [{lo:.3f}, {hi:.3f}] |")
    rows.append({"metric": f"LDS report half ({name}{mark})", "paper": "not reported",
                 "ours": round(mean, 4), "ci": [round(lo, 4), round(hi, 4)], "section": "§5",
                 "note": f"chosen on the other {len(choose_q)} queries among "
                         f"{', '.join(FLAGS.choose_among)}"})
  return lines, rows


def main(argv):
  del argv
  ms = check_flags()
  if FLAGS.plot_from:
    _plot_from(FLAGS.plot_from)
    return
  removal_methods = FLAGS.removal_methods or FLAGS.methods
  import jax  # pylint: disable=g-import-not-at-top
  # Every retrain compiles the same programs: the persistent cache makes that once.
  jax.config.update("jax_compilation_cache_dir", os.path.join(FLAGS.out, "jax_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  from prism_jax.data import prepare_data  # pylint: disable=g-import-not-at-top
  from prism_jax.attribution.quality import protocol, retrain  # pylint: disable=g-import-not-at-top
  cfg = lds_recipe.config(FLAGS.set)
  os.makedirs(FLAGS.out, exist_ok=True)
  packed = prepare_data(cfg.data, cfg.model.vocab_size, FLAGS.out)
  E = FLAGS.num_rows
  if E > packed.num_rows("train"):
    raise ValueError(f"--num_rows={E} but the data has {packed.num_rows('train')} train rows")
  if any(m >= E for m in ms):
    raise ValueError(f"--removal_m {ms}: every m must be below the {E} training rows")
  q_rows, queries = retrain.sample_queries(packed, FLAGS.queries, FLAGS.targets,
                                            FLAGS.seed)
  key = retrain.content_key(
      np.asarray(packed.rows("train")["tokens"][:E]), queries, cfg, provenance.git_commit(),
      {"num_rows": E, "alpha": FLAGS.alpha, "seed": FLAGS.seed, "rank": FLAGS.rank})
  score_dir = os.path.join(FLAGS.out, "scores")
  store = retrain.RetrainStore(os.path.join(FLAGS.out, "retrains"), key)
  retrain.claim_key(score_dir, key)
  logging.info("content key %s (%s)", retrain.key_hash(key)[:16], key["commit"])
  if FLAGS.dry_run:
    print(json.dumps(dict(key, hash=retrain.key_hash(key)), indent=1))
    return
  p = protocol.Protocol(num_rows=E, subsets=FLAGS.subsets, alpha=FLAGS.alpha,
                        ceiling_subsets=FLAGS.ceiling_subsets,
                        removal_queries=FLAGS.removal_queries, removal_m=tuple(ms),
                        seed=FLAGS.seed)
  run = protocol.Retrains(store, cfg, packed, queries, p.num_retrains(removal_methods))
  scores, cost = protocol.method_scores(FLAGS.methods, cfg, packed, queries, p, score_dir,
                                        scratch=FLAGS.out, rank=FLAGS.rank)
  measured = protocol.measure(run, p, scores, removal_methods)
  lines, rows_json = _lds_table(cfg, packed, E, scores, cost, measured)
  if FLAGS.choose_among:
    held_lines, held_rows = _held_out_choice(measured)
    lines, rows_json = lines + held_lines, rows_json + held_rows
  deltas = measured.deltas
  removal_lines, removal_ci = removal_section(
      deltas, ms, np.abs(measured.full1 - measured.full0))
  table = "\n".join(lines + removal_lines)
  print(table)
  with open(os.path.join(FLAGS.out, "results.md"), "w") as f:
    f.write(table + "\n")
  if FLAGS.plot and removal_ci:
    _write_plot(FLAGS.plot, ms, removal_ci)
  elif FLAGS.plot:
    logging.warning("--plot: no removal curves to draw (--removal_queries=0)")
  if FLAGS.results_json:
    rec = provenance.record("experiments.lds")
    for r in rows_json:
      r["command"] = rec["command"]
    out = {**rec, "rows": rows_json, "removal": {n: deltas[n].tolist() for n in deltas},
           "removal_ci": removal_ci, "removal_m": ms, "queries": q_rows, "table": table,
           "config": key["config"], "key_hash": retrain.key_hash(key)}
    provenance.write_results(FLAGS.results_json, out)


if __name__ == "__main__":
  launcher.run(main)
