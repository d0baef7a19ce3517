"""Every attribution method's cost beside its LDS (issue 55, item 4), one process a method.

  python -m experiments.lds_costs --lds_json=docs/results/lds_groups_k128.json \
      --out=/tmp/prism_costs [--methods=prism,ekfac,...] \
      [--results_json=docs/results/lds_costs_k128.json]

The model, rows and queries are those the `experiments.lds` run of --lds_json scored: its
recorded flags (--set, --num_rows, --queries, --targets, --seed, --rank) are read from the
JSON's argv; the LDS recipe with its --set overrides is retrained on the first --num_rows
rows with seed 0 (deterministic: the model the LDS run scored) and `retrain.sample_queries`
draws the same queries. The bench refuses to start when the recipe's config here differs
from the one the JSON records.

Each method runs in its own process (peak RSS = that process's ru_maxrss), through the
methods protocol (attribution/quality/methods.py) with its own `Builds` store:
  call 1   `methods.scores` on every query: what the method keeps is built (the prototype
           cache, EK-FAC's factors, cached EK-FAC's rows, TRAK's Φ: Builds records each
           build's seconds and bytes) and every query scored;
  call 2   the same call on the same store: the queries alone. Per-query seconds = its wall
           (and CPU) time / #queries, the fastest of --rounds.
A bare process (imports, model, data, queries; no method) gives the RSS floor. The streamed
methods (EK-FAC and its groups, whose build is their factors alone; gradient dot, with no
build) pass over every training row in each call; their per-query time is that pass / Q.

Prints one table (markdown) joining each method's LDS (the LDS JSON's rows: all queries, and
the held-out report half where recorded) with its costs; writes the results JSON.
"""

import json
import os
import resource
import shutil
import subprocess
import sys
import time

import numpy as np
from absl import flags
from absl import logging

from prism_jax.cli import flag_checks as check
from prism_jax.cli import launcher, provenance

flags.DEFINE_string("lds_json", None, "the experiments.lds results JSON whose methods, model "
                    "and queries are costed (its LDS rows go beside the costs)")
flags.DEFINE_string("out", "/tmp/prism_lds_costs", "scratch: each method's cache and "
                    "result JSON")
flags.DEFINE_list("methods", [], "methods to cost (default: every method with an LDS row in "
                  "the LDS JSON)")
# The LDS run's own flags, read from --lds_json's argv and handed to each method's process
# (defaults: experiments.lds's).
LDS_FLAGS = ("set", "num_rows", "queries", "targets", "seed", "rank")
flags.DEFINE_multi_string("set", [], "internal: the LDS run's config overrides")
flags.DEFINE_integer("num_rows", 2048, "internal: the LDS run's training rows")
flags.DEFINE_integer("queries", 64, "internal: the LDS run's query rows")
flags.DEFINE_integer("targets", 4, "internal: the LDS run's target tokens per query")
flags.DEFINE_integer("seed", 0, "internal: the LDS run's seed (queries, methods)")
flags.DEFINE_integer("rank", 32, "internal: the LDS run's cache projection rank")
flags.DEFINE_integer("rounds", 2, "scoring rounds after the build call (the fastest counts)")
flags.DEFINE_bool("reuse", False, "skip methods whose result JSON is already in --out")
flags.DEFINE_string("results_json", None, "also write the results here (reproduce.py)")
flags.DEFINE_string("method", None, "internal: cost one method in this process")
FLAGS = flags.FLAGS

BARE = "(bare process)"


def _setting():
  """(cfg, packed, queries, model) of the LDS run (the model retrained, seed 0)."""
  from experiments import lds_recipe  # pylint: disable=g-import-not-at-top  (absl flags first)
  from prism_jax.attribution.quality import retrain  # pylint: disable=g-import-not-at-top
  from prism_jax.data import prepare_data  # pylint: disable=g-import-not-at-top
  cfg = lds_recipe.config(FLAGS.set)
  packed = prepare_data(cfg.data, cfg.model.vocab_size, FLAGS.out)
  q_rows, queries = retrain.sample_queries(packed, FLAGS.queries, FLAGS.targets, FLAGS.seed)
  with open(FLAGS.lds_json) as f:
    recorded = json.load(f).get("queries")
  if recorded is not None and list(recorded) != q_rows:
    raise ValueError(f"--lds_json {FLAGS.lds_json}: its queries are val rows {recorded[:4]}..., "
                     f"drawn here {q_rows[:4]}...: not the LDS run's data")
  model, _ = retrain.retrain(cfg, packed, np.arange(FLAGS.num_rows), 0)
  return cfg, packed, queries, model


def _worker() -> None:
  """Costs FLAGS.method; writes <out>/costs/<method>.json."""
  import jax  # pylint: disable=g-import-not-at-top
  from prism_jax.attribution.quality import methods  # pylint: disable=g-import-not-at-top
  # Every process retrains the same model: the persistent cache compiles its programs once.
  jax.config.update("jax_compilation_cache_dir", os.path.join(FLAGS.out, "jax_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  cfg, packed, queries, model = _setting()
  res = {"method": FLAGS.method, "lds_json": os.path.abspath(FLAGS.lds_json)}
  if FLAGS.method != BARE:
    builds, scratch = methods.Builds(), os.path.join(FLAGS.out, "scratch", FLAGS.method)
    shutil.rmtree(scratch, ignore_errors=True)  # the cache is built here, not reused
    run = lambda: methods.scores(FLAGS.method, model, cfg, packed, queries, FLAGS.num_rows,
                                 scratch, rank=FLAGS.rank, seed=FLAGS.seed, builds=builds)
    c = time.process_time()
    _, first_s = run()
    res.update(first_call_s=first_s, first_call_cpu_s=time.process_time() - c,
               builds={w: {"seconds": builds.seconds[w], "bytes": builds.nbytes[w]}
                       for w in builds.seconds})
    walls, cpus = [], []
    for _ in range(FLAGS.rounds):
      c = time.process_time()
      walls.append(run()[1])
      cpus.append(time.process_time() - c)
    num_q = len(queries.tokens_QxL)
    res.update(per_query_s=min(walls) / num_q, per_query_cpu_s=min(cpus) / num_q,
               rounds_s=walls)
  res.update(peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
             num_rows=FLAGS.num_rows, num_queries=len(queries.tokens_QxL),
             training_tokens=int(np.count_nonzero(
                 packed.rows("train")["offset"][:FLAGS.num_rows, 1:] > 0)))
  provenance.write_json(_result_path(FLAGS.method), res)


def _result_path(method: str) -> str:
  return os.path.join(FLAGS.out, "costs", f"{method}.json")


def _lds_args(lds: dict) -> list[str]:
  """The LDS run's LDS_FLAGS as it passed them (its recorded argv, every flag written
  --name=value, as provenance records a launcher's argv)."""
  args = [a for a in lds["argv"] if a.split("=", 1)[0].lstrip("-") in LDS_FLAGS]
  bare = [a for a in args if "=" not in a]
  if bare:
    raise ValueError(f"--lds_json {FLAGS.lds_json}: flag {bare[0]} recorded without "
                     "'=value': pass the LDS run's flags as --name=value")
  return args


def _reusable(path: str) -> bool:
  """--reuse: a method's result of this same LDS run (another run's is measured again)."""
  if not (FLAGS.reuse and os.path.exists(path)):
    return False
  with open(path) as f:
    return json.load(f).get("lds_json") == os.path.abspath(FLAGS.lds_json)


def _run(method: str, lds_args: list[str]) -> dict:
  path = _result_path(method)
  if not _reusable(path):
    args = [sys.executable, "-m", "experiments.lds_costs", f"--method={method}",
            f"--out={FLAGS.out}", f"--rounds={FLAGS.rounds}", f"--lds_json={FLAGS.lds_json}",
            *lds_args]
    t = time.time()
    subprocess.run(args, check=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    logging.info("%s costed in %.0f s", method, time.time() - t)
  with open(path) as f:
    return json.load(f)


def _lds_of(lds: dict) -> dict[str, dict]:
  """method -> {"all": (mean, ci), "report": (mean, ci)} from the LDS JSON's rows."""
  out: dict[str, dict] = {}
  for row in lds["rows"]:
    metric = row["metric"]
    for prefix, part in (("LDS (", "all"), ("LDS report half (", "report")):
      if metric.startswith(prefix) and metric.endswith(")"):
        name = metric[len(prefix):-1].removesuffix(" (chosen)")
        out.setdefault(name, {})[part] = (row["ours"], row.get("ci"))
  return out


def _check_config(lds: dict, sets: list[str]) -> None:
  """One line when the recipe here is not the one the LDS run trained."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from experiments import lds_recipe  # pylint: disable=g-import-not-at-top
  here = json.loads(json.dumps(dataclasses.asdict(lds_recipe.config(sets)), default=list))
  for section, values in lds["config"].items():
    for key, value in values.items():
      if here.get(section, {}).get(key, value) != value and section != "mesh":
        raise ValueError(f"--lds_json {FLAGS.lds_json}: its run trained {section}.{key}="
                         f"{value!r}, this recipe has {here[section][key]!r} (pass its --set)")


def _table(scores: dict[str, dict], costs: dict[str, dict]) -> list[str]:
  """The cost table's lines: each costed method's LDS (`scores`: _lds_of) and costs."""
  floor = costs[BARE]["peak_rss_bytes"] / 2 ** 20
  ek = costs.get("ekfac", {}).get("per_query_s")
  fmt_lds = lambda v: f"{v[0]:.3f} [{v[1][0]:.3f}, {v[1][1]:.3f}]" if v else "–"
  lines = ["| method | LDS (all queries) | LDS (report half) | scoring s / query | "
           "CPU s / query | × EK-FAC's speed | build s | cache bytes / training token | "
           "peak RSS MiB (floor " + f"{floor:.0f})" + " |", "|---|---|---|---|---|---|---|---|---|"]
  for name, c in costs.items():
    if name == BARE:
      continue
    per_tok = sum(b["bytes"] for b in c["builds"].values()) / c["training_tokens"]
    build = sum(b["seconds"] for b in c["builds"].values())
    speed = f"{ek / c['per_query_s']:.1f}×" if ek and c["per_query_s"] > 0 else "–"
    lds_m = scores.get(name, {})
    lines.append(f"| {name} | {fmt_lds(lds_m.get('all'))} | {fmt_lds(lds_m.get('report'))} | "
                 f"{c['per_query_s']:.4g} | {c['per_query_cpu_s']:.4g} | {speed} | "
                 f"{build:.1f} | {per_tok:.0f} | {c['peak_rss_bytes'] / 2 ** 20:.0f} |")
  return lines


def check_flags() -> None:
  """Every flag before any process starts (one `error:` line)."""
  check.at_least(1, num_rows=FLAGS.num_rows, queries=FLAGS.queries, targets=FLAGS.targets,
                 rank=FLAGS.rank, rounds=FLAGS.rounds)
  if FLAGS.method is None and not FLAGS.lds_json:
    raise ValueError("--lds_json is required: the LDS run whose methods are costed")


def main(argv):
  del argv
  check_flags()
  if FLAGS.method:
    return _worker()
  record = provenance.record("experiments.lds_costs")  # the commit the methods ran at
  with open(FLAGS.lds_json) as f:
    lds = json.load(f)
  from prism_jax.attribution.quality import methods  # pylint: disable=g-import-not-at-top
  scores, lds_args = _lds_of(lds), _lds_args(lds)
  names = FLAGS.methods or [m for m in scores if m in methods.REGISTRY]
  check.known("methods", names, methods.REGISTRY)
  _check_config(lds, [a.split("=", 1)[1] for a in lds_args if a.startswith("--set=")])
  # The bare process last: the first process compiles the retrain for the others (the
  # persistent cache), which would lift its RSS above the floor.
  costs = {name: _run(name, lds_args) for name in [*names, BARE]}
  bare = costs[BARE]
  lines = [f"costs of the methods of {FLAGS.lds_json} (LDS from there; {bare['num_queries']} "
           f"queries, {bare['num_rows']} training rows, {bare['training_tokens']} training "
           "tokens; each method in its own process, CPU)", ""] + _table(scores, costs)
  table = "\n".join(lines)
  print(table)
  if FLAGS.results_json:
    provenance.write_results(FLAGS.results_json, {**record, "costs": costs, "table": table,
                                                  "lds_json": FLAGS.lds_json,
                                                  "lds": scores})


if __name__ == "__main__":
  launcher.run(main)
