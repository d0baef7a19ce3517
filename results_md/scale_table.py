"""The scale table's markdown (docs/RESULTS.md "Scale table"), from the JSON that
benchmarks/scale_table.py writes: pure Python, so experiments/reproduce.py renders it
without importing the compile machinery."""

from __future__ import annotations


def _gb(n: float) -> str:
  return f"{n / 1e9:.2f}"


def _onoff(remat: bool) -> str:
  return "on" if remat else "off"


def _pct_pair(a: float, b: float) -> str:
  return f"{100 * a:.0f}% – {100 * b:.0f}%"


def _range(x) -> str:
  return f"{x[0]:.2f} – {x[1]:.2f}" if isinstance(x, list) else f"{x:.2f}"


def _row(r: dict) -> str:
  head = f"| {r['target']} | {r['preset']} | {r['kind']} | {_onoff(r['remat'])} "
  if not r["fits"]:
    return head + "| none fits |" + " |" * 12
  c = r["collectives"]
  coll = " | ".join(f"{c[k]['count']} / {_gb(c[k]['bytes'])}"
                    for k in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all"))
  nxk = "no" if not r["nxk_collectives"] else f"YES ({len(r['nxk_collectives'])})"
  if r["kind"] == "dense":
    nxk = "–"
  # rows of a JSON older than the collective term: the roofline alone
  coll_ms = r.get("roofline_collective_ms")
  terms = (f"{r['roofline_compute_ms']:.0f} / {r['roofline_memory_ms']:.0f} / "
           + ("–" if coll_ms is None else f"{coll_ms:.0f}"))
  step = r.get("step_ms", r["roofline_step_ms"])
  step_none = r.get("step_ms_no_overlap", step)
  tokens_none = r.get("tokens_per_s_per_chip_no_overlap", r["tokens_per_s_per_chip"])
  return (head + f"| {r['per_chip_batch']} | {r['peak_GiB']:.2f} / {r['hbm_GiB']:.0f} "
          f"| {r['compiled_TFLOP']:.2f} / {r['analytic_TFLOP']:.2f} "
          f"| {r['bytes_accessed_GB']:.0f} | {coll} | {nxk} | {terms} "
          f"| {step:.0f} – {step_none:.0f} ({r['bound']}) "
          f"| {r['tokens_per_s_per_chip']:.0f} – {tokens_none:.0f} "
          f"| {_pct_pair(r['mfu'], r.get('mfu_no_overlap', r['mfu']))} |")


def _recipes(data: dict) -> list[str]:
  plans = [p for p in data.get("recipes", []) if p["chosen"]]
  if not plans:
    return []
  lines = ["", f"The GPT-2 recipes ({data['recipe_rows_per_step']} rows × 1024 tokens a step) "
           "on these slices: rows per chip that fit (the table's batch, at the remat setting "
           "whose accumulated step predicts the higher MFU), N = `train.grad_accum` (the "
           "fewest microbatches that fit) and the predicted step, derived from the row "
           "(assumptions below). `prism model-card` prints the hours from these.", "",
           "| slice | preset | kind | remat | rows/chip that fit | recipe rows/chip | N "
           "| microbatch rows/chip | prepass share | step ms (full overlap – none) "
           "| tokens/s/chip | MFU (full – none) |", "|" + "---|" * 12]
  for p in plans:
    lines.append(f"| {p['slice']} | {p['preset']} | {p['kind']} | {_onoff(p['remat'])} "
                 f"| {p['fits_per_chip']} | {p['rows_per_chip']} | {p['grad_accum']} "
                 f"| {p['microbatch']} | {100 * p['prepass_share']:.0f}% "
                 f"| {p['step_ms']:.0f} – {p['step_ms_no_overlap']:.0f} "
                 f"| {p['tokens_per_s_per_chip']:.0f} "
                 f"| {_pct_pair(p['mfu'], p['mfu_no_overlap'])} |")
  return lines


def _checks(data: dict) -> list[str]:
  checks = data.get("accum_checks", [])
  if not checks:
    return []
  lines = ["", "One recipe step compiled per slice (the accumulated train step, "
           "`train.grad_accum` = N, at the chosen microbatch): does it fit, and its compiled "
           "figures beside the derivation's. With N > 1, XLA's cost analysis and the HLO "
           "text count a loop body once, so the compiled figures are one microbatch's "
           "(prepass and training) plus the update, as is the derived column.", "",
           "| slice | preset | remat | N × microbatch rows/chip | HBM peak GiB (fits) "
           "| TFLOP compiled / derived | GB accessed compiled / derived "
           "| collective GB on the wire compiled / derived | MFU compiled / derived "
           "| compiled in this run |", "|" + "---|" * 10]
  for c in checks:
    if "grad_accum" not in c:  # no plan to check
      lines.append(f"| {c['slice']} | {c['preset']} | | | {c['skipped']} |" + " |" * 5)
      continue
    head = (f"| {c['slice']} | {c['preset']} | {_onoff(c['remat'])} "
            f"| {c['grad_accum']} × {c['microbatch']} ")
    if "skipped" in c or "peak_GiB" not in c:
      lines.append(head + f"| {c.get('skipped') or 'overflow'} |" + " |" * 5)
      continue
    mfu = ("per microbatch only" if c["grad_accum"] > 1 else
           f"{_pct_pair(c['mfu'], c['mfu_no_overlap'])} / "
           f"{_pct_pair(c['derived_mfu'], c['derived_mfu_no_overlap'])}")
    lines.append(head + f"| {c['peak_GiB']:.2f} / {c['hbm_GiB']:.0f} "
                 f"({'yes' if c['fits'] else 'NO'}) "
                 f"| {c['compiled_TFLOP']:.2f} / {c['derived_TFLOP']:.2f} "
                 f"| {c['bytes_accessed_GB']:.0f} / {c['derived_bytes_GB']:.0f} "
                 f"| {c['collective_wire_GB']:.2f} / {_range(c['derived_collective_wire_GB'])} "
                 f"| {mfu} | {'yes' if c['compiled_this_run'] else 'no (cache)'} |")
  return lines


def assumptions(data: dict) -> list[str]:
  """Every assumption under the table's numbers, one bullet each."""
  chips = data["chips"]
  ici = ", ".join(f"{k} {v['ici_bandwidth'] / 1e9:.0f} GB/s" for k, v in chips.items()
                  if "ici_bandwidth" in v)
  return [
      "", "Assumptions:", "",
      "- **Compiler estimates, not measurements.** Every figure comes from libtpu's "
      "ahead-of-time compile for the slice's topology (compile-only devices; no TPU ran): "
      "HBM peak from memory_analysis, FLOPs and bytes accessed from cost_analysis, "
      "collectives from the compiled HLO text (benchmarks/hlo_collectives.py).",
      "- **Chip figures.** " + "; ".join(f"{k}: {v['source']}" for k, v in chips.items())
      + ". A slice is named as Google names it: v5p by TensorCores (2 a chip: the 8-chip "
      "v5p:2x2x2 is v5p-16), v5e by chips (v5e:4x4 is v5e-16).",
      "- **Compute and memory terms.** Compiled FLOPs / bf16 peak and bytes accessed / HBM "
      "bandwidth, overlapped (the roofline: the larger of the two).",
      f"- **Collective term.** The bytes each collective moves per chip (an all-gather's "
      f"output, every other kind's operand; an all-reduce counted twice: reduce-scatter plus "
      f"all-gather) over half the chip's bidirectional ICI bandwidth ({ici}; a chip sends "
      f"and receives at once), every link busy, no contention or topology model. A ring "
      f"over n chips sends (n-1)/n of that, so the term is high by n/(n-1) (7% on 16 chips, "
      f"2x on the 2-way model axis); all links busy makes it low on slices that are not "
      f"full tori.",
      "- **Overlap.** Collectives are shown at both bounds: full overlap (step = the largest "
      "of the three terms) and none (roofline + collective term). Step, tokens/s and MFU "
      "read `full – none`; the first is the row's `mfu`, the second `mfu_no_overlap`.",
      "- **MFU.** Analytic training FLOPs (prism_jax.flops: 3 × forward per token, the "
      "prototype head and attention included, remat's recomputation not) over the step time "
      "and the chip's dense bf16 peak.",
      "- **The Mosaic kernel.** Its FLOPs and bytes in cost_analysis are its declared "
      "`pl.CostEstimate` (a custom call is opaque to XLA); tests/test_kernel_cost.py checks "
      "it against a count from its grid and blocks: FLOPs exact (the MXU dots; the VPU's "
      "elementwise work is not counted), bytes exact for z and the bank, what it leaves out "
      "(norms, mask, top-k lists, column partials) under 2% of its traffic at these shapes.",
      "- **Remat.** Off: XLA's own schedule; on: every block rematerialised in the backward "
      "pass (`model.remat`), trading FLOPs (in the compiled count, not in MFU's numerator) "
      "for memory. Batch/chip: the largest that fits the HBM, by full-depth compiles.",
      "- **Accumulation** (the recipe tables). Time per row of the microbatch = time per row "
      "at the largest fitting batch b (with 32 or 64 rows a chip, powers of two, the "
      "microbatch is in (b/2, b] when N > 1; at N = 1 it may be well under b). Collectives "
      "per microbatch lie between the row's scaled to the microbatch (v5p's model-axis "
      "collectives grow with the batch) and the row's unscaled (v5e's FSDP weight gathers "
      "do not): the full-overlap step takes the first, the no-overlap step the second. "
      "PRISM with N > 1 adds its prepass (one forward of every "
      "microbatch without the LM head) at its analytic share of the training FLOPs. One "
      "compiled accumulated step per slice checks the fit and these figures.",
      "- **Hours** (`prism model-card`): the recipe's training and evaluation FLOPs at the "
      "chosen row's MFU; evaluations and the 5% dense warm-up timed as PRISM training steps.",
  ]


def scale_table_markdown(data: dict) -> str:
  """The "Scale table" section's tables (between its markers in docs/RESULTS.md)."""
  fresh = data.get("fresh_rows")
  cached = ("" if fresh is None else
            " Compiled in this run: " + (", ".join(fresh) if fresh else "none")
            + "; every other compile came from the compile cache "
            "(benchmarks/scale_table_cache.json), its program lowered again at this commit "
            "and found unchanged (the cache is keyed by the lowered program).")
  lines = [f"Compiler estimates, not measurements (commit `{data['commit'][:12]}`, "
           f"`{data['command']}`)." + cached
           + (" batch/chip: the largest that fits, searched by full-depth compiles from "
              "the batch where HBM peaks extrapolated linearly in depth from "
              f"{data['shallow'][0]}- and "
              f"{data['shallow'][1]}-block compiles meet the HBM size; why not b + 1 (the "
              "compile that overflowed there, at full depth or fewer blocks) is each row's "
              "`batch_above` in the JSON. Every other figure of a row is the full-depth "
              "compile's at its batch."
              if data.get("shallow") else ""), "",
           "| target | preset | kind | remat | batch/chip | HBM peak GiB (compiler) "
           "| TFLOP/chip/step compiled / analytic | GB accessed (compiler) "
           "| all-gather n / GB | reduce-scatter n / GB | all-reduce n / GB "
           "| all-to-all n / GB | N×K moved | compute / memory / collective ms "
           "| step ms, full overlap – none (bound) | tokens/s/chip (full – none) "
           "| MFU (full – none) |",
           "|" + "---|" * 17]
  lines += [_row(r) for r in data["rows"]]
  lines += ["", "| target | preset | remat | predicted PRISM/dense tokens/s/chip "
            "(full overlap / none) | paper |", "|---|---|---|---|---|"]
  for r in data["ratios"]:
    paper = "97.3% (XL, H200, measured)" if r["preset"] == "xl" else "–"
    none = r.get("prism_over_dense_no_overlap")
    lines.append(f"| {r['target']} | {r['preset']} | {_onoff(r['remat'])} "
                 f"| {100 * r['prism_over_dense']:.1f}%"
                 + ("" if none is None else f" / {100 * none:.1f}%") + f" | {paper} |")
  lines += _recipes(data) + _checks(data)
  if "recipes" in data:
    lines += assumptions(data)
  return "\n".join(lines)
