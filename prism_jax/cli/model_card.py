r"""Prints the model card of every preset: parameter counts and forward FLOPs per token.

  prism model-card [--config=small,xl] [--seq_len=1024]

Counts are analytic (prism_jax.flops, checked against real NNX models in
tests/test_flops.py); nothing is instantiated, so the 1.5B preset prints instantly.
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


def main(argv: Sequence[str], presets: Sequence[str] | None = None,
         seq_len: int | None = None) -> None:
  del argv
  if presets is None and "config" in flags.FLAGS:  # run as `prism model-card`
    presets, seq_len = flags.FLAGS.config, flags.FLAGS.seq_len
  presets = list(presets or config.MODEL_PRESETS)
  unknown = [p for p in presets if p not in config.MODEL_PRESETS]
  if unknown:
    raise ValueError(f"--config: unknown preset(s) {unknown}; choose from "
                     f"{list(config.MODEL_PRESETS)}")
  if seq_len is not None and seq_len < 1:
    raise ValueError(f"--seq_len must be >= 1, got {seq_len}")
  print(format_card(card_rows(presets, seq_len)))


if __name__ == "__main__":
  define_flags()
  launcher.run(main)
