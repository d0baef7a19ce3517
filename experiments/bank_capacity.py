"""How far can the prototype path carry the prediction? Bank capacity on a frozen backbone
(issue 44, items 1-2).

  nice python -m experiments.bank_capacity --root=/tmp/cap --backbones=128x4,256x6 \
      --grid=512:8,2048:8,8192:8,16384:8,512:32 --results_json=docs/results/bank_capacity.json \
      --plot=docs/results/bank_capacity.png

Per backbone (d_model x n_layers on the tiny preset's corpus, tokenizer and recipe; heads of
32 dimensions): its dense twin trains train.steps (600) steps; then, per grid setting
`K:k[:key=value...]` (a model.* or loss.* override, e.g. `2048:16:model.mixture=raw`), the
bank alone trains on the frozen twin (`train.init_from` + `train.trainable=prototypes`, the
bank set from the twin's hidden states at step 0, steps - proto_init_step = 550 steps: the
bank sees the tokens a from-scratch bank sees). The full logits stay W z of the twin to the
bit, so the full CE is the twin's by construction: only the prototype path's figures move.

Every figure is measured on one half of the val documents (prism_jax/data/val_halves.py):
--half=choose (the default) for the sweep, where settings are chosen; --half=test once, for
the chosen settings and today's defaults. Per setting: agreement of argmax W z_hat with
argmax W z (all tokens, decisive ones, the decisive share), CE(W z_hat)/CE(W z), R̄1/R̄2,
dead prototypes, residual share, bank parameters K·D, the steady step time, and the median
and 90th percentile over tokens of how many prototypes carry 90% of the prediction's
prototype logit (prism_jax/model/trust.py: carriers_N). Runs already trained under --root
are reused (train() resumes a cut one); each run's measurement is kept beside it.
"""

import json
import os

import numpy as np
from absl import flags, logging

from prism_jax.cli import flag_checks as check
from prism_jax.cli import launcher as cli
from prism_jax.cli import provenance
from results_md.prototype_path import capacity_markdown as markdown
from results_md.prototype_path import parse_setting
from experiments.prototype_measure import measure_half, step_seconds

flags.DEFINE_string("root", None, "directory of the runs (reused when finished)")
flags.DEFINE_list("backbones", ["128x4"], "d_model x n_layers of each frozen dense twin")
flags.DEFINE_list("grid", ["512:8"], "settings K:k[:model.X=v|loss.X=v ...]")
flags.DEFINE_list("seeds", ["0"], "seeds (train.seed = data.seed) of twin and bank")
flags.DEFINE_integer("steps", 600, "train.steps of the dense twin (the bank: minus the "
                     "preset's proto_init_step)")
flags.DEFINE_enum("half", "choose", ["choose", "test"], "the val half measured on: choose "
                  "for the sweep, test once for the chosen settings")
flags.DEFINE_integer("half_seed", 0, "seed of the val halves")
flags.DEFINE_string("results_json", None, "write the rows here (experiments.reproduce)")
flags.DEFINE_string("plot", None, "PNG of agreement against K per k and backbone")
flags.mark_flag_as_required("root")
FLAGS = flags.FLAGS

HEAD_DIM = 32
SHOWN = ("agreement", "agreement_decisive", "decisive_share", "proto_ce_ratio", "r1_bar",
         "r2_bar", "dead_prototypes", "residual_share", "loss")


def parse_backbone(text: str) -> tuple[int, int]:
  try:
    d, layers = (int(x) for x in text.lower().split("x"))
  except ValueError:
    raise ValueError(f"--backbone={text!r}: write d_model x n_layers, e.g. 256x6") from None
  if d % HEAD_DIM or d <= 0 or layers <= 0:
    raise ValueError(f"--backbone={text!r}: d_model must be a positive multiple of {HEAD_DIM}")
  return d, layers


def setting_name(big_k: int, k: int, extra: tuple[str, ...]) -> str:
  return "_".join([f"K{big_k}", f"k{k}"] + [e.split(".", 1)[1].replace("=", "-") for e in extra])


def base_sets(backbone: str, seed: int, root: str) -> list[str]:
  d, layers = parse_backbone(backbone)
  return [f"model.d_model={d}", f"model.n_layers={layers}", f"model.n_heads={d // HEAD_DIM}",
          f"train.seed={seed}", f"data.seed={seed}",
          f"data.packed_dir={os.path.join(root, backbone, 'data')}"]


def twin_config(backbone: str, seed: int, root: str, steps: int):
  from prism_jax.config import preset  # pylint: disable=g-import-not-at-top
  from prism_jax.train import apply_overrides  # pylint: disable=g-import-not-at-top
  # The twin has no bank: its bank fields and the bank's schedule are pinned so that its
  # config (and a finished twin's resume check) does not move when the tiny preset's do.
  return apply_overrides(preset("tiny"), base_sets(backbone, seed, root)
                         + ["model.kind=dense", f"train.steps={steps}", *TWIN_PINS])


ISSUE44_BANK_AT = 50  # the tiny preset's proto_init_step when issue 44 measured
# issue 44's tiny recipe (joint training after a 50-step dense warm-up, convex mixture,
# k-means++ init), pinned where its runs are reused, whatever the tiny preset becomes
ISSUE44_RECIPE = ("model.mixture=normalized", "model.proto_init_pick=kmeans++",
                  "train.trainable=all", f"train.proto_init_step={ISSUE44_BANK_AT}",
                  "train.eval_at_start=true")
TWIN_PINS = ("model.num_prototypes=512", "model.k=8", *ISSUE44_RECIPE)


def bank_config(backbone: str, seed: int, root: str, steps: int, setting: str):
  from prism_jax.config import preset  # pylint: disable=g-import-not-at-top
  from prism_jax.train import apply_overrides  # pylint: disable=g-import-not-at-top
  big_k, k, extra = parse_setting(setting)
  # issue 44's bank: convex mixture, k-means++ init, the steps a bank set at step 50 sees
  # (pinned, so finished runs stay reusable if the tiny preset moves); a setting's extras
  # override them
  return apply_overrides(preset("tiny"), base_sets(backbone, seed, root) + [
      "model.mixture=normalized", "model.proto_init_pick=kmeans++",
      f"model.num_prototypes={big_k}", f"model.k={k}", *extra,
      f"train.steps={steps - ISSUE44_BANK_AT}", "train.proto_init_step=0",
      "train.trainable=prototypes", "train.eval_at_start=false",
      f"train.eval_every={steps}",
      f"train.init_from={os.path.join(root, backbone, f'dense_s{seed}')}"])


def measure_run(workdir: str, cfg, half: str) -> dict:
  """Train (or reuse) the run, then its row on the half; kept in <run>/capacity_<half>.json."""
  from prism_jax.train import train  # pylint: disable=g-import-not-at-top
  saved = os.path.join(workdir, f"capacity_{half}_h{FLAGS.half_seed}.json")
  train(cfg, workdir)
  if os.path.exists(saved):
    with open(saved, encoding="utf-8") as f:
      return json.load(f)
  row = measure_half(workdir, half, FLAGS.half_seed)
  row = {k: row[k] for k in list(SHOWN) + ["tokens", "carriers90_median", "carriers90_p90",
                                           "documents"] if k in row}
  row["step_s"] = step_seconds(workdir, cfg)
  if cfg.model.kind == "prism":
    row["bank_params"] = cfg.model.num_prototypes * cfg.model.d_model
  provenance.write_json(saved, row)
  return row


def table(results: dict) -> str:
  lines = ["| backbone | setting | seed | agreement | decisive (share) | proto CE ratio | "
           "R̄1 / R̄2 | dead | residual share | carriers 90% (median / p90) | bank params | "
           "step s |", "|" + "---|" * 12]
  for backbone, per_setting in results.items():
    for setting, per_seed in per_setting.items():
      for seed, r in per_seed.items():
        lines.append(
            f"| {backbone} | {setting} | {seed} | {100 * r['agreement']:.1f}% | "
            f"{100 * r['agreement_decisive']:.1f}% ({100 * r['decisive_share']:.1f}%) | "
            f"{r['proto_ce_ratio']:.3f} | {r['r1_bar']:.3f} / {r['r2_bar']:.3f} | "
            f"{r['dead_prototypes']:.0f} | {r['residual_share']:.3f} | "
            f"{r['carriers90_median']:.0f} / {r['carriers90_p90']:.0f} | "
            f"{r['bank_params']:,} | {r['step_s']:.3f} |")
  return "\n".join(lines)


def plot(results: dict, path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
  for (key, title), ax in zip((("agreement", "all tokens"),
                               ("agreement_decisive", "decisive tokens")), axes):
    for backbone, per_setting in results.items():
      by_k: dict = {}
      for setting, per_seed in per_setting.items():
        big_k, k, extra = parse_setting(setting)
        if not extra:
          by_k.setdefault(k, []).append((big_k, np.mean([r[key] for r in per_seed.values()])))
      for k, pts in sorted(by_k.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o",
                linestyle="-" if backbone == next(iter(results)) else "--",
                label=f"{backbone}, k={k}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prototypes K")
    ax.set_ylabel("agreement argmax W ẑ = argmax W z (%)")
    ax.set_title(f"frozen backbone, {title}")
    ax.grid(alpha=0.3)
  axes[1].legend(fontsize=7, ncol=2)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def check_flags() -> None:
  """Every flag combination checked before any work (one `error:` line); shared by
  size_trend and default_choice, which build their own PRISM configs (check_configs)."""
  for b in FLAGS.backbones:
    parse_backbone(b)
  for s in FLAGS.grid:
    parse_setting(s)
  if FLAGS.steps <= 50:
    raise ValueError(f"--steps={FLAGS.steps}: the bank trains steps - 50 steps; give > 50")
  if not FLAGS.seeds or not FLAGS.backbones:
    raise ValueError("--seeds and --backbones must not be empty")
  check.numbers("seeds", FLAGS.seeds, int, low=0)
  if FLAGS.plot and not FLAGS.plot.endswith(".png"):
    raise ValueError(f"--plot={FLAGS.plot!r}: give a .png path")
  check.output_file("plot", FLAGS.plot)
  check.output_file("results_json", FLAGS.results_json)


def check_configs(config_of) -> None:
  """`config_of(backbone, seed)` built for every run before the first one trains: an
  override the config refuses fails here, not after the dense twins trained."""
  for backbone in FLAGS.backbones:
    for s in FLAGS.seeds:
      twin_config(backbone, int(s), FLAGS.root, FLAGS.steps)
      config_of(backbone, int(s))


def main(argv):
  del argv
  check_flags()
  check_configs(lambda backbone, seed: [bank_config(backbone, seed, FLAGS.root, FLAGS.steps, s)
                                        for s in FLAGS.grid])
  from prism_jax.train.metrics import quiet_library_logs  # pylint: disable=g-import-not-at-top
  quiet_library_logs()
  results: dict = {}
  twins: dict = {}
  for backbone in FLAGS.backbones:
    twins[backbone] = {}
    for s in FLAGS.seeds:
      workdir = os.path.join(FLAGS.root, backbone, f"dense_s{s}")
      twins[backbone][s] = measure_run(workdir, twin_config(backbone, int(s), FLAGS.root,
                                                            FLAGS.steps), FLAGS.half)
    results[backbone] = {}
    for setting in FLAGS.grid:
      per_seed = {}
      for s in FLAGS.seeds:
        cfg = bank_config(backbone, int(s), FLAGS.root, FLAGS.steps, setting)
        workdir = os.path.join(FLAGS.root, backbone,
                               setting_name(*parse_setting(setting)) + f"_s{s}")
        per_seed[s] = measure_run(workdir, cfg, FLAGS.half)
        logging.info("%s %s seed %s: %s", backbone, setting, s, per_seed[s])
      results[backbone][setting] = per_seed
  print(table(results))
  if FLAGS.plot:
    plot(results, FLAGS.plot)
  if FLAGS.results_json:
    rec = provenance.record("experiments.bank_capacity")
    data = {**rec, "half": FLAGS.half, "half_seed": FLAGS.half_seed, "twins": twins,
            "results": results, "table": table(results), "plot": FLAGS.plot}
    provenance.write_results(FLAGS.results_json, data)
    print(markdown(data))


if __name__ == "__main__":
  cli.run(main)
