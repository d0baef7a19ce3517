"""PRISM design ablation vs the dense twin at equal tokens (tiny preset, embedded corpus).

  python -m experiments.ablate --out=/tmp/prism_ablate --steps=200 \
      [--variants=dense,prism,normalized,plain,lam0.01,lam0.2] [--table_md=docs/results/x.md]
  python -m experiments.ablate --out=/tmp/f11/byte --base=byte --steps=2000 \
      --variants=dense,before,before+proto1+scale,before+proto1@s1

Every variant trains the same preset for the same steps x batch x seq_len tokens with the
same seed and data (prism_jax.train.train), then is evaluated on the val split: full CE,
the faithfulness metrics (prototype-path CE ratio, argmax agreement, centred-logit share),
R̄1, R̄2, residual share, dead prototypes, and the process's CPU seconds for the run. A
variant is a VARIANTS name or LEVERS joined by "+" (issue 11's levers), with an optional
seed suffix "@s1". Runs are sequential; a finished variant's result is cached in
<out>/<variant>/ablation.json, so re-running only trains what is missing. Prints a
markdown table (and writes it to --table_md). With --results_json, the --headline variants (the
default, one per seed) become this base's row of that docs/results file (reproduce.py's
schema; the other base's row is kept).
"""
import json
import os
import resource

from absl import flags

from prism_jax.cli import flag_checks as check
from prism_jax.cli import launcher
from prism_jax.cli import provenance

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

# Issue 11's faithfulness levers, combined with "+" in a variant name (e.g.
# "before+proto1+scale"); a suffix "@s<N>" sets train.seed=N (init and residual-dropout key;
# the data order is data.seed, left alone). "before" pins the defaults before issue 11, so
# names keep their meaning after the defaults change.
LEVERS: dict[str, tuple[str, ...]] = {
    "before": ("model.mixture=normalized", "model.mixture_scale=none", "model.k=8",
               "model.num_prototypes=512", "model.residual_dropout=0.0",
               "loss.lambda_rec=0.05", "loss.rec_ramp_steps=0", "loss.lambda_r1=0.1",
               "loss.lambda_r2=1.0", "loss.lambda_proto=0.0", "loss.lambda_rlogit=0.0",
               "loss.lambda_proto_kl=0.0"),
    "scale": ("model.mixture_scale=learned",),
    "raw": ("model.mixture=raw",),
    "k4": ("model.k=4",), "k16": ("model.k=16",), "k32": ("model.k=32",),
    "K1024": ("model.num_prototypes=1024",),
    "proto0.3": ("loss.lambda_proto=0.3",), "proto1": ("loss.lambda_proto=1.0",),
    "proto3": ("loss.lambda_proto=3.0",),
    "rdrop0.25": ("model.residual_dropout=0.25",), "rdrop0.5": ("model.residual_dropout=0.5",),
    "rdrop0.75": ("model.residual_dropout=0.75",),
    "rec0.3": ("loss.lambda_rec=0.3",), "rec1": ("loss.lambda_rec=1.0",),
    "rec3": ("loss.lambda_rec=3.0",),
    "ramp": ("loss.rec_ramp_steps=300",),  # λ_rec from 0 to its value over 300 steps
    "r2_2": ("loss.lambda_r2=2.0",),
    # Logit-space residual penalty var_v(W r) / var_v(W z) (losses.residual_logit_share).
    "rlogit0.3": ("loss.lambda_rlogit=0.3",), "rlogit1": ("loss.lambda_rlogit=1.0",),
    "rlogit3": ("loss.lambda_rlogit=3.0",),
    # KL of the prototype path to the model's (stop-gradient) distribution (losses.proto_kl).
    "pkl1": ("loss.lambda_proto_kl=1.0",), "pkl3": ("loss.lambda_proto_kl=3.0",),
}


def variant_overrides(name: str) -> tuple[str, ...]:
  """--set overrides of a variant: a VARIANTS name, or LEVERS joined by "+", then "@s<N>"."""
  base, _, seed = name.partition("@s")
  if base in VARIANTS:
    sets = VARIANTS[base]
  else:
    unknown = [lever for lever in base.split("+") if lever not in LEVERS]
    if unknown:
      raise ValueError(f"variant {name!r}: unknown {unknown}; variants {sorted(VARIANTS)}, "
                       f"levers {sorted(LEVERS)}")
    sets = sum((LEVERS[lever] for lever in base.split("+")), ())
  if seed:
    if not seed.isdigit():
      raise ValueError(f"variant {name!r}: the seed after '@s' must be an integer")
    sets += (f"train.seed={seed}",)
  return sets


# The runs a variant is measured on: the preset plus these overrides (issue 11's two
# configs). "byte": 4 layers/4 heads/d 128 on bytes, ctx 64, batch 12, 2000 steps, AdamW
# 1e-3 -> 1e-4 cosine, 100 warm-up, betas 0.9/0.99, on the 9.4 MB of Vim's help files (the
# vim-runtime Debian package; the embedded corpus is only 0.5 MB).
BASES: dict[str, tuple[str, ...]] = {
    "tiny": (),
    "byte": ("data.tokenizer=byte", "model.vocab_size=258", "model.max_len=64",
             "data.seq_len=64", "data.sources=/usr/share/vim/vim90/doc/*.txt",
             "train.batch_size=12", "train.lr=1e-3", "train.min_lr_ratio=0.1",
             "train.warmup_steps=100", "train.b2=0.99"),
}

flags.DEFINE_string("out", "/tmp/prism_ablate", "directory written: one trained run per "
                    "variant")
flags.DEFINE_string("config", "tiny", "model/data preset name")
flags.DEFINE_enum("base", "tiny", list(BASES), "overrides on the preset before the variant's")
flags.DEFINE_integer("steps", 200, "training steps per variant (equal tokens)")
flags.DEFINE_list("variants", ["dense", "prism", "normalized", "plain", "lam0.01", "lam0.2"],
                  f"variants to run: {sorted(VARIANTS)} or levers {sorted(LEVERS)} joined "
                  "by '+', optionally with a seed suffix '@s1'")
flags.DEFINE_multi_string("set", [], "extra overrides applied to every variant")
flags.DEFINE_string("table_md", None, "also write the markdown table to this file")
flags.DEFINE_bool("overrides_column", True, "print each variant's overrides in the table")
flags.DEFINE_string("results_json", None, "record the --headline variants as this base's row "
                    "of this results JSON (e.g. docs/results/faithfulness.json)")
flags.DEFINE_list("headline", [], "the default's variants (one per seed) for --results_json")
FLAGS = flags.FLAGS

COLUMNS = ("val CE", "vs dense", "proto CE ratio", "agreement", "centred proto share",
           "R̄1", "R̄2", "residual share", "dead protos", "top-1 W z / W ẑ / W r", "CPU s")


def variant_config(name: str, preset_name: str, steps: int, extra: list[str]):
  from prism_jax.config import preset  # pylint: disable=g-import-not-at-top
  from prism_jax.train import apply_overrides  # pylint: disable=g-import-not-at-top
  common = [f"train.steps={steps}", f"train.eval_every={steps}", f"train.ckpt_every={steps}",
            f"train.log_every={max(steps // 8, 1)}",
            f"data.packed_dir={os.path.join(os.path.abspath(FLAGS.out), 'data')}"]
  return apply_overrides(preset(preset_name), list(BASES[FLAGS.base]) + common + list(extra)
                         + list(variant_overrides(name)))


def _cpu_seconds() -> float:
  """User + system CPU time of this process (all threads): the cost measure on a shared box."""
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_utime + usage.ru_stime


def run_variant(name: str) -> dict:
  """Trains (or reads the cached result of) one variant; returns its metrics."""
  from prism_jax.train import train  # pylint: disable=g-import-not-at-top
  workdir = os.path.join(FLAGS.out, name)
  cached = os.path.join(workdir, "ablation.json")
  if os.path.exists(cached):
    with open(cached) as f:
      return json.load(f)
  cfg = variant_config(name, FLAGS.config, FLAGS.steps, FLAGS.set)
  cpu0 = _cpu_seconds()
  result = train(cfg, workdir)
  cpu_s = _cpu_seconds() - cpu0
  ev = result.eval
  if not ev:
    raise RuntimeError(f"variant {name}: no evaluation ran (empty val split?)")
  result = {"variant": name, "overrides": list(variant_overrides(name)) + list(FLAGS.set), **ev,
            "val_tokens": ev.get("tokens"),
            "train_tokens": FLAGS.steps * cfg.train.batch_size * cfg.data.seq_len,
            "tokens_per_s": result.steady_tokens_per_s, "wall_s": result.wall_s,
            "cpu_s": cpu_s, "base": FLAGS.base}
  provenance.write_json(cached, result)
  return result


def format_table(results: list[dict], with_overrides: bool = False) -> str:
  """Markdown table; "vs dense" is against the dense twin of the same seed (or seed 0)."""
  dense = {r["variant"].partition("@s")[2] or "0": r["loss"] for r in results
           if r["variant"].partition("@s")[0] == "dense"}
  head = ["variant"] + (["overrides"] if with_overrides else []) + list(COLUMNS)
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  fmt = lambda r, key, spec: format(r[key], spec) if r.get(key) is not None else "-"
  for r in results:
    ref = dense.get(r["variant"].partition("@s")[2] or "0", dense.get("0"))
    rel = f"{100 * (r['loss'] / ref - 1):+.2f}%" if ref else "-"
    agree = f"{100 * r['agreement']:.1f}%" if r.get("agreement") is not None else "-"
    top1 = ("/".join(f"{r[k]:.3f}" for k in ("acc_full", "acc_proto", "acc_resid"))
            if r.get("acc_full") is not None else "-")
    cells = [r["variant"]] + ([" ".join(r["overrides"]) or "(defaults)"]
                              if with_overrides else [])
    cells += [f"{r['loss']:.4f}", rel, fmt(r, "proto_ce_ratio", ".3f"), agree,
              fmt(r, "centred_proto_share", ".3f"), fmt(r, "r1_bar", ".3f"),
              fmt(r, "r2_bar", ".3f"), fmt(r, "residual_share", ".3f"),
              fmt(r, "dead_prototypes", ".0f"), top1, fmt(r, "cpu_s", ".0f")]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def seed_spread(results: list[dict]) -> list[str]:
  """One line per variant run with several seeds: each metric's values and max - min."""
  groups: dict[str, list[dict]] = {}
  for r in results:
    groups.setdefault(r["variant"].partition("@s")[0], []).append(r)
  keys = (("loss", "val CE", ".4f"), ("proto_ce_ratio", "proto CE ratio", ".3f"),
          ("agreement", "agreement", ".3f"), ("r2_bar", "R̄2", ".3f"))
  lines = []
  for name, rs in groups.items():
    if len(rs) < 2:
      continue
    parts = []
    for key, label, spec in keys:
      vals = [r[key] for r in rs if r.get(key) is not None]
      if vals:
        parts.append(f"{label} {' / '.join(format(v, spec) for v in vals)} "
                     f"(spread {format(max(vals) - min(vals), spec)})")
    lines.append(f"- {name} over {len(rs)} seeds: " + "; ".join(parts))
  return lines


def headline_row(results: list[dict], names: list[str], base: str, command: str) -> dict:
  """The results-JSON row of the default: each bar's value per seed ("a / b")."""
  by = {r["variant"]: r for r in results}
  missing = [n for n in names if n not in by]
  if missing:
    raise ValueError(f"--headline {missing} not among --variants")
  dense = {r["variant"].partition("@s")[2] or "0": r["loss"] for r in results
           if r["variant"].partition("@s")[0] == "dense"}
  rs = [by[n] for n in names]
  vs_dense = [r["loss"] / dense.get(r["variant"].partition("@s")[2] or "0", dense.get("0"))
              - 1 for r in rs] if dense else []
  join = lambda vals, fmt: " / ".join(fmt(v) for v in vals)
  ours = (f"agreement {join([r['agreement'] for r in rs], lambda v: f'{100 * v:.1f}%')}, "
          f"proto CE ratio {join([r['proto_ce_ratio'] for r in rs], '{:.3f}'.format)}, "
          f"full CE vs dense {join(vs_dense, lambda v: f'{100 * v:+.1f}%')}, "
          f"R̄1 {join([r['r1_bar'] for r in rs], '{:.3f}'.format)}, "
          f"R̄2 {join([r['r2_bar'] for r in rs], '{:.3f}'.format)}")
  keep = ("loss", "proto_ce_ratio", "agreement", "centred_proto_share", "r1_bar", "r2_bar",
          "residual_share", "dead_prototypes", "acc_full", "acc_proto", "acc_resid", "cpu_s")
  return {"metric": f"faithfulness, {base} ({names[0].partition('@s')[0]}, {len(rs)} seeds)",
          "ours": ours, "paper": "not reported", "command": command,
          "note": "bars: agreement >= 90%, ratio <= 1.05, vs dense <= +2%, R̄ >= 0.9",
          "base": base, "variants": names, "vs_dense": vs_dense,
          "metrics": [{k: r.get(k) for k in keep} for r in rs]}


def write_results_json(path: str, row: dict) -> None:
  """Replaces this base's row; the tiny row answers reproduce.py's "faithfulness" claim."""
  rows = []
  if os.path.exists(path):
    with open(path) as f:
      rows = [r for r in json.load(f)["rows"] if r.get("base") != row["base"]]
  rows = sorted(rows + [row], key=lambda r: list(BASES).index(r["base"]))
  for r in rows:
    r.pop("claim", None)
    if r["base"] == "tiny":
      r["claim"] = "faithfulness"
  provenance.write_results(path, {"rows": rows})


def check_flags() -> None:
  """Every flag combination, before any training (one `error:` line)."""
  check.at_least(1, steps=FLAGS.steps)
  check.not_empty(variants=FLAGS.variants)
  if bool(FLAGS.headline) != bool(FLAGS.results_json):
    raise ValueError("--results_json and --headline (the default's variants) go together")
  if set(FLAGS.headline) - set(FLAGS.variants):
    raise ValueError(f"--headline {sorted(set(FLAGS.headline) - set(FLAGS.variants))} not "
                     "among --variants")
  check.output_file("table_md", FLAGS.table_md)
  check.output_file("results_json", FLAGS.results_json)
  for name in FLAGS.variants:
    # a bad variant, --config or --set is refused here, not after the earlier variants trained
    variant_config(name, FLAGS.config, FLAGS.steps, FLAGS.set)


def main(argv):
  del argv
  check_flags()
  results = []
  for name in FLAGS.variants:
    results.append(run_variant(name))
    print(f"{name}: val loss {results[-1]['loss']:.4f}", flush=True)
  table = "\n".join([format_table(results, FLAGS.overrides_column), ""] + seed_spread(results))
  print(table)
  if FLAGS.table_md:
    with open(FLAGS.table_md, "w") as f:
      f.write(table + "\n")
  if FLAGS.results_json:
    rec = provenance.record("experiments.ablate")
    row = headline_row(results, FLAGS.headline, FLAGS.base, rec["command"])
    write_results_json(FLAGS.results_json, dict(row, argv=rec["argv"], commit=rec["commit"]))


if __name__ == "__main__":
  launcher.run(main)
