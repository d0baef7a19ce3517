"""Readers that turn an experiment's own results JSON into experiments.reproduce's rows.

Each experiment writes its results in its own shape (docs/results/<topic>.json, with the
"command" that wrote it); a reader here picks the numbers the paper-vs-ours table shows.
A file with no reader must already hold schema rows (reproduce.py's docstring).
"""

from __future__ import annotations

from typing import Callable


def _pct(x: float) -> str:
  return f"{100 * x:+.1f}%"


def suppression(data: dict) -> list[dict]:
  """The planted behaviour (held-out half of its vocabulary): rate before -> after."""
  by = {r["condition"]: r for r in data["rows"]}
  before = by["unedited"]
  edit = next(r for c, r in by.items() if c.startswith("suppress"))
  rnd = [r for c, r in by.items() if c.startswith("random")]
  ban = by.get("token ban")
  cut = 1 - edit["rate"]["mean"] / before["rate"]["mean"]
  note = (f"{edit['prototypes']} prototypes, {100 * edit['share_of_bank']:.1f}% of the bank; "
          f"neutral perplexity {_pct(edit['ppl_change'])}")
  if ban:
    note += f"; token ban: rate {ban['rate']['mean']:.3g}"
  if rnd:
    note += f"; {len(rnd)} random sets: rate moved {data['random_over_suppression']:.2f}× as much"
  return [{"metric": f"suppression ({data['behaviour']})", "claim": "suppression",
           "ours": f"rate {before['rate']['mean']:.3g} → {edit['rate']['mean']:.3g} "
                   f"(−{100 * cut:.1f}%)", "note": note, "command": data["command"]}]


def suppression_other(data: dict) -> list[dict]:
  """Another behaviour's suppression: the same row, not the headline claim."""
  row = suppression(data)[0]
  del row["claim"]
  return [row]


def mc_eval(data: dict) -> list[dict]:
  """Controller gains in accuracy points, averaged over the synthetic and offline tasks (a
  group with no task is left out)."""
  rows = data["rows"]
  groups = {synthetic: [r for r in rows if r["task"].startswith("synthetic") == synthetic]
            for synthetic in (True, False)}

  def mean_delta(key: str, synthetic: bool) -> float:
    d = [r["delta"][key][0] for r in groups[synthetic]]
    return 100 * sum(d) / len(d)

  out = []
  for synthetic, name in ((True, "synthetic tasks"), (False, "offline lm-eval tasks")):
    n = len(groups[synthetic])
    if n:
      out.append({
          "metric": f"controllers, {name} ({n})",
          "ours": f"{mean_delta('prism+ctrl - prism', synthetic):+.2f} points "
                  f"(SAE controller {mean_delta('dense+sae_ctrl - dense', synthetic):+.2f})",
          "note": f"{name} ({n}): mean held-out accuracy change; tiny models",
          "command": data["command"]})
  if not out:
    raise ValueError("mc_eval results have no task rows")
  out[0]["claim"] = "controllers"
  quality = [f"{mean_delta('prism - dense', synthetic):+.2f} over the {len(groups[synthetic])} "
             f"{name}" for synthetic, name in ((False, "offline tasks"), (True, "synthetic"))
             if groups[synthetic]]
  out.append({"metric": "PRISM − dense accuracy", "claim": "quality",
              "ours": "points: " + ", ".join(quality),
              "note": "tiny models at equal tokens; the offline tasks are near chance",
              "command": data["command"]})
  return out


def throughput(data: dict) -> list[dict]:
  """PRISM/dense training tokens/s (process CPU time) of the current code, per config."""
  out = []
  for r in data["rows"]:
    if r["code"] == "new":
      loss = {"prism_paper": ", the paper's four loss terms"}.get(r.get("variant"), "")
      out.append({"metric": f"PRISM/dense train tokens/s, {r['config']}{loss} (CPU)",
                  "ours": round(r["ratio_cpu"], 3),
                  "note": f"{r['config']}, process CPU time; analytic {r['analytic']:.3f}",
                  "command": data["command"]})
  small = [o for o in out if o["metric"].endswith("small (CPU)")]
  (small or out)[0]["claim"] = "throughput"
  return out


def cards(data: dict) -> list[dict]:
  return [{"metric": f"prototype cards of the demo model (K {data['K']}) from the cache",
           "paper": "not reported",
           "ours": f"{data['cards_wall_s']:.1f} s wall; {data['cards_equal_brute_force']}/"
                   f"{data['K']} equal a brute-force ranking", "command": data["command"]}]


def cache_scale(data: dict) -> list[dict]:
  out = []
  for r in data["rows"]:
    if r["rank"] == 64:
      out.append({"metric": "attribution cache, rank 64, 0.5B / 10B tokens",
                  "paper": "not reported",
                  "ours": f"{r['store_GB_0.5B']:.0f} GB / {r['store_GB_10B']:.0f} GB "
                          f"({r['record_bytes_per_token']} bytes/token)",
                  "command": data["command"]})
  return out

def _scale_ratio(data: dict, preset: str):
  """The PRISM/dense ratio of `preset` (best over targets and remat), or None."""
  hits = [r for r in data["ratios"] if r["preset"] == preset]
  return max(hits, key=lambda r: r["prism_over_dense"]) if hits else None


def scale_table(data: dict) -> list[dict]:
  """Paper-vs-ours rows of benchmarks/scale_table.py: predicted PRISM/dense throughput."""
  out = []
  for name in ("small", "xl"):
    r = _scale_ratio(data, name)
    if r is not None:
      out.append({"metric": f"predicted PRISM/dense train tokens/s/chip, {name}, TPU roofline",
                  "paper": "97.3% (H200, XL, measured)" if name == "xl" else "not reported",
                  "ours": f"{100 * r['prism_over_dense']:.1f}%",
                  "note": f"{r['target']}, remat {'on' if r['remat'] else 'off'}: compiler "
                          "estimate, not a measurement",
                  "command": data["command"]})
  return out


def _gb(n: float) -> str:
  return f"{n / 1e9:.2f}"


def scale_table_markdown(data: dict) -> str:
  """The "Scale table" section's tables (between its markers in docs/RESULTS.md)."""
  chips = "; ".join(f"{k}: {v['source']}" for k, v in data["chips"].items())
  lines = [f"Compiler estimates, not measurements (commit `{data['commit'][:12]}`, "
           f"`{data['command']}`). Chip figures: {chips}.", "",
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

REHEARSAL_CHECKS = ("bank_set_from_data", "losses_finite", "losses_falling",
                    "resume_bit_exact", "preemption_same_step", "cache_equal_one_process",
                    "report_written")


def rehearsal(data: dict) -> list[dict]:
  """Paper-vs-ours row of experiments/rehearsal.py: the CPU pod rehearsal's checks."""
  c = data["checks"]
  passed = [k for k in REHEARSAL_CHECKS if c.get(k)]
  return [{"metric": f"CPU pod rehearsal ({data['config']} shape, {data['num_processes']} "
                     f"processes x {data['local_devices']} devices, gs://)",
           "paper": "not reported",
           "ours": f"{len(passed)}/{len(REHEARSAL_CHECKS)} checks pass, "
                   f"{data['total_s']:.0f} s",
           "command": data["command"]}]


def rehearsal_markdown(data: dict) -> str:
  """The "CPU pod rehearsal" section's tables (between its markers in docs/RESULTS.md)."""
  c = data["checks"]
  lines = [f"`{data['command']}` (commit `{data['commit'][:12]}`); overrides of the "
           f"`{data['config']}` recipe: `" + " ".join(data["overrides"]) + "`", "",
           "| stage | wall s |", "|---|---|"]
  lines += [f"| {k} | {v:.0f} |" for k, v in data["stages_s"].items()]
  lines += [f"| total | {data['total_s']:.0f} |", "", "| check | result |", "|---|---|"]
  details = {"bank_set_from_data": c.get("bank_init"),
             "losses_falling": ", ".join(f"{x:.3f}" for x in c.get("losses", [])),
             "resume_bit_exact": f"SIGTERM after step {c.get('sigterm_after_step')}, "
                                 f"resumed from checkpoint {c.get('resumed_from')}",
             "preemption_same_step": f"saved steps {c.get('preemption_saved_steps')}, exit "
                                     f"codes {c.get('preempted_exit_codes')}",
             "cache_equal_one_process": f"{c.get('cache_tokens')} tokens",
             "report_written": f"{c.get('report_bytes')} bytes of HTML, cards "
                               f"{'written' if c.get('cards') else 'missing'}"}
  for k in REHEARSAL_CHECKS:
    extra = details.get(k)
    lines.append(f"| {k} | {'yes' if c.get(k) else 'NO'}" + (f" ({extra})" if extra else "")
                 + " |")
  ev = c.get("eval", {})
  if ev:
    keys = [k for k in sorted(ev) if k in ("loss", "perplexity", "tokens")
            or k.startswith(("r1", "r2", "r_bar", "residual", "dead"))][:8]
    lines += ["", "Evaluation at the last step: "
              + ", ".join(f"{k} {ev[k]:.4g}" for k in keys) + "."]
  return "\n".join(lines)


# File stem -> reader; stems not listed must hold schema rows.
READERS: dict[str, Callable[[dict], list[dict]]] = {
    "suppression": suppression,
    "suppression_doctest": suppression_other,
    "mc_eval": mc_eval,
    "throughput": throughput,
    "cards": cards,
    "cache_scale": cache_scale,
    "scale_table": scale_table,
    "rehearsal": rehearsal,
}
# Variants recorded beside a headline file (other selections, the dense twin): detail in
# RESULTS.md's sections, not rows of the table.
DETAIL_PREFIXES = ("suppression_",)
# File stem -> (markdown of its own section, the marker name): reproduce.py writes it
# between `<!-- NAME:begin -->` and `<!-- NAME:end -->` in RESULTS.md.
SECTIONS: dict[str, tuple[Callable[[dict], str], str]] = {
    "scale_table": (scale_table_markdown, "scale_table"),
    "rehearsal": (rehearsal_markdown, "rehearsal"),
}
