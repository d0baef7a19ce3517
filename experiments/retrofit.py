"""PRISM from scratch vs PRISM retrofitted onto its trained dense twin (issue 29, item 6).

  nice -n 10 python -m experiments.retrofit --root=/tmp/hf_meas --seeds=0,1 \
      --results_json=docs/results/retrofit.json

Per seed (train.seed = data.seed = s), on the embedded corpus with the tiny preset:
  dense    the dense twin, train.steps (600)
  scratch  today's tiny PRISM: dense warm-up to proto_init_step (50), then the bank
  frozen   train.init_from=dense, train.trainable=prototypes: the bank alone trains
  full     train.init_from=dense, everything trains
The retrofits run steps - proto_init_step (550) steps with the bank set at step 0: every
PRISM run trains its bank on the same number of tokens. Runs already finished under --root
are reused (train() resumes), so the table can be re-read cheaply.

Reported per run: val CE (and vs the seed's dense twin), argmax agreement of W z_hat with
W z on all and on decisive tokens (prism_jax/faithfulness.py), proto-path CE ratio, R̄1/R̄2,
dead prototypes (the final eval: train.eval_batches 8 covers the whole val split; a run
written by older code without the decisive-token metrics is evaluated again), the steady training time of the run's own steps, and the
attribution retention: top-m overlap of cached PRISM scores (rank --rank) with the full
prototype-space scores (linear path) for --queries val tokens, over the first --max_rows
training rows.
"""

import json
import os

import numpy as np
from absl import flags, logging

from prism_jax.cli import flag_checks as check
from prism_jax.cli import launcher as cli
from prism_jax.cli import provenance

RUNS = ("dense", "scratch", "frozen", "full")

flags.DEFINE_string("root", None, "directory of the runs (reused when finished)")
flags.DEFINE_list("seeds", ["0", "1"], "seeds (train.seed = data.seed)")
flags.DEFINE_integer("steps", 600, "train.steps of the dense twin and the scratch run")
flags.DEFINE_integer("queries", 4, "val tokens whose attributions are compared")
flags.DEFINE_integer("top", 100, "top-m of the retention")
flags.DEFINE_integer("rank", 64, "rank of the attribution cache")
flags.DEFINE_integer("max_rows", 256, "training rows in the attribution comparison")
flags.DEFINE_list("runs", list(RUNS), "measure only these runs (their rows are kept in the "
                  "run directories; the table and --results_json need all four)")
flags.DEFINE_string("results_json", None, "write the rows here (experiments.reproduce reads it)")
flags.mark_flag_as_required("root")
FLAGS = flags.FLAGS

SHOWN = ("loss", "agreement", "agreement_decisive", "decisive_share", "proto_ce_ratio",
         "r1_bar", "r2_bar", "dead_prototypes")


def run_config(name: str, seed: int, root: str, steps: int):
  from prism_jax.config import preset  # pylint: disable=g-import-not-at-top
  from prism_jax.train import apply_overrides  # pylint: disable=g-import-not-at-top
  base = preset("tiny")
  sets = [f"train.seed={seed}", f"data.seed={seed}"]
  if name == "dense":
    sets += ["model.kind=dense", f"train.steps={steps}"]
  elif name == "scratch":
    sets += [f"train.steps={steps}"]
  else:
    sets += [f"train.steps={steps - base.train.proto_init_step}", "train.proto_init_step=0",
             f"train.init_from={os.path.join(root, f'dense_s{seed}')}"]
    if name == "frozen":
      sets.append("train.trainable=prototypes")
  return apply_overrides(base, sets)


def train_seconds(workdir: str, cfg) -> float:
  """Steady training seconds of the run's own steps (eval, saves, compiles left out)."""
  from prism_jax.train.metrics import read_metrics  # pylint: disable=g-import-not-at-top
  last = [r for r in read_metrics(workdir, "train") if "steady_tokens_per_s" in r][-1]
  tokens = cfg.train.steps * cfg.train.batch_size * cfg.data.seq_len
  return tokens / last["steady_tokens_per_s"]


def evaluate_run(workdir: str) -> dict:
  """The final checkpoint's metrics on the whole val split, with this code's evaluation."""
  from prism_jax import data as data_lib  # pylint: disable=g-import-not-at-top
  from prism_jax import sharding as shard_lib  # pylint: disable=g-import-not-at-top
  from prism_jax.train.validation import evaluate  # pylint: disable=g-import-not-at-top
  from prism_jax.loading import load_params  # pylint: disable=g-import-not-at-top
  from prism_jax.train.state import default_mesh  # pylint: disable=g-import-not-at-top
  graphdef, params, cfg, _ = load_params(workdir)
  packed = data_lib.prepare_data(cfg.data, cfg.model.vocab_size, workdir)
  mesh = default_mesh(cfg)
  index, count = shard_lib.process_batch_slice(mesh, cfg.train.batch_size)
  loader = data_lib.make_loader(packed, "val", cfg.train.batch_size, cfg.data.seed, index,
                                count)
  return evaluate(graphdef, params, cfg, loader, mesh=mesh, num_batches=0)


def retention(workdir: str, seed: int) -> float:
  """Mean top-m overlap of cached and full prototype-space attributions (see module doc)."""
  from prism_jax.attribution.caching import cache as cache_lib  # pylint: disable=g-import-not-at-top
  from prism_jax.attribution.scoring import influence, influence_full  # pylint: disable=g-import-not-at-top
  from prism_jax.data import prepare_data  # pylint: disable=g-import-not-at-top
  from prism_jax.loading import load_for_inference  # pylint: disable=g-import-not-at-top
  model, cfg, _ = load_for_inference(workdir)
  packed = prepare_data(cfg.data, cfg.model.vocab_size, workdir)
  cache = cache_lib.build_cache(model, cfg, packed, os.path.join(workdir, "retrofit_cache"),
                                cache_lib.CacheConfig(rank=FLAGS.rank, max_rows=FLAGS.max_rows),
                                progress=False)
  rng = np.random.default_rng(seed)
  rows, offs = packed.rows("val")["tokens"], packed.rows("val")["offset"]
  queries = []
  for r in rng.permutation(len(rows))[:FLAGS.queries]:
    pos = int(rng.choice(np.flatnonzero(offs[r, 1:] > 0) + 1))
    queries.append((np.asarray(rows[r, :pos + 1]), [pos]))
  icfg = influence.InfluenceConfig()
  atts = influence.attribute_batch(model, cache, queries, cfg=icfg)
  ids, scores = influence_full.full_scores(model, cache, packed, queries, cfg=icfg)
  return float(np.mean([influence.top_overlap(a.all_ids, a.all_scores, ids, scores[q],
                                              FLAGS.top) for q, a in enumerate(atts)]))


def measure_run(root: str, name: str, seed: int) -> dict:
  """One run's row (trained or resumed first); kept in <run>/retrofit_row.json, reused
  while the retention settings are the same."""
  from prism_jax.train import train  # pylint: disable=g-import-not-at-top
  from prism_jax.train.metrics import read_metrics  # pylint: disable=g-import-not-at-top
  cfg = run_config(name, seed, root, FLAGS.steps)
  workdir = os.path.join(root, f"{name}_s{seed}")
  saved = os.path.join(workdir, "retrofit_row.json")
  settings = {"queries": FLAGS.queries, "top": FLAGS.top, "rank": FLAGS.rank,
              "max_rows": FLAGS.max_rows}
  train(cfg, workdir)
  if os.path.exists(saved):
    with open(saved, encoding="utf-8") as f:
      row = json.load(f)
    if row.pop("settings", None) == settings:
      return row
  val = read_metrics(workdir, "val")[-1]
  if "agreement_decisive" not in val and name != "dense":  # a run of older code
    val = evaluate_run(workdir)
  row = {k: val.get(k) for k in SHOWN} | {"train_s": train_seconds(workdir, cfg),
                                          "steps": cfg.train.steps}
  if name != "dense":
    row["retention"] = retention(workdir, seed)
  provenance.write_json(saved, row | {"settings": settings})
  logging.info("seed %d %s: %s", seed, name, row)
  return row


def measure(root: str, seed: int, runs=RUNS) -> dict:
  out = {name: measure_run(root, name, seed) for name in runs}
  for row in out.values():
    if "dense" in out:
      row["vs_dense"] = row["loss"] / out["dense"]["loss"] - 1
  return out


def table(results: dict) -> str:
  head = ("| run | seed | val CE | vs dense | agreement | agreement, decisive (share) | "
          "proto CE ratio | R̄1 / R̄2 | dead | train s | retention top-" + str(FLAGS.top) + " |")
  lines = [head, "|" + "---|" * 11]
  for seed, runs in results.items():
    for name, r in runs.items():
      if name == "dense":
        lines.append(f"| dense twin | {seed} | {r['loss']:.4f} | – | – | – | – | – | – | "
                     f"{r['train_s']:.0f} | – |")
        continue
      lines.append(
          f"| {name} | {seed} | {r['loss']:.4f} | {100 * r['vs_dense']:+.1f}% | "
          f"{100 * r['agreement']:.1f}% | {100 * r['agreement_decisive']:.1f}% "
          f"({100 * r['decisive_share']:.1f}%) | {r['proto_ce_ratio']:.3f} | "
          f"{r['r1_bar']:.3f} / {r['r2_bar']:.3f} | {r['dead_prototypes']:.0f} | "
          f"{r['train_s']:.0f} | {100 * r['retention']:.1f}% |")
  return "\n".join(lines)


def rows(results: dict, command: str) -> list[dict]:
  """experiments.reproduce rows: one per PRISM variant, seeds side by side."""
  out = []
  for name, label in (("scratch", "from scratch"), ("frozen", "retrofit, backbone frozen"),
                      ("full", "retrofit, fully trained")):
    per = {seed: runs[name] for seed, runs in results.items()}
    out.append({
        "metric": f"tiny PRISM {label}: val CE vs dense, agreement all / decisive",
        "paper": "not reported",
        "ours": "; ".join(f"seed {seed}: {100 * r['vs_dense']:+.1f}%, "
                          f"{100 * r['agreement']:.1f}% / {100 * r['agreement_decisive']:.1f}%"
                          for seed, r in per.items()),
        "note": f"seeds {', '.join(map(str, results))}; equal bank training tokens; RESULTS "
                "'Retrofit' section", "command": command})
  return out


def check_flags() -> None:
  """Every flag combination, before any training (one `error:` line)."""
  check.not_empty(seeds=FLAGS.seeds, runs=FLAGS.runs)
  seeds = check.numbers("seeds", FLAGS.seeds, int, low=0)
  check.known("runs", FLAGS.runs, RUNS)
  if FLAGS.results_json and tuple(FLAGS.runs) != RUNS:
    raise ValueError(f"--results_json needs --runs={','.join(RUNS)} (all four, in this order)")
  check.output_file("results_json", FLAGS.results_json)
  check.at_least(1, queries=FLAGS.queries, top=FLAGS.top, rank=FLAGS.rank,
                 max_rows=FLAGS.max_rows)
  from prism_jax.config import preset  # pylint: disable=g-import-not-at-top
  init = preset("tiny").train.proto_init_step
  if FLAGS.steps <= init:
    raise ValueError(f"--steps={FLAGS.steps}: the retrofits train steps - {init} steps; "
                     f"give > {init}")
  for name in FLAGS.runs:
    for seed in seeds:
      run_config(name, seed, FLAGS.root, FLAGS.steps)
      # a retrofit starts from its seed's dense twin: trained by this run or an earlier one
      twin = os.path.join(FLAGS.root, f"dense_s{seed}")
      if name in ("frozen", "full") and "dense" not in FLAGS.runs and not os.path.isdir(twin):
        raise ValueError(f"--runs={','.join(FLAGS.runs)}: {name} starts from the dense twin "
                         f"{twin}, which is not there; add dense to --runs")


def main(argv):
  del argv
  check_flags()
  from prism_jax.train.metrics import quiet_library_logs  # pylint: disable=g-import-not-at-top
  quiet_library_logs()
  results = {int(s): measure(FLAGS.root, int(s), FLAGS.runs) for s in FLAGS.seeds}
  if tuple(FLAGS.runs) != RUNS:
    print(json.dumps(results, indent=1))
    return
  print(table(results))
  if FLAGS.results_json:
    rec = provenance.record("experiments.retrofit")
    command = rec["command"]
    provenance.write_results(FLAGS.results_json, {
        **rec, "results": {str(k): v for k, v in results.items()},
        "table": table(results), "rows": rows(results, command)})


if __name__ == "__main__":
  cli.run(main)
