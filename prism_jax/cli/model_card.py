r"""Prints the model card of every preset: parameter counts and forward FLOPs per token,
then each GPT-2 preset's training recipe with its expected wall time on TPU slices.

  prism model-card [--config=small,xl] [--seq_len=1024] [--mfu=0.4]

Counts are analytic (prism_jax.flops, checked against real NNX models in
tests/test_flops.py); nothing is instantiated, so the 1.5B preset prints instantly.
Wall times are analytic too: the recipe's training FLOPs (3 x forward per token, every
step) plus its evaluations' forward passes, over the slice's published bf16 peak at an
assumed MFU. They are planning figures, not measurements.
"""

from __future__ import annotations

from collections.abc import Sequence

from absl import flags

from prism_jax.cli import launcher

from prism_jax import config
from prism_jax import flops


def card_rows(preset_names: Sequence[str], seq_len: int | None = None) -> list[dict]:
  rows = []
  for name in preset_names:
    cfg = config.model_preset(name)
    counts = flops.param_counts(cfg)
    fl = flops.flops_per_token(cfg, seq_len or cfg.max_len)
    rows.append({"preset": name, "K": cfg.num_prototypes, "k": cfg.k,
                 "seq_len": seq_len or cfg.max_len, **counts,
                 "backbone_fwd": fl["backbone_fwd"], "proto_fwd": fl["proto_fwd"],
                 "proto_fwd_pct": 100.0 * fl["proto_fwd"] / fl["backbone_fwd"]})
  return rows


def format_card(rows: Sequence[dict]) -> str:
  header = ("| preset | K | k | T | dense params | PRISM params | prototype overhead | "
            "backbone fwd FLOPs/token | prototype head fwd FLOPs/token | head / backbone |")
  lines = [header, "|" + " --- |" * 10]
  for r in rows:
    lines.append(
        f"| {r['preset']} | {r['K']} | {r['k']} | {r['seq_len']} | {r['dense']:,} "
        f"({r['dense'] / 1e6:.1f}M) | {r['prism']:,} ({r['prism'] / 1e6:.1f}M) | "
        f"{r['overhead_pct']:.1f}% | {r['backbone_fwd'] / 1e6:,.2f} MFLOP | "
        f"{r['proto_fwd'] / 1e6:,.2f} MFLOP | {r['proto_fwd_pct']:.2f}% |")
  return "\n".join(lines)


def define_flags() -> None:
  """Called by `prism model-card` only: other commands define --config and --seq_len too,
  and absl flags are process-global (tests import this module beside other entry points)."""
  if "seq_len" in flags.FLAGS:  # defined by an earlier call in this process
    return
  flags.DEFINE_list("config", list(config.MODEL_PRESETS), "presets to describe, "
                    "comma-separated (prism_jax.config.MODEL_PRESETS)")
  flags.DEFINE_integer("seq_len", None, "sequence length for the attention FLOPs "
                       "(default: each preset's max_len)")
  flags.DEFINE_float("mfu", ASSUMED_MFU, "MFU assumed for the recipes' wall-time estimates")


# Slices the wall time is given for: (label, prism_jax.flops.PEAK_BF16_FLOPS key, chips).
# Peaks per chip, dense bf16: v5e 197 TFLOP/s, v5p 459 TFLOP/s (Google Cloud TPU docs,
# cloud.google.com/tpu/docs/v5e and /v5p). v5p-32 counts TensorCores: 16 chips, 2x2x4.
SLICES = (("v5e:4x4", "TPU v5e", 16), ("v5p-32", "TPU v5p", 16))
ASSUMED_MFU = 0.4


def recipe_rows(preset_names: Sequence[str], mfu: float = ASSUMED_MFU) -> list[dict]:
  """The training recipe of each GPT-2 preset in `preset_names` (others are skipped)."""
  if not 0 < mfu <= 1:
    raise ValueError(f"--mfu={mfu}: an MFU is a fraction in (0, 1]")
  rows = []
  for name in preset_names:
    if name not in config.RECIPES:
      continue
    cfg = config.preset(name)
    tc, seq = cfg.train, cfg.data.seq_len
    fl = flops.flops_per_token(cfg.model, seq, cfg.loss)
    batch_tokens = tc.batch_size * seq
    evals = tc.steps // tc.eval_every + int(tc.eval_at_start)
    # each evaluation: eval_batches of val and as many of the train split, forward only
    eval_flops = evals * 2 * tc.eval_batches * batch_tokens * fl["fwd"]
    total = tc.steps * batch_tokens * fl["train"] + eval_flops
    params = flops.param_counts(cfg.model)["prism"]
    hours = {label: total / (chips * flops.PEAK_BF16_FLOPS[kind] * mfu) / 3600
             for label, kind, chips in SLICES}
    rows.append({"preset": name, "params": params, "tokens": tc.steps * batch_tokens,
                 "tokens_per_param": tc.steps * batch_tokens / params,
                 "batch_size": tc.batch_size, "seq_len": seq, "batch_tokens": batch_tokens,
                 "steps": tc.steps, "lr": tc.lr, "warmup_steps": tc.warmup_steps,
                 "proto_init_step": tc.proto_init_step, "eval_every": tc.eval_every,
                 "ckpt_every": tc.ckpt_every, "train_flops": total,
                 "eval_share": eval_flops / total, "hours": hours})
  return rows


def format_recipes(rows: Sequence[dict], mfu: float = ASSUMED_MFU) -> str:
  slices = [label for label, _, _ in SLICES]
  lines = ["| preset | PRISM params | tokens (per param) | batch (rows x T = tokens) | steps "
           "| peak LR | warm-up | bank from data at | eval / ckpt every | training FLOPs "
           "(evals) | " + " | ".join(f"hours on {s}" for s in slices) + " |",
           "|" + " --- |" * (10 + len(slices))]
  for r in rows:
    lines.append(
        f"| {r['preset']} | {r['params'] / 1e6:,.1f}M | {r['tokens'] / 1e9:.2f}B "
        f"({r['tokens_per_param']:.1f}) | {r['batch_size']} x {r['seq_len']} = "
        f"{r['batch_tokens']:,} | {r['steps']:,} | {r['lr']:.1e} | {r['warmup_steps']} | "
        f"step {r['proto_init_step']} | {r['eval_every']} / {r['ckpt_every']} | "
        f"{r['train_flops']:.3g} ({100 * r['eval_share']:.1f}%) | "
        + " | ".join(f"{r['hours'][s]:.1f}" for s in slices) + " |")
  peaks = ", ".join(f"{label}: {chips} x {flops.PEAK_BF16_FLOPS[kind] / 1e12:.0f} TFLOP/s"
                    for label, kind, chips in SLICES)
  lines.append(
      f"\nHours: analytic training + evaluation FLOPs (prism_jax.flops, 3 x forward per "
      f"trained token) / (chips x dense bf16 peak x an ASSUMED MFU of {100 * mfu:.0f}%), not "
      f"a measurement. Peaks per chip from the Google Cloud TPU docs "
      f"(cloud.google.com/tpu/docs/v5e, /v5p): {peaks}. Schedule: linear warm-up, cosine "
      f"decay to 10% of the peak LR; --set train.steps=N rescales warm-up, bank init, evals "
      f"and checkpoints (prism_jax.config.recipe_train).")
  return "\n".join(lines)


def main(argv: Sequence[str], presets: Sequence[str] | None = None,
         seq_len: int | None = None, mfu: float = ASSUMED_MFU) -> None:
  del argv
  if presets is None and flags.FLAGS.is_parsed() and "config" in flags.FLAGS:  # prism model-card
    presets, seq_len, mfu = flags.FLAGS.config, flags.FLAGS.seq_len, flags.FLAGS.mfu
  presets = list(presets or config.MODEL_PRESETS)
  unknown = [p for p in presets if p not in config.MODEL_PRESETS]
  if unknown:
    raise ValueError(f"--config: unknown preset(s) {unknown}; choose from "
                     f"{list(config.MODEL_PRESETS)}")
  if seq_len is not None and seq_len < 1:
    raise ValueError(f"--seq_len must be >= 1, got {seq_len}")
  print(format_card(card_rows(presets, seq_len)))
  rows = recipe_rows(presets, mfu)
  if rows:
    print("\nTraining recipes (prism train --config=NAME):\n")
    print(format_recipes(rows, mfu))


if __name__ == "__main__":
  define_flags()
  launcher.run(main)
