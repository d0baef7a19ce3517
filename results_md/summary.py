"""The opening summary of docs/RESULTS.md: PRISM.md §7's headline claims and the issues'
targets, each read from the results JSON that measured it (experiments.reproduce writes it
between `<!-- summary:begin -->` and `<!-- summary:end -->`).

A claim no JSON answers shows no number: "not measured", or where its hand-recorded number
is. A row whose JSON is missing from the results directory says so.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Callable

from results_md import control
from results_md import sources

BEGIN, END = "<!-- summary:begin -->", "<!-- summary:end -->"


def _pct(x: float, sign: bool = False) -> str:
  return f"{100 * x:+.1f}%" if sign else f"{100 * x:.1f}%"


def _seeds(per_seed: dict, fmt: Callable[[dict], str]) -> str:
  return " / ".join(fmt(r) for r in per_seed.values())


def _verdict(ok: bool) -> str:
  return "met" if ok else "**missed**"


def quality_accuracy(d: dict) -> str:
  row = next(r for r in control.mc_eval(d) if r.get("claim") == "quality")
  offline = [r for r in d["rows"] if not r["task"].startswith("synthetic")]
  below, above = control._vs_chance(offline, "dense")  # pylint: disable=protected-access
  return (f"PRISM − dense, in points: {row['ours'].removeprefix('points: ')}; dense above "
          f"chance on {len(above)} of {len(offline)} offline tasks; "
          f"{control.CAVEATS['mc_eval']}; too-long items dropped (`--too_long=drop`)")


def ce_gap_size(d: dict) -> str:
  parts = [f"{_pct(r['ce_gap'], True)} at {r['backbone']}" for r in d["rows"]]
  met = [r["backbone"] for r in d["rows"] if r["ce_gap"] <= 0.02]
  return (f"{', '.join(parts)} (K:k {d['setting']} from scratch, {d['half']} half): "
          + (f"met at {', '.join(met)}" if met else "**missed**"))


def throughput(d: dict, runs: list[dict]) -> str:
  small = lambda data: next(r for r in data["rows"] if r["config"] == "small"
                            and r["code"] == "new")
  r = small(d)
  ratios = [small(x)["ratio_cpu"] for x in [d] + runs
            if any(y["config"] == "small" for y in x["rows"])]
  return (f"**CPU** (this 2-core box, process time; the paper's is an H200 at XL): `small` at "
          f"batch {r['batch']} x {r['seq_len']}, {r['ratio_cpu']:.3f} in the recorded run "
          f"({r['steps']} timed steps per model), {min(ratios):.3f}–{max(ratios):.3f} over "
          f"the round's {len(ratios)} runs; analytic FLOP ratio {r['analytic']:.3f}")


def throughput_tpu(d: dict) -> str:
  row = next(r for r in sources.scale_table(d) if ", xl," in r["metric"])
  return f"compiler estimates, not measurements: xl {row['ours']}"


def _num(key: str, fmt: str = ".3f") -> Callable[[dict], str]:
  return lambda r: format(r[key], fmt)


def _lds_rows(d: dict) -> dict:
  return {r["metric"]: r for r in d["rows"]}


def retention(d: dict) -> str:
  r = next(r for r in d["rows"] if "retention" in r["metric"])
  big_k = d["config"]["model"]["num_prototypes"]
  return (f"top-100 retention {_pct(r['ours'])} [{_pct(r['ci'][0])}, {_pct(r['ci'][1])}] "
          f"({r['note']}; the LDS recipe's model at K {big_k})")


def lds(d: dict) -> str:
  rows = _lds_rows(d)
  ceiling = next(r for m, r in rows.items() if "ceiling" in m)
  big_k = d["config"]["model"]["num_prototypes"]
  return (f"cached PRISM {rows['LDS (prism)']['ours']:.3f}, EK-FAC "
          f"{rows['LDS (ekfac)']['ours']:.3f}, grad-dot {rows['LDS (grad_dot)']['ours']:.3f}, "
          f"noise ceiling {ceiling['ours']:.3f} (LDS recipe at K {big_k}): EK-FAC ahead")


def controllers(d: dict) -> str:
  rows = {r["metric"].split(" (")[0]: r for r in control.mc_eval(d)}
  syn, off = rows.get("controllers, synthetic tasks"), rows.get("controllers, offline "
                                                                 "lm-eval tasks")
  parts = []
  if syn:
    parts.append(f"synthetic tasks (models above chance): {syn['ours']}")
  if off:
    parts.append(f"offline tasks (models at chance): {off['ours']}")
  return "; ".join(parts) + f"; {control.CAVEATS['mc_eval']}; too-long items dropped"


def suppression(d: dict) -> str:
  row = control.suppression_heldout(d)[0]
  c = d["choices"]
  return (f"{d['behaviour']} behaviour, held-out protocol, test prompts: {row['ours']} with "
          f"{c['set_size']['chosen']} prototypes, neutral perplexity "
          f"{_pct(d['rows'][1]['ppl_change'], True)}")


def frozen_bank(d: dict) -> str:
  row = sources.capacity_rows(d)[0]
  return (f"{row['ours']} (bank alone on a frozen d {next(iter(d['results']))} twin, "
          f"{d['half']} half): decisive and CE ratio met, agreement **missed**")


def alive(cut: dict, trained: dict, auto: dict) -> str:
  """The bank set on a young backbone (the rehearsal's cut), on a trained one, and where the
  recipe's own timing (train.proto_init_step=auto) sets it: the verdict is the recipe's."""
  def part(d):
    runs = d["runs"]
    first = next(iter(runs.values()))
    return (f"bank set at step {first['init_step']} of {first['steps']}: "
            + ", ".join(f"{name} {_pct(r['alive_frac'])}" for name, r in runs.items()))
  r = auto["runs"]["auto"]
  return (f"{part(cut)}; {part(trained)}; the recipe's auto timing set it at step "
          f"{r['init_step']} of {r['steps']}: {_pct(r['alive_frac'])}: "
          + _verdict(r["alive_frac"] >= 0.95))


def attribution_speed(small: dict, large: dict) -> str:
  """Cached PRISM's per-query speed against EK-FAC's (all queries in one EK-FAC pass), and
  their peak RSS, at the pinned recipe and the larger model (experiments.lds_costs)."""
  def part(d):
    p, e = d["costs"]["prism"], d["costs"]["ekfac"]
    return (f"{e['per_query_s'] / p['per_query_s']:.0f}× at {p['num_rows']} rows "
            f"({p['peak_rss_bytes'] / 2 ** 20:.0f} vs {e['peak_rss_bytes'] / 2 ** 20:.0f} MiB)")
  return (f"cached PRISM vs EK-FAC per query: {part(small)} on the LDS recipe (d 64 × 2), "
          f"{part(large)} at d 128 × 4 (EK-FAC's {large['costs']['ekfac']['num_queries']} "
          "queries in one pass; LDS beside it in 'Cost beside quality')")


def rehearsal(d: dict) -> str:
  c = d["checks"]
  passed = sum(bool(c.get(k)) for k in sources.REHEARSAL_CHECKS)
  ev, losses = c.get("eval", {}), c.get("losses", [])
  big_k = int(ev["dead_prototypes"] / ev["dead_frac"]) if ev.get("dead_frac") else None
  spike = max(range(len(losses)), key=losses.__getitem__) if losses else None
  text = f"{passed}/{len(sources.REHEARSAL_CHECKS)} checks pass in {d['total_s']:.0f} s"
  if big_k:
    text += (f"; the bank collapsed: {ev['dead_prototypes']:,.0f} of {big_k:,} prototypes "
             f"unselected on {ev['tokens']:,.0f} val tokens (ran before revival existed)")
  if spike is not None:
    text += f"; a loss spike at step {spike + 1} ({losses[spike]:.2f})"
  return text


def demo_time(d: dict, cold: dict) -> str:
  within = d["within_budget"] and cold["within_budget"]
  return (f"{d['total_s']:.0f} s with uv's cache warm, {cold['total_s']:.0f} s cold (install "
          f"included, {d['machine']}): " + _verdict(within))


def _demo_rows(d: dict) -> dict:
  """demo_recipe_test.json's adopted recipe (the candidate that is not the old default)."""
  name = next(n for n in d["rows"] if n != "today")
  return name, d["rows"][name]["seeds"]


def ce_gap_demo(d: dict) -> str:
  name, rows = _demo_rows(d)
  return (f"{_seeds(rows, lambda r: _pct(r['ce_gap'], True))} (the demo preset, {name}, "
          f"{d['half']} half, seeds {', '.join(rows)}; the backbone trains 580 of 600 steps, "
          "the bank the last 20 on it frozen): "
          + _verdict(max(r["ce_gap"] for r in rows.values()) <= 0.02))


def grounding_demo(d: dict) -> str:
  _, rows = _demo_rows(d)
  low = min(min(r["r1_bar"], r["r2_bar"]) for r in rows.values())
  return (f"R̄1 {_seeds(rows, _num('r1_bar'))}, R̄2 {_seeds(rows, _num('r2_bar'))} (the demo "
          f"preset, {d['half']} half): " + ("within" if low >= 0.94 else "below")
          + " 0.94–1.00; issue 44's ≥ 0.9: " + _verdict(low >= 0.9))


def faithfulness_demo(d: dict) -> str:
  _, rows = _demo_rows(d)
  pct = lambda key: lambda r: _pct(r[key])
  demo = all(r["agreement"] >= 0.7 and r["agreement_decisive"] >= 0.97
             and r["proto_ce_ratio"] <= 1.05 for r in rows.values())
  paper = all(r["agreement"] >= 0.9 for r in rows.values())
  return (f"agreement {_seeds(rows, pct('agreement'))}, decisive "
          f"{_seeds(rows, pct('agreement_decisive'))}, CE(W ẑ)/CE(W z) "
          f"{_seeds(rows, _num('proto_ce_ratio'))} (the demo preset, {d['half']} half): "
          f"issue 53's ≥ 70% / 97% / 1.05: {_verdict(demo)}; agreement ≥ 90%: "
          + _verdict(paper))


def demo_time_ratio(d: dict) -> str:
  if "runs" not in d:
    return demo_time(d, d)
  base, new = d["runs"]["baseline"], d["runs"]["commit"]
  return (f"{new['total_s']:.0f} s vs {base['total_s']:.0f} s for {base['sha'][:7]}, side by "
          f"side on one box ({d['machine']}, install included): ratio {d['ratio']:.2f}: "
          + _verdict(d["within_target"]))


def suite_time_ratio(d: dict) -> str:
  base, new = d["runs"]["baseline"], d["runs"]["commit"]
  longer = new.get("test_long")
  return (f"{new['test']['wall_s']:.0f} s vs {base['test']['wall_s']:.0f} s for "
          f"{base['sha'][:7]}, side by side on one box ({d['machine']}, install included): "
          f"ratio {d['ratio']:.2f}: " + _verdict(d["within_target"])
          + (f"; make test-long {longer['wall_s']:.0f} s" if longer else ""))


def serve(d: dict) -> str:
  return sources.serve_load_rows(d)[0]["ours"]


def preemption(d: dict) -> str:
  return f"{d['passed']} of {d['times']} passed in a row beside {d['busy_processes']} busy core"


def retrofit(d: dict) -> str:
  per = lambda name: {s: runs[name] for s, runs in d["results"].items()}
  frozen, scratch, full = per("frozen"), per("scratch"), per("full")
  return (f"frozen backbone: CE = the dense twin's by construction, agreement "
          f"{_seeds(frozen, lambda r: _pct(r['agreement']))} (scratch "
          f"{_seeds(scratch, lambda r: _pct(r['agreement']))}); fully trained: CE "
          f"{_seeds(full, lambda r: _pct(r['vs_dense'], True))} vs the twin with 550 more "
          "backbone steps (unequal compute)")


def multihost(d: dict) -> str:
  return f"{d['rows'][0]['ours']} ({d['num_tokens']:,} tokens)"


def packing(d: dict) -> str:
  peaks = [max(r["peak_rss_mb_process"], r["peak_rss_mb_worker"]) for r in d["runs"]]
  return "peaks (process / worker) " + "; ".join(
      f"{r['peak_rss_mb_process']:.0f} / {r['peak_rss_mb_worker']:.0f} MB at "
      f"{r['text_gb']:g} GB of text" for r in d["runs"]) + ": " + _verdict(max(peaks) <= 512)


def cards(d: dict) -> str:
  return (f"{d['cards_wall_s']:.1f} s wall, {d['cards_equal_brute_force']}/{d['K']} equal a "
          f"brute-force ranking, {control.CAVEATS['cards']}: "
          + _verdict(d["cards_wall_s"] <= d["budget_s"]
                     and d["cards_equal_brute_force"] == d["K"]))


# (claim, target, results files it reads (stems; a glob for detail runs), how it reads them);
# no files: the text says where the number is, if anywhere.
SUMMARY: tuple = (
    ("scale (§7)", "130M–1.6B params, up to 50B tokens", (),
     "not measured (the GPT-2 presets here are compile-only estimates: 'Scale table')"),
    ("quality vs dense, downstream accuracy (§7)", "within 2.5 points of dense (average)",
     ("mc_eval",), quality_accuracy),
    ("quality vs dense, val CE at equal tokens (issues 44, 53)", "≤ +2%", ("demo_recipe_test",),
     ce_gap_demo),
    ("the same against backbone size (issue 44)", "≤ +2%", ("size_trend",), ce_gap_size),
    ("parameter overhead (§7)", "1.7% at XL", (),
     "no results JSON: analytic, printed by `prism model-card` ('Model card')"),
    ("training throughput (§7)", "97.3% of dense (paper: H200, XL)",
     ("throughput", "throughput_runs/round4_*"), throughput),
    ("training throughput on TPU, predicted (issue 26)", "97.3% (paper: H200, XL)",
     ("scale_table",), throughput_tpu),
    ("grounding (§7)", "R̄1, R̄2 in 0.94–1.00", ("demo_recipe_test",), grounding_demo),
    ("attribution speed (§7)", "~470× EK-FAC at equal memory (124M)",
     ("lds_costs_k128", "lds_costs_d128x4"), attribution_speed),
    ("attribution signal (§7)", "~80% of top-ranked sequences kept", ("lds_default_k512",),
     retention),
    ("counterfactual attribution, LDS (issues 17, 30, 44)", "measured with a noise ceiling",
     ("lds_default_k512",), lds),
    ("controllers (§7)", "+2.72 points (SAE controller +0.32)", ("mc_eval",), controllers),
    ("suppression (§7)", "NSFW 0.668 → 0.154 with 86 prototypes", ("suppression_heldout",),
     suppression),
    ("faithfulness of the demo's model (issues 11, 44, 53)", "agreement ≥ 90% (issue 53: ≥ "
     "70%), decisive ≥ 97%, CE ratio ≤ 1.05", ("demo_recipe_test",), faithfulness_demo),
    ("faithfulness of a frozen-backbone bank (issue 44)", "the same", ("bank_capacity_128x4",),
     frozen_bank),
    ("`small`-shape bank alive (issues 44, 53)", "≥ 95% of prototypes selected (issue 53: at "
     "the recipe's defaults)", ("bank_alive", "bank_alive_trained", "bank_alive_auto"), alive),
    ("CPU pod rehearsal, `small` shape (issue 26)", "every stage and check passes",
     ("rehearsal",), rehearsal),
    ("`make demo` from a fresh clone (issues 45, 53)", "≤ 0.6 × 14df241's, side by side",
     ("demo_time",), demo_time_ratio),
    ("`make test` from a fresh clone (issue 56)", "≤ 0.7 × 14df241's, side by side",
     ("suite_time",), suite_time_ratio),
    ("explorer under load (issue 48)", "reported; no recompiles", ("serve_load",), serve),
    ("2-process preemption test under load (issue 46)", "passes every time",
     ("preemption_repeat",), preemption),
    ("retrofit on a trained dense twin (issue 29)", "reported", ("retrofit",), retrofit),
    ("multi-host attribution cache (issue 19)", "equals the 1-process build",
     ("cache_multihost",), multihost),
    ("packing memory (issue 28)", "≤ 512 MB per process and worker", ("bench_pack",), packing),
    ("prototype cards from the cache (issue 14)", "≤ 60 s, equal to brute force", ("cards",),
     cards),
)


def _load(results_dir: str, stem: str) -> list[tuple[str, dict]]:
  paths = sorted(glob.glob(os.path.join(results_dir, stem + ".json")))
  out = []
  for path in paths:
    with open(path) as f:
      out.append((os.path.relpath(path, results_dir), json.load(f)))
  return out


def _source(name: str, data: dict) -> str:
  commit = data.get("commit") or next(
      (r.get("commit") for r in data.get("rows", []) if isinstance(r, dict)), None)
  return f"{name} (`{commit[:12]}`)" if commit else name


def summary(results_dir: str) -> str:
  lines = ["| claim | target | ours (from the results JSON) | source: docs/results/ (commit) |",
           "|---|---|---|---|"]
  cell = lambda text: str(text).replace("|", "\\|").replace("\n", " ")
  for claim, target, stems, read in SUMMARY:
    if not stems:
      lines.append(f"| {cell(claim)} | {cell(target)} | {cell(read)} | – |")
      continue
    loaded = [_load(results_dir, s) for s in stems]
    if not loaded[0] or any(not x for x, s in zip(loaded, stems) if "*" not in s):
      lines.append(f"| {cell(claim)} | {cell(target)} | not measured (no "
                   f"{', '.join(s + '.json' for s in stems)} here) | – |")
      continue
    args = [[d for _, d in x] if "*" in s else x[0][1] for x, s in zip(loaded, stems)]
    names = [_source(n, d) if "*" not in s else f"{s}.json"
             for x, s in zip(loaded, stems) for n, d in (x if "*" not in s else x[:1])]
    lines.append(f"| {cell(claim)} | {cell(target)} | {cell(read(*args))} | "
                 f"{cell(', '.join(names))} |")
  return "\n".join(lines)
