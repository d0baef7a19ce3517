"""PRISM design ablation vs the dense twin at equal tokens (tiny preset, embedded corpus).

  python -m experiments.ablate --workdir=/tmp/prism_ablate --steps=200 \
      [--variants=dense,prism,normalized,plain,lam0.01,lam0.2] [--out=docs/results/x.md]

Every variant trains the same preset for the same steps x batch x seq_len tokens with the
same seed and data (prism_jax.train.train), then is evaluated on the val split: loss (CE),
R̄1, R̄2, residual share, dead prototypes, and the run's median tokens/s. Runs are
sequential; a finished variant's result is cached in <workdir>/<variant>/ablation.json, so
re-running only trains what is missing. Prints a markdown table (and writes it to --out).
"""

import json
import os
import sys

from absl import flags

from experiments import cli

# name -> --set overrides on top of the preset (PRISM defaults: raw mixture, straight-
# through residual, λ_rec = λ_1 = λ_2 = 0.05).
VARIANTS: dict[str, tuple[str, ...]] = {
    "dense": ("model.kind=dense",),
    "prism": (),
    "normalized": ("model.mixture=normalized",),
    "plain": ("model.residual_routing=plain",),
    "lam0.01": ("loss.lambda_rec=0.01", "loss.lambda_r1=0.01", "loss.lambda_r2=0.01"),
    "lam0.2": ("loss.lambda_rec=0.2", "loss.lambda_r1=0.2", "loss.lambda_r2=0.2"),
    "normalized_lam0.2": ("model.mixture=normalized", "loss.lambda_rec=0.2",
                          "loss.lambda_r1=0.2", "loss.lambda_r2=0.2"),
    # Clustering only (R1, R2) raised: the grounding terms, REC left at its default.
    "normalized_r0.5": ("model.mixture=normalized", "loss.lambda_r1=0.5",
                        "loss.lambda_r2=0.5"),
    "normalized_r1.0": ("model.mixture=normalized", "loss.lambda_r1=1.0",
                        "loss.lambda_r2=1.0"),
}

flags.DEFINE_string("workdir", "/tmp/prism_ablate", "one sub-directory per variant")
flags.DEFINE_string("preset", "tiny", "model/data preset")
flags.DEFINE_integer("steps", 200, "training steps per variant (equal tokens)")
flags.DEFINE_list("variants", ["dense", "prism", "normalized", "plain", "lam0.01", "lam0.2"],
                  f"variants to run, from {sorted(VARIANTS)}")
flags.DEFINE_multi_string("set", [], "extra overrides applied to every variant")
flags.DEFINE_string("out", None, "also write the markdown table to this file")
FLAGS = flags.FLAGS

COLUMNS = ("val loss", "vs dense", "R̄1", "R̄2", "residual share", "dead protos", "tok/s")


def variant_config(name: str, preset_name: str, steps: int, extra: list[str]):
  from prism_jax.config import preset  # pylint: disable=g-import-not-at-top
  from prism_jax.train import apply_overrides  # pylint: disable=g-import-not-at-top
  common = [f"train.steps={steps}", f"train.eval_every={steps}", f"train.ckpt_every={steps}",
            f"train.log_every={max(steps // 8, 1)}",
            f"data.packed_dir={os.path.join(os.path.abspath(FLAGS.workdir), 'data')}"]
  return apply_overrides(preset(preset_name), common + list(extra) + list(VARIANTS[name]))


def run_variant(name: str) -> dict:
  """Trains (or reads the cached result of) one variant; returns its metrics."""
  from prism_jax.train import train  # pylint: disable=g-import-not-at-top
  workdir = os.path.join(FLAGS.workdir, name)
  cached = os.path.join(workdir, "ablation.json")
  if os.path.exists(cached):
    with open(cached) as f:
      return json.load(f)
  cfg = variant_config(name, FLAGS.preset, FLAGS.steps, FLAGS.set)
  result = train(cfg, workdir)
  ev = result.eval
  if not ev:
    raise RuntimeError(f"variant {name}: no evaluation ran (empty val split?)")
  result = {"variant": name, "overrides": list(VARIANTS[name]) + list(FLAGS.set), **ev,
            "val_tokens": ev.get("tokens"),
            "train_tokens": FLAGS.steps * cfg.train.batch_size * cfg.data.seq_len,
            "tokens_per_s": result.steady_tokens_per_s, "wall_s": result.wall_s}
  with open(cached, "w") as f:
    json.dump(result, f, indent=1)
  return result


def format_table(results: list[dict]) -> str:
  dense = next((r["loss"] for r in results if r["variant"] == "dense"), None)
  lines = ["| variant | overrides | " + " | ".join(COLUMNS) + " |",
           "|" + "---|" * (len(COLUMNS) + 2)]
  fmt = lambda r, key, spec: format(r[key], spec) if r.get(key) is not None else "-"
  for r in results:
    rel = f"{100 * (r['loss'] / dense - 1):+.2f}%" if dense else "-"
    lines.append(" | ".join([
        f"| {r['variant']}", " ".join(r["overrides"]) or "(defaults)",
        f"{r['loss']:.4f}", rel, fmt(r, "r1_bar", ".3f"), fmt(r, "r2_bar", ".3f"),
        fmt(r, "residual_share", ".3f"), fmt(r, "dead_prototypes", ".0f"),
        fmt(r, "tokens_per_s", ",.0f")]) + " |")
  return "\n".join(lines)


def main(argv):
  del argv
  unknown = sorted(set(FLAGS.variants) - set(VARIANTS))
  if unknown:
    sys.exit(f"error: unknown variants {unknown}; choose from {sorted(VARIANTS)}")
  results = []
  for name in FLAGS.variants:
    results.append(run_variant(name))
    print(f"{name}: val loss {results[-1]['loss']:.4f}", flush=True)
  table = format_table(results)
  print(table)
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      f.write(table + "\n")


if __name__ == "__main__":
  cli.run(main)
