"""The scale table's markdown (docs/RESULTS.md "Scale table"), from the JSON that
benchmarks/scale_table.py writes: pure Python, so experiments/reproduce.py renders it
without importing the compile machinery."""

from __future__ import annotations


def _gb(n: float) -> str:
  return f"{n / 1e9:.2f}"


def scale_table_markdown(data: dict) -> str:
  """The "Scale table" section's tables (between its markers in docs/RESULTS.md)."""
  chips = "; ".join(f"{k}: {v['source']}" for k, v in data["chips"].items())
  lines = [f"Compiler estimates, not measurements (commit `{data['commit'][:12]}`, "
           f"`{data['command']}`). Chip figures: {chips}."
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
           "| all-to-all n / GB | N×K moved | roofline ms (bound) | tokens/s/chip | MFU |",
           "|" + "---|" * 16]
  for r in data["rows"]:
    head = (f"| {r['target']} | {r['preset']} | {r['kind']} | {'on' if r['remat'] else 'off'} ")
    if not r["fits"]:
      lines.append(head + "| none fits |" + " |" * 11)
      continue
    c = r["collectives"]
    coll = " | ".join(f"{c[k]['count']} / {_gb(c[k]['bytes'])}"
                      for k in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all"))
    nxk = "no" if not r["nxk_collectives"] else f"YES ({len(r['nxk_collectives'])})"
    if r["kind"] == "dense":
      nxk = "–"
    lines.append(head + f"| {r['per_chip_batch']} | {r['peak_GiB']:.2f} / {r['hbm_GiB']:.0f} "
                 f"| {r['compiled_TFLOP']:.2f} / {r['analytic_TFLOP']:.2f} "
                 f"| {r['bytes_accessed_GB']:.0f} | {coll} | {nxk} "
                 f"| {r['roofline_step_ms']:.0f} ({r['bound']}) "
                 f"| {r['tokens_per_s_per_chip']:.0f} | {100 * r['mfu']:.0f}% |")
  lines += ["", "| target | preset | remat | predicted PRISM/dense tokens/s/chip | paper |",
            "|---|---|---|---|---|"]
  for r in data["ratios"]:
    paper = "97.3% (XL, H200, measured)" if r["preset"] == "xl" else "–"
    lines.append(f"| {r['target']} | {r['preset']} | {'on' if r['remat'] else 'off'} "
                 f"| {100 * r['prism_over_dense']:.1f}% | {paper} |")
  return "\n".join(lines)
