"""Today's tiny default against the setting chosen on the choose half, measured once on the
test half: from scratch, beside the dense twin, two seeds each (issue 44, items 1 and 5).

  nice python -m experiments.default_choice --root=/tmp/cap --old=512:8 --new=2048:4 \
      --seeds=0,1 --results_json=docs/results/prototype_defaults.json

Per seed: the dense twin and the tiny recipe from scratch with each bank setting
(experiments.size_trend's runs: same corpus, tokenizer, recipe and run layout, so finished
runs are reused), on the d_model x n_layers of --backbones' first entry. Measured on the
**test** half of the val documents (prism_jax/data/val_halves.py), which no choice read:
the full-CE gap to the dense twin, agreement (all, decisive), CE(W z_hat)/CE(W z),
R̄1/R̄2, and the steady seconds per training step (the demo's training-time cost).
"""

import os

import numpy as np
from absl import flags, logging

from experiments import bank_capacity as cap
from experiments import size_trend
from results_md.prototype_path import defaults_markdown
from prism_jax.cli import launcher as cli
from prism_jax.cli import provenance

flags.DEFINE_string("old", "512:8", "today's default bank K:k[:overrides]")
flags.DEFINE_string("new", "2048:4", "the setting chosen on the choose half")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  cap.check_flags()
  for name in ("old", "new"):
    cap.parse_setting(FLAGS[name].value, name)
  cap.check_configs(lambda backbone, seed: [
      size_trend.scratch_config(backbone, seed, FLAGS.root, FLAGS.steps, s)
      for s in (FLAGS.old, FLAGS.new)])
  if FLAGS.half != "test":
    logging.warning("--half=%s: this comparison is meant for the test half", FLAGS.half)
  from prism_jax.train.metrics import quiet_library_logs  # pylint: disable=g-import-not-at-top
  quiet_library_logs()
  backbone = FLAGS.backbones[0]
  rows = {}
  for label, setting in (("old", FLAGS.old), ("new", FLAGS.new)):
    rows[label] = {}
    for s in FLAGS.seeds:
      seed = int(s)
      twin = cap.measure_run(os.path.join(FLAGS.root, backbone, f"dense_s{seed}"),
                             cap.twin_config(backbone, seed, FLAGS.root, FLAGS.steps),
                             FLAGS.half)
      name = "scratch_" + cap.setting_name(*cap.parse_setting(setting)) + f"_s{seed}"
      cfg = size_trend.scratch_config(backbone, seed, FLAGS.root, FLAGS.steps, setting)
      row = dict(cap.measure_run(os.path.join(FLAGS.root, backbone, name), cfg, FLAGS.half))
      row.update(dense_loss=twin["loss"], ce_gap=row["loss"] / twin["loss"] - 1,
                 dense_step_s=twin["step_s"])
      rows[label][s] = row
      logging.info("%s %s seed %s: %s", label, setting, s, row)
  time_ratio = (np.mean([r["step_s"] for r in rows["new"].values()])
                / np.mean([r["step_s"] for r in rows["old"].values()]))
  data = {**provenance.record("experiments.default_choice"), "backbone": backbone,
          "half": FLAGS.half, "settings": {"old": FLAGS.old, "new": FLAGS.new},
          "steps": FLAGS.steps, "rows": rows, "step_time_ratio": float(time_ratio)}
  print(defaults_markdown(data))
  if FLAGS.results_json:
    provenance.write_results(FLAGS.results_json, data)


if __name__ == "__main__":
  cli.run(main)
