"""The GPT-2 recipes on the scale table's slices: gradient accumulation derived from the
per-chip compiles, and one compiled accumulated step per target that checks it.

A recipe step is RECIPE_ROWS rows (512 x 1024 tokens), R = 512 / chips rows a chip. From
each fitting row of the table (its largest per-chip batch b) `plan` takes N =
config.grad_accum_for(R, b) microbatches of m = R / N rows and predicts the accumulated
step from that row's terms:
  - compute and memory: the row's roofline time per row of batch, times R (the MFU at the
    microbatch taken to be the MFU at b; m lies in (b/2, b] when N > 1),
  - collectives: per microbatch between the row's term scaled to the microbatch (those
    that grow with the batch: v5p's model-axis gathers and reductions of activations) and
    the row's term itself (those that do not: FSDP's weight gathers); the full-overlap
    step takes the first, the no-overlap step the second, so the two are an optimistic and
    a pessimistic bound for collectives affine in the batch,
  - PRISM with N > 1: the prepass (prism_jax/train/step.py: one forward of every microbatch,
    without the LM head, to find each prototype's nearest token of the whole batch) adds
    its analytic share of the training FLOPs to both.
`recipe_rows` keeps, per slice x preset x kind, the remat setting whose plan predicts the
highest MFU (full overlap). `check` compiles the accumulated step itself at the chosen N
for one preset per target: whether it fits, and its figures beside the derivation's.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from benchmarks import scale_lib  # sets the compile-only environment before jax loads

from benchmarks import scale_roofline  # noqa: E402  pylint: disable=wrong-import-order
from prism_jax import config  # noqa: E402  pylint: disable=wrong-import-order

LOOP_NOTE = ("XLA's cost analysis and the HLO text count a loop body once: with N > 1 the "
             "compiled FLOPs, bytes and collectives are one microbatch's (prepass and "
             "training) plus the update, compared with the derivation per microbatch")


def prepass_share(preset_name: str, kind: str, grad_accum: int, seq_len: int) -> float:
  """The accumulated step's prepass FLOPs over its training FLOPs (analytic)."""
  from prism_jax import flops  # pylint: disable=import-outside-toplevel
  if kind != "prism" or grad_accum == 1:
    return 0.0
  cfg = config.preset(preset_name)
  f = flops.flops_per_token(cfg.model, seq_len, cfg.loss)
  prepass = (f["backbone_fwd"] - f["lm_head_fwd"] + f["proto_similarity"] + f["proto_norms"]
             + f["proto_topk"])
  return prepass / f["train"]


def plan(row: dict, chip: scale_lib.Chip, recipe_rows: int = config.RECIPE_ROWS) -> dict:
  """The accumulated recipe step predicted from one fitting table row."""
  chips, b = row["chips"], row["per_chip_batch"]
  if recipe_rows % chips:
    raise ValueError(f"{recipe_rows} recipe rows do not spread over {chips} chips")
  rows = recipe_rows // chips
  n = config.grad_accum_for(rows, b)
  share = prepass_share(row["preset"], row["kind"], n, row["seq_len"])
  roofline = 1e-3 * row["roofline_step_ms"] * rows / b * (1 + share)
  coll_low = 1e-3 * row["roofline_collective_ms"] * rows / b * (1 + share)
  coll_high = 1e-3 * row["roofline_collective_ms"] * n * (1 + share)
  analytic = 1e12 * row["analytic_TFLOP"] * rows / b  # the recipe step's training FLOPs
  full, none = max(roofline, coll_low), roofline + coll_high
  tokens = rows * row["seq_len"]
  return {"slice": row["slice"], "target": row["target"], "preset": row["preset"],
          "kind": row["kind"], "remat": row["remat"], "chips": chips,
          "fits_per_chip": b, "rows_per_chip": rows, "grad_accum": n, "microbatch": rows // n,
          "prepass_share": share, "step_ms": 1e3 * full, "step_ms_no_overlap": 1e3 * none,
          "collective_ms": 1e3 * coll_low, "collective_ms_no_overlap": 1e3 * coll_high,
          "tokens_per_s_per_chip": tokens / full,
          "tokens_per_s_per_chip_no_overlap": tokens / none,
          "mfu": analytic / full / chip.peak_flops,
          "mfu_no_overlap": analytic / none / chip.peak_flops}


def recipe_rows(rows: list[dict], chips: dict[str, scale_lib.Chip]) -> list[dict]:
  """Every fitting row's plan for the GPT-2 recipes, `chosen` marking the remat setting
  with the highest predicted MFU per slice x preset x kind (ties: fewer microbatches)."""
  plans = [plan(r, chips[scale_lib.TARGETS[r["target"]].chip]) for r in rows
           if r["fits"] and r["preset"] in config.RECIPES]
  best: dict[tuple, dict] = {}
  for p in plans:
    key = (p["target"], p["preset"], p["kind"])
    if key not in best or (p["mfu"], -p["grad_accum"]) > (best[key]["mfu"],
                                                          -best[key]["grad_accum"]):
      best[key] = p
  return [dict(p, chosen=p is best[(p["target"], p["preset"], p["kind"])]) for p in plans]


def check_presets(plans: list[dict], targets) -> dict[str, str]:
  """Per target, the preset whose accumulated step is compiled: the smallest recipe whose
  chosen PRISM plan accumulates (N > 1), else the smallest recipe (its step at N = 1)."""
  out = {}
  for tname in targets:
    chosen = [p for p in plans if p["chosen"] and p["target"] == tname and p["kind"] == "prism"]
    chosen.sort(key=lambda p: list(config.RECIPES).index(p["preset"]))
    accumulating = [p for p in chosen if p["grad_accum"] > 1]
    if chosen:
      out[tname] = (accumulating or chosen)[0]["preset"]
  return out


def check(cache: scale_lib.Cache, p: dict, row: dict, may_compile: Callable[[], bool],
          log=print) -> dict[str, Any]:
  """Compiles the accumulated step of plan `p` (from table row `row`: R rows a chip as N
  microbatches) and sets its figures beside the derivation's: whether it fits; its FLOPs,
  bytes and collective bytes against derived_per_program; with N = 1 also its own step
  time and MFU against the plan's."""
  from benchmarks import compile_check  # pylint: disable=import-outside-toplevel
  from benchmarks import scale_measure  # pylint: disable=import-outside-toplevel
  target = scale_lib.TARGETS[p["target"]]
  chip = scale_lib.CHIPS[target.chip]
  seq_len = row["seq_len"]
  n, rows, name, full = (p["grad_accum"], p["rows_per_chip"], p["preset"],
                         config.preset(p["preset"]).model.n_layers)
  key = cache.key(target.topology, target.mesh, name, p["kind"], p["remat"], seq_len, rows,
                  full, f"grad_accum={n}")

  def lower():
    lowered, cfg, state, devices = compile_check.lower_train_step(
        name, target.topology, target.mesh, rows, seq_len, "bfloat16", p["remat"], p["kind"],
        None, 0, grad_accum=n)
    program = scale_measure.program_key(lowered, target.topology, target.mesh)
    return program, lambda: scale_measure.compile_and_read(lowered, cfg, state, devices,
                                                           target.mesh, chip.hbm_bytes)
  t0 = time.time()
  m = cache.get(key, lower, may_compile)
  log(f"  accumulated check {p['target']} {name} remat={p['remat']} N={n} x {rows // n} rows: "
      f"fits={m['fits']} ({time.time() - t0:.0f} s)")
  program = cache.index[key]
  out = {k: p[k] for k in ("slice", "target", "preset", "kind", "remat", "rows_per_chip",
                           "grad_accum", "microbatch")}
  out.update(program=program, compiled_this_run=program in cache.fresh, fits=m["fits"],
             hbm_GiB=chip.hbm_bytes / scale_lib.GIB, loop_note=LOOP_NOTE if n > 1 else None)
  if "peak_bytes" not in m:
    return dict(out, error=m.get("error"))
  terms = scale_roofline.step_terms(m, chip)
  want = derived_per_program(p, row)
  out.update(peak_GiB=m["peak_bytes"] / scale_lib.GIB, compiled_TFLOP=m["flops"] / 1e12,
             derived_TFLOP=want["TFLOP"], bytes_accessed_GB=m["bytes_accessed"] / 1e9,
             derived_bytes_GB=want["bytes_GB"], collective_wire_GB=terms["wire"] / 1e9,
             derived_collective_wire_GB=want["collective_wire_GB"],
             collectives=m["collectives"], mosaic_calls=m.get("mosaic_calls"))
  if n == 1:  # the program is the whole step: its own prediction beside the plan's
    analytic = 1e12 * row["analytic_TFLOP"] * rows / row["per_chip_batch"]
    out.update(step_ms=1e3 * terms["overlap"], step_ms_no_overlap=1e3 * terms["no_overlap"],
               mfu=analytic / terms["overlap"] / chip.peak_flops,
               mfu_no_overlap=analytic / terms["no_overlap"] / chip.peak_flops,
               derived_mfu=p["mfu"], derived_mfu_no_overlap=p["mfu_no_overlap"])
  return out


def derived_per_program(p: dict, row: dict) -> dict[str, float]:
  """What the derivation expects the check's compiled program to report: the whole step
  at N = 1, one microbatch (prepass and training) at N > 1 (LOOP_NOTE)."""
  b, share = row["per_chip_batch"], p["prepass_share"]
  scale = p["microbatch"] / b * (1 + share)
  return {"TFLOP": row["compiled_TFLOP"] * scale, "bytes_GB": row["bytes_accessed_GB"] * scale,
          # between the two collective bounds of `plan`, per microbatch
          "collective_wire_GB": [row["collective_wire_GB"] * scale,
                                 row["collective_wire_GB"] * (1 + share)]}


def checks(cache: scale_lib.Cache, rows: list[dict], plans: list[dict], presets: dict[str, str],
           may_compile: Callable[[], bool], log=print) -> list[dict]:
  """`check` of the chosen PRISM plan of presets[target] on each target; one whose compile
  is not allowed (may_compile) is recorded as skipped."""
  by_row = {(r["target"], r["preset"], r["kind"], r["remat"]): r for r in rows if r["fits"]}
  out = []
  for tname, name in presets.items():
    p = next((p for p in plans if p["chosen"] and p["target"] == tname
              and p["preset"] == name and p["kind"] == "prism"), None)
    if p is None:
      out.append({"target": tname, "slice": tname.split()[0], "preset": name,
                  "skipped": "no fitting row of the table to plan from"})
      continue
    try:
      out.append(check(cache, p, by_row[(tname, name, "prism", p["remat"])], may_compile, log))
    except scale_lib.BudgetSpent:
      log(f"no compile allowed (--max_compiles): the accumulated check of {tname} {name}")
      out.append({k: p[k] for k in ("slice", "target", "preset", "kind", "remat",
                                    "rows_per_chip", "grad_accum", "microbatch")}
                 | {"skipped": "not compiled (--max_compiles) and not in the cache"})
  return out
