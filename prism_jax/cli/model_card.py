r"""Prints the model card of every preset: parameter counts and forward FLOPs per token,
then each GPT-2 preset's training recipe, and its predicted wall time on the scale table's
TPU slices with the gradient accumulation each needs.

  prism model-card [--config=small,xl] [--seq_len=1024] [--scale_table=PATH]

Counts are analytic (prism_jax.flops, checked against real NNX models in
tests/test_flops.py); nothing is instantiated, so the 1.5B preset prints instantly.
Wall times come from the scale table (benchmarks/scale_table.py, its JSON
docs/results/scale_table.json in a checkout): for each named slice, the rows per chip that
fit, N = train.grad_accum and the predicted MFU of the accumulated recipe step (compiler
estimates, at full collective overlap and at none); the hours are the recipe's training
and evaluation FLOPs over the slice's chips x bf16 peak x that MFU. Planning figures, not
measurements.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterable, Sequence

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


def _markdown_table(columns: Sequence[str], cells: Iterable[Sequence[object]]) -> list[str]:
  """A markdown table's lines: the header of `columns`, then one row of cells each."""
  return (["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
          + ["| " + " | ".join(map(str, row)) + " |" for row in cells])


def format_card(rows: Sequence[dict]) -> str:
  return "\n".join(_markdown_table(
      ("preset", "K", "k", "T", "dense params", "PRISM params", "prototype overhead",
       "backbone fwd FLOPs/token", "prototype head fwd FLOPs/token", "head / backbone"),
      ((r["preset"], r["K"], r["k"], r["seq_len"], f"{r['dense']:,} ({r['dense'] / 1e6:.1f}M)",
        f"{r['prism']:,} ({r['prism'] / 1e6:.1f}M)", f"{r['overhead_pct']:.1f}%",
        f"{r['backbone_fwd'] / 1e6:,.2f} MFLOP", f"{r['proto_fwd'] / 1e6:,.2f} MFLOP",
        f"{r['proto_fwd_pct']:.2f}%") for r in rows)))


def define_flags() -> None:
  """Called by `prism model-card` only: other commands define --config and --seq_len too,
  and absl flags are process-global (tests import this module beside other entry points)."""
  if "seq_len" in flags.FLAGS:  # defined by an earlier call in this process
    return
  flags.DEFINE_list("config", list(config.MODEL_PRESETS), "presets to describe, "
                    "comma-separated (prism_jax.config.MODEL_PRESETS)")
  flags.DEFINE_integer("seq_len", None, "sequence length for the attention FLOPs "
                       "(default: each preset's max_len)")
  flags.DEFINE_string("scale_table", None, "the scale table's JSON whose predicted MFU "
                      "times the recipes (default: docs/results/scale_table.json of this "
                      "checkout, when there is one)")


def default_scale_table() -> str:
  """docs/results/scale_table.json beside the package (a checkout; absent when installed)."""
  here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  return os.path.join(here, "docs", "results", "scale_table.json")


def read_scale_table(path: str | None) -> dict | None:
  """The scale table's data; None when the default file is absent or predates the recipe
  plans (an explicit path that is missing is an error). By default the tables of other
  presets beside it (docs/results/scale_table_*.json, e.g. the Llama recipe's) are merged
  in: their recipe plans, chips and targets."""
  if path is None:
    path = default_scale_table()
    if not os.path.exists(path):
      return None
    extra = sorted(glob.glob(os.path.join(os.path.dirname(path), "scale_table_*.json")))
  else:
    extra = []
  with open(path) as f:
    data = json.load(f)
  if "recipes" not in data:
    return None
  for other_path in extra:
    with open(other_path) as f:
      other = json.load(f)
    if "recipes" in other:
      data = {**data, "recipes": data["recipes"] + other["recipes"],
              "chips": {**data["chips"], **other["chips"]},
              "targets": {**data["targets"], **other["targets"]}}
  return data


def recipe_rows(preset_names: Sequence[str]) -> list[dict]:
  """The training recipe of each GPT-2 preset in `preset_names` (others are skipped)."""
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
    rows.append({"preset": name, "params": params, "tokens": tc.steps * batch_tokens,
                 "tokens_per_param": tc.steps * batch_tokens / params,
                 "batch_size": tc.batch_size, "seq_len": seq, "batch_tokens": batch_tokens,
                 "steps": tc.steps, "lr": tc.lr, "warmup_steps": tc.warmup_steps,
                 "proto_init_step": tc.proto_init_step,
                 "proto_init_latest": (config.latest_proto_init(tc)
                                       if tc.proto_init_step == "auto" else None),
                 "eval_every": tc.eval_every,
                 "ckpt_every": tc.ckpt_every, "train_flops": total,
                 "eval_share": eval_flops / total})
  return rows


def slice_rows(recipes: Sequence[dict], data: dict) -> list[dict]:
  """Each recipe on each named slice of the scale table: its chosen PRISM plan (rows per
  chip that fit, N, microbatch, remat, predicted MFU) and the hours it gives."""
  out = []
  for r in recipes:
    for p in data["recipes"]:
      if p["chosen"] and p["kind"] == "prism" and p["preset"] == r["preset"]:
        peak = data["chips"][data["targets"][p["target"]]["chip"]]["peak_flops"]
        hours = [r["train_flops"] / (p["chips"] * peak * mfu) / 3600
                 for mfu in (p["mfu"], p["mfu_no_overlap"])]
        out.append({**{k: p[k] for k in ("preset", "slice", "chips", "remat", "fits_per_chip",
                                         "rows_per_chip", "grad_accum", "microbatch", "mfu",
                                         "mfu_no_overlap")},
                    "hours": hours[0], "hours_no_overlap": hours[1]})
  return out


def _bank_step(r: dict) -> str:
  if r["proto_init_step"] == "auto":  # once the states have spread (train.proto_init_cos)
    return f"auto (step {r['proto_init_latest']:,} at the latest)"
  return f"step {r['proto_init_step']}"


def format_recipes(rows: Sequence[dict]) -> str:
  lines = _markdown_table(
      ("preset", "PRISM params", "tokens (per param)", "batch (rows x T = tokens)", "steps",
       "peak LR", "warm-up", "bank from data at", "eval / ckpt every",
       "training FLOPs (evals)"),
      ((r["preset"], f"{r['params'] / 1e6:,.1f}M",
        f"{r['tokens'] / 1e9:.2f}B ({r['tokens_per_param']:.1f})",
        f"{r['batch_size']} x {r['seq_len']} = {r['batch_tokens']:,}", f"{r['steps']:,}",
        f"{r['lr']:.1e}", r["warmup_steps"], _bank_step(r),
        f"{r['eval_every']} / {r['ckpt_every']}",
        f"{r['train_flops']:.3g} ({100 * r['eval_share']:.1f}%)") for r in rows))
  lines.append(
      "\nSchedule: linear warm-up, cosine decay to 10% of the peak LR; --set train.steps=N "
      "rescales warm-up, bank init, evals and checkpoints (prism_jax.config.recipe_train).")
  return "\n".join(lines)


def format_slices(rows: Sequence[dict], data: dict) -> str:
  lines = _markdown_table(
      ("preset", "slice", "chips", "remat", "rows/chip that fit", "N (train.grad_accum)",
       "microbatch rows/chip", "predicted MFU (full overlap – none)",
       "predicted hours (full overlap – none)"),
      ((r["preset"], r["slice"], r["chips"], "on" if r["remat"] else "off",
        r["fits_per_chip"], r["grad_accum"], r["microbatch"],
        f"{100 * r['mfu']:.0f}% – {100 * r['mfu_no_overlap']:.0f}%",
        f"{r['hours']:.1f} – {r['hours_no_overlap']:.1f}") for r in rows))
  peaks = ", ".join(f"{k}: {v['peak_flops'] / 1e12:.0f} TFLOP/s" for k, v in
                    data["chips"].items())
  lines.append(
      f"\nHours: the recipe's analytic training + evaluation FLOPs / (chips x dense bf16 "
      f"peak x the scale table's predicted MFU of the accumulated recipe step, at full "
      f"collective overlap and at none): compiler estimates (`{data['command']}`, commit "
      f"{data['commit'][:12]}), not measurements; the table lists its assumptions. Slices "
      f"by Google's names (v5p by TensorCores, v5e by chips). Peaks per chip (Google Cloud "
      f"TPU docs): {peaks}. Train one with --set train.grad_accum=N --set model.remat=... "
      f"as listed.")
  return "\n".join(lines)


def main(argv: Sequence[str], presets: Sequence[str] | None = None,
         seq_len: int | None = None, scale_table: str | None = None) -> None:
  del argv
  if presets is None and flags.FLAGS.is_parsed() and "config" in flags.FLAGS:  # prism model-card
    presets, seq_len = flags.FLAGS.config, flags.FLAGS.seq_len
    scale_table = flags.FLAGS.scale_table
  presets = list(presets or config.MODEL_PRESETS)
  unknown = [p for p in presets if p not in config.MODEL_PRESETS]
  if unknown:
    raise ValueError(f"--config: unknown preset(s) {unknown}; choose from "
                     f"{list(config.MODEL_PRESETS)}")
  if seq_len is not None and seq_len < 1:
    raise ValueError(f"--seq_len must be >= 1, got {seq_len}")
  print(format_card(card_rows(presets, seq_len)))
  rows = recipe_rows(presets)
  if not rows:
    return
  print("\nTraining recipes (prism train --config=NAME):\n")
  print(format_recipes(rows))
  data = read_scale_table(scale_table)
  if data is None:
    print("\nPredicted hours need the scale table with its recipe plans (python -m "
          "benchmarks.scale_table --results_json=docs/results/scale_table.json in a "
          "checkout; --scale_table=PATH).")
    return
  print("\nOn TPU slices (the scale table's predictions):\n")
  print(format_slices(slice_rows(rows, data), data))


if __name__ == "__main__":
  define_flags()
  launcher.run(main)
