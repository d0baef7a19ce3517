"""The prototype path against backbone size: PRISM from scratch beside its dense twin at
equal tokens (issue 44, item 3).

  nice python -m experiments.size_trend --root=/tmp/cap --backbones=128x4,256x6,384x8 \
      --setting=2048:4 --results_json=docs/results/size_trend.json \
      --plot=docs/results/size_trend.png

Per backbone (d_model x n_layers; experiments.bank_capacity's corpus, tokenizer, recipe and
run layout, so its dense twins are shared): the dense twin and today's PRISM recipe from
scratch (dense warm-up to proto_init_step, then the bank of --setting), both train.steps
steps on the same batches. Measured on one val half (prism_jax/data/val_halves.py; choose by
default, since the trend informs the preset's choice): the full-CE gap to the dense twin,
agreement of argmax W z_hat with argmax W z (all, decisive), CE(W z_hat)/CE(W z), R̄1/R̄2.

The plot draws agreement and the CE gap against backbone parameters; where the targets
(agreement ≥ 90%, decisive ≥ 97%, CE gap ≤ 2%) are not reached, a least-squares line in
log10(parameters) through the measured points says at what size it would cross them (an
extrapolation from few points, stated as such).
"""

import os

import numpy as np
from absl import flags, logging

from experiments import bank_capacity as cap
from prism_jax.cli import launcher as cli
from prism_jax.cli import provenance
from results_md.prototype_path import TARGETS
from results_md.prototype_path import size_markdown as markdown

flags.DEFINE_string("setting", "2048:4", "the bank K:k[:overrides] of every PRISM run")
FLAGS = flags.FLAGS

def scratch_config(backbone: str, seed: int, root: str, steps: int, setting: str):
  from prism_jax.config import preset  # pylint: disable=g-import-not-at-top
  from prism_jax.train import apply_overrides  # pylint: disable=g-import-not-at-top
  big_k, k, extra = cap.parse_setting(setting)
  return apply_overrides(preset("tiny"), cap.base_sets(backbone, seed, root) + [
      *cap.ISSUE44_RECIPE, f"model.num_prototypes={big_k}", f"model.k={k}", *extra,
      f"train.steps={steps}"])


def backbone_params(cfg) -> int:
  """The dense twin's parameters (prism_jax.flops' analytic count)."""
  from prism_jax import flops  # pylint: disable=g-import-not-at-top
  return int(flops.param_counts(cfg.model)["dense"])


def fit_crossing(xs, ys, target: float, higher_is_better: bool = True) -> float | None:
  """log10(params) at which the least-squares line of ys on log10(xs) reaches target; None
  with fewer than 2 finite points or a line that moves away from the target."""
  pts = [(x, y) for x, y in zip(xs, ys) if np.isfinite(y)]
  if len(pts) < 2:
    return None
  slope, icept = np.polyfit(np.log10([p[0] for p in pts]), [p[1] for p in pts], 1)
  if (slope <= 0) if higher_is_better else (slope >= 0):
    return None
  return float((target - icept) / slope)


def plot(rows: list[dict], path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  xs = [r["backbone_params"] for r in rows]
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
  ax = axes[0]
  for key, label in (("agreement", "all tokens"), ("agreement_decisive", "decisive tokens")):
    ax.plot(xs, [100 * r[key] for r in rows], marker="o", label=label)
    ax.axhline(100 * TARGETS[key], linestyle=":", color="gray")
  ax.set_ylabel("agreement argmax W ẑ = argmax W z (%)")
  ax.set_title("PRISM from scratch: agreement")
  ax = axes[1]
  ax.plot(xs, [100 * r["ce_gap"] for r in rows], marker="o", color="C3")
  ax.axhline(100 * TARGETS["ce_gap"], linestyle=":", color="gray", label="target 2%")
  ax.set_ylabel("val CE vs dense twin, equal tokens (%)")
  ax.set_title("full-CE gap to the dense twin")
  for ax in axes:
    ax.set_xscale("log")
    ax.set_xlabel("backbone parameters")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    for r in rows:
      ax.annotate(r["backbone"], (r["backbone_params"], ax.get_ylim()[0]), fontsize=7,
                  xytext=(0, 3), textcoords="offset points", ha="center")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv):
  del argv
  cap.check_flags()
  cap.parse_setting(FLAGS.setting, "setting")
  cap.check_configs(lambda backbone, seed: scratch_config(backbone, seed, FLAGS.root,
                                                          FLAGS.steps, FLAGS.setting))
  from prism_jax.train.metrics import quiet_library_logs  # pylint: disable=g-import-not-at-top
  quiet_library_logs()
  rows = []
  seed = int(FLAGS.seeds[0])
  for backbone in FLAGS.backbones:
    twin_cfg = cap.twin_config(backbone, seed, FLAGS.root, FLAGS.steps)
    dense = cap.measure_run(os.path.join(FLAGS.root, backbone, f"dense_s{seed}"), twin_cfg,
                            FLAGS.half)
    name = "scratch_" + cap.setting_name(*cap.parse_setting(FLAGS.setting)) + f"_s{seed}"
    cfg = scratch_config(backbone, seed, FLAGS.root, FLAGS.steps, FLAGS.setting)
    row = dict(cap.measure_run(os.path.join(FLAGS.root, backbone, name), cfg, FLAGS.half))
    row.update(backbone=backbone, backbone_params=backbone_params(cfg),
               dense_loss=dense["loss"], ce_gap=row["loss"] / dense["loss"] - 1)
    logging.info("%s: %s", backbone, row)
    rows.append(row)
  rows.sort(key=lambda r: r["backbone_params"])
  xs = [r["backbone_params"] for r in rows]
  crossings = {key: fit_crossing(xs, [r[key] for r in rows], t, key != "ce_gap")
               for key, t in TARGETS.items()}
  if FLAGS.plot:
    plot(rows, FLAGS.plot)
  data = {**provenance.record("experiments.size_trend"), "setting": FLAGS.setting,
          "steps": FLAGS.steps, "half": FLAGS.half, "rows": rows, "crossings": crossings,
          "plot": FLAGS.plot}
  print(markdown(data))
  if FLAGS.results_json:
    provenance.write_results(FLAGS.results_json, data)


if __name__ == "__main__":
  cli.run(main)
