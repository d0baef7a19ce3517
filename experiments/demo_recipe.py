"""Which recipe should the demo and the tiny preset train? Candidates side by side (issue 53,
item 1), each beside the dense twin at equal tokens.

  nice python -m experiments.demo_recipe --root=/tmp/demo_recipe --seeds=0 --half=choose \
      --candidate="e2e_K2048:model.num_prototypes=2048,model.mixture=normalized" \
      --candidate="retrofit_K8192_nnls:model.num_prototypes=8192,model.mixture=nnls,\
train.trainable=prototypes,train.proto_init_step=580" \
      --results_json=docs/results/demo_recipe_choose.json

A candidate is NAME:OVERRIDES, the overrides (comma-separated KEY=VALUE) applied to the tiny
preset of this commit; every run trains from scratch on the tiny corpus with train.seed =
data.seed = the seed, into <root>/<NAME>_s<seed> (a finished run is reused, its timing kept
beside it). The dense twin trains the same steps on the same batches (bank_capacity's
twin). Per candidate and seed, measured on one half of the val documents
(prism_jax/data/val_halves.py; --half=choose to choose, --half=test once for the choice):
the full val CE against the twin's, agreement of argmax W z_hat with argmax W z (all,
decisive), CE(W z_hat)/CE(W z), R̄1/R̄2, carriers of 90% of the prototype logit, and the
training's wall and CPU seconds on this machine (CPU seconds: less sensitive to other load).
--backbone_sets changes the backbone of twin and candidates alike (issue 54: the demo's
recipe on a Llama-family backbone of the same size).
"""

import json
import os
import time

from absl import flags, logging

from experiments import bank_capacity as cap
from results_md.prototype_path import demo_recipe_markdown
from prism_jax.cli import launcher as cli
from prism_jax.cli import provenance

flags.DEFINE_multi_string("candidate", [], "NAME:KEY=VALUE,KEY=VALUE on the tiny preset")
flags.DEFINE_list("backbone_sets", [], "KEY=VALUE overrides of the backbone for the twin "
                  "and every candidate alike (e.g. the Llama family: model.arch=llama,"
                  "model.bias=false,model.n_kv_heads=2); use a --root of its own")
FLAGS = flags.FLAGS
TIMING_FILE = "demo_recipe_timing.json"


def parse_candidate(text: str) -> tuple[str, list[str]]:
  name, sep, sets = text.partition(":")
  if not sep or not name or not name.replace("_", "").isalnum():
    raise ValueError(f"--candidate={text!r}: give NAME:KEY=VALUE,... (NAME of letters, "
                     "digits and _)")
  overrides = [s for s in sets.split(",") if s]
  bad = [s for s in overrides if "=" not in s]
  if bad:
    raise ValueError(f"--candidate={text!r}: {bad[0]!r} is not KEY=VALUE")
  return name, overrides


def candidate_config(overrides: list[str], seed: int, root: str):
  from prism_jax.config import preset  # pylint: disable=g-import-not-at-top
  from prism_jax.train import apply_overrides  # pylint: disable=g-import-not-at-top
  return apply_overrides(preset("tiny"), cap.base_sets(FLAGS.backbones[0], seed, root)
                         + [f"train.steps={FLAGS.steps}", *FLAGS.backbone_sets, *overrides])


def timed_train(cfg, workdir: str) -> dict:
  """Train (or reuse) the run; its first training's wall and CPU seconds, kept beside it."""
  from prism_jax.train import train  # pylint: disable=g-import-not-at-top
  saved = os.path.join(workdir, TIMING_FILE)
  if os.path.exists(saved):
    with open(saved, encoding="utf-8") as f:
      return json.load(f)
  wall, cpu = time.perf_counter(), time.process_time()
  result = train(cfg, workdir)
  timing = {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
            "resumed": result.start_step != 0}
  provenance.write_json(saved, timing)
  return timing


def main(argv):
  del argv
  cap.check_flags()
  candidates = [parse_candidate(c) for c in FLAGS.candidate]
  if not candidates:
    raise ValueError("give at least one --candidate=NAME:OVERRIDES")
  seeds = [int(s) for s in FLAGS.seeds]
  for _, sets in candidates:  # a bad override fails here, before any training
    for seed in seeds:
      candidate_config(sets, seed, FLAGS.root)
  from prism_jax.train.metrics import quiet_library_logs  # pylint: disable=g-import-not-at-top
  quiet_library_logs()
  backbone = FLAGS.backbones[0]
  twins, rows = {}, {}
  for seed in seeds:
    twin_dir = os.path.join(FLAGS.root, backbone, f"dense_s{seed}")
    twin_cfg = cap.twin_config(backbone, seed, FLAGS.root, FLAGS.steps)
    if FLAGS.backbone_sets:
      from prism_jax.train import apply_overrides  # pylint: disable=g-import-not-at-top
      twin_cfg = apply_overrides(twin_cfg, FLAGS.backbone_sets)
    timing = timed_train(twin_cfg, twin_dir)
    twins[seed] = {**cap.measure_run(twin_dir, twin_cfg, FLAGS.half), **timing}
  for name, sets in candidates:
    rows[name] = {"overrides": sets, "seeds": {}}
    for seed in seeds:
      workdir = os.path.join(FLAGS.root, backbone, f"{name}_s{seed}")
      cfg = candidate_config(sets, seed, FLAGS.root)
      timing = timed_train(cfg, workdir)
      row = {**cap.measure_run(workdir, cfg, FLAGS.half), **timing}
      row.update(dense_loss=twins[seed]["loss"], ce_gap=row["loss"] / twins[seed]["loss"] - 1)
      rows[name]["seeds"][seed] = row
      logging.info("%s seed %d: %s", name, seed, row)
  data = {**provenance.record("experiments.demo_recipe"), "backbone": backbone,
          "half": FLAGS.half, "half_seed": FLAGS.half_seed, "steps": FLAGS.steps,
          "backbone_sets": FLAGS.backbone_sets,
          "twins": twins, "rows": rows}
  print(demo_recipe_markdown(data))
  if FLAGS.results_json:
    provenance.write_results(FLAGS.results_json, data)


if __name__ == "__main__":
  cli.run(main)
