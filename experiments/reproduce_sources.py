"""Readers that turn an experiment's own results JSON into experiments.reproduce's rows.

Each experiment writes its results in its own shape (docs/results/<topic>.json, with the
"command" that wrote it); a reader here picks the numbers the paper-vs-ours table shows.
A file with no reader must already hold schema rows (reproduce.py's docstring).
"""

from __future__ import annotations

from typing import Callable

from benchmarks.demo_time_render import demo_time_markdown, demo_time_rows
from benchmarks.scale_render import scale_table_markdown
from benchmarks.serve_render import serve_load_markdown, serve_load_rows
from experiments.prototype_path_md import (alive_markdown, alive_rows, capacity_markdown,
                                           capacity_rows, defaults_markdown, defaults_rows,
                                           lds_markdown, size_markdown, size_rows)


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


def _vs_chance(rows: list[dict], model: str) -> tuple[list[str], list[str]]:
  """(tasks where `model`'s 95% CI lies below chance, tasks where it lies above)."""
  below = [r["task"] for r in rows if r["acc"][model][2] < r["chance"]]
  above = [r["task"] for r in rows if r["acc"][model][1] > r["chance"]]
  return below, above


def _chance_text(rows: list[dict]) -> str:
  levels = sorted({100 * r["chance"] for r in rows})
  return (f"chance {levels[0]:.3g}–{levels[-1]:.3g}%" if len(levels) > 1
          else f"chance {levels[0]:.3g}%")


def controller_caveat(rows: list[dict], key: str, base: str) -> dict:
  """The mean Δ (points) of a controller over `rows`, the mean without the tasks where the
  base model's 95% CI lies below chance (an answer prior a controller can flip, not
  knowledge; None when there is none), and the caveat read off the rows: chance levels,
  those tasks, the per-task spread, the largest task's share of the mean."""
  d = {r["task"]: 100 * r["delta"][key][0] for r in rows}
  mean = sum(d.values()) / len(d)
  below, above = _vs_chance(rows, base)
  rest = [v for t, v in d.items() if t not in below]
  without = sum(rest) / len(rest) if below and rest else None
  lo, hi = min(d, key=d.get), max(d, key=d.get)
  top = max(d, key=lambda t: abs(d[t]))
  parts = [_chance_text(rows), f"{base} above chance (95% CI) on {len(above)} of {len(rows)}"]
  if below:
    parts.append(f"{base} below chance on {', '.join(below)}")
  parts += [f"per task {d[lo]:+.1f} ({lo}) to {d[hi]:+.1f} ({hi})",
            f"{top} contributes {d[top] / len(d):+.2f} of the {mean:+.2f}"]
  return {"mean": mean, "without": without, "below": below, "note": "; ".join(parts)}


def _with_without(c: dict) -> str:
  if c["without"] is None:
    return f"{c['mean']:+.2f} points"
  return (f"{c['mean']:+.2f} points, {c['without']:+.2f} without {', '.join(c['below'])} "
          "(base below chance)")


def suppression_heldout(data: dict) -> list[dict]:
  """The held-out protocol (experiments/suppress_heldout.py): the test prompts' rate before
  → after at the setting chosen on validation, CIs over prompts, and the baselines' falls."""
  rows = data["rows"]
  by = {r["condition"].split(" (")[0]: r for r in rows}
  before, edit = rows[0], rows[1]
  fall = lambda r: (f"{100 * r['rate_fall']['mean']:+.1f}% [{100 * r['rate_fall']['lo']:.1f}, "
                    f"{100 * r['rate_fall']['hi']:.1f}]") if "rate_fall" in r else "n/a"
  rnd = [r for r in rows if r["condition"].startswith("random")]
  c, test = data["choices"], data["protocol"]["test"]
  note = (f"chosen on validation ({c['set_size']['on']}): {c['set_size']['chosen']} prototypes, "
          f"refill {c['refill']['chosen']}; test: {len(test['prompts'])} prompts × "
          f"{data['protocol']['generations_per_prompt']}, CIs over prompts; neutral perplexity "
          f"{_pct(edit['ppl_change'])}; logit signature {fall(by['logit signature'])}; token "
          f"ban {fall(by['token ban'])} (ppl {_pct(by['token ban']['ppl_change'])})")
  if rnd and data.get("random_over_suppression") is not None:
    note += (f"; {len(rnd)} random sets: rate moved {data['random_over_suppression']:.2f}× as "
             "much")
  return [{"metric": f"suppression, held-out protocol ({data['behaviour']})",
           "ours": f"rate {before['rate']['mean']:.3g} [{before['rate']['lo']:.3g}, "
                   f"{before['rate']['hi']:.3g}] → {edit['rate']['mean']:.3g} "
                   f"[{edit['rate']['lo']:.3g}, {edit['rate']['hi']:.3g}] (fall {fall(edit)})",
           "note": note, "command": data["command"]}]


def suppression_heldout_headline(data: dict) -> list[dict]:
  row = suppression_heldout(data)[0]
  row["claim"] = "suppression"
  return [row]


def mc_eval(data: dict) -> list[dict]:
  """Controller gains in accuracy points, averaged over the synthetic and offline tasks (a
  group with no task is left out), with and without the tasks whose base model is below
  chance, each with its caveats derived from the rows."""
  rows = data["rows"]
  groups = {synthetic: [r for r in rows if r["task"].startswith("synthetic") == synthetic]
            for synthetic in (True, False)}
  out = []
  for synthetic, name in ((True, "synthetic tasks"), (False, "offline lm-eval tasks")):
    group = groups[synthetic]
    if not group:
      continue
    ctrl = controller_caveat(group, "prism+ctrl - prism", "prism")
    ours, note = _with_without(ctrl), f"{name}, held-out accuracy: {ctrl['note']}"
    sae = [r for r in group if "dense+sae_ctrl - dense" in r["delta"]]
    if sae:
      c = controller_caveat(sae, "dense+sae_ctrl - dense", "dense")
      ours += f"; SAE controller {_with_without(c)}"
      note += f"; SAE controller: {c['note'].split('; ', 2)[-1]}"
    out.append({"metric": f"controllers, {name} ({len(group)})", "ours": ours, "note": note,
                "command": data["command"]})
  if not out:
    raise ValueError("mc_eval results have no task rows")
  out[0]["claim"] = "controllers"
  quality, notes = [], []
  for synthetic, name in ((False, "offline tasks"), (True, "synthetic")):
    group = groups[synthetic]
    if not group:
      continue
    d = [100 * r["delta"]["prism - dense"][0] for r in group]
    quality.append(f"{sum(d) / len(d):+.2f} over the {len(group)} {name}")
    below, above = _vs_chance(group, "dense")
    notes.append(f"{name}: {_chance_text(group)}, dense above chance (95% CI) on {len(above)} "
                 f"of {len(group)}" + (f", below on {', '.join(below)}" if below else ""))
  out.append({"metric": "PRISM − dense accuracy", "claim": "quality",
              "ours": "points: " + ", ".join(quality), "note": "; ".join(notes),
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


def _ratio_at(r: dict) -> str:
  return (f"{100 * r['prism_over_dense']:.1f}% ({r['target']}, "
          f"remat {'on' if r['remat'] else 'off'})")


def scale_table(data: dict) -> list[dict]:
  """Paper-vs-ours rows of benchmarks/scale_table.py: predicted PRISM/dense throughput of a
  preset as the range over its targets and remat settings (not the best one alone)."""
  out = []
  for name in ("small", "xl"):
    hits = sorted((r for r in data["ratios"] if r["preset"] == name),
                  key=lambda r: r["prism_over_dense"])
    if not hits:
      continue
    ours = _ratio_at(hits[0])
    if len(hits) > 1:
      ours += f" to {_ratio_at(hits[-1])}"
    out.append({"metric": f"predicted PRISM/dense train tokens/s/chip, {name}, TPU roofline",
                "paper": "97.3% (H200, XL, measured)" if name == "xl" else "not reported",
                "ours": ours,
                "note": f"lowest to highest of {len(hits)} target x remat rows: compiler "
                        "estimates, not measurements",
                "command": data["command"]})
  return out


def hessian_block(data: dict) -> list[dict]:
  """The row of experiments/hessian.py --workdir: one exact Hessian block of a trained bank."""
  return [{"metric": f"one exact D x D Hessian block of a trained bank (K {data['K']}, "
                     f"D {data['D']}, {data['tokens']} tokens), {data['D']} HVPs",
           "paper": "not reported",
           "ours": (f"{data['cpu_seconds_ii']:.1f} CPU-s with compilation, "
                    f"{data['cpu_seconds_ij']:.1f} compiled; cosine with K-FAC "
                    f"{data['cosine_ii']:.3f} (i, i), {data['cosine_ij']:.3f} (i, j)"),
           "note": "RESULTS 'One exact Hessian block'; CPU time: the box was shared",
           "command": data["command"]}]


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


def capacity_seed_rows(data: dict) -> list[dict]:
  """The capacity sweep's k 8 column repeated over seeds: agreement per K, every seed."""
  out = []
  for backbone, per_setting in data["results"].items():
    parts = [f"K {setting.split(':')[0]}: " + " / ".join(
        f"{100 * r['agreement']:.1f}%" for _, r in sorted(per_seed.items()))
        for setting, per_seed in per_setting.items()]
    out.append({"metric": f"bank capacity {backbone}, frozen twin, k 8, seeds "
                          f"{', '.join(sorted(next(iter(per_setting.values()))))}",
                "paper": "not reported", "ours": "agreement " + "; ".join(parts),
                "command": data["command"]})
  return out


def repeat_markdown(data: dict) -> str:
  """experiments/repeat_test.py: a test's runs in a row beside busy cores."""
  walls = [r["wall_s"] for r in data["runs"]]
  failed = [r["run"] for r in data["runs"] if not r["passed"]]
  return (f"`{data['command']}` (commit `{data['commit'][:12]}`): **{data['passed']} of "
          f"{data['times']} passed** in a row beside {data['busy_processes']} spinning "
          f"core(s); wall {min(walls):.0f}-{max(walls):.0f} s per run"
          + (f"; failed runs: {failed}" if failed else "") + ".")


def repeat_rows(data: dict) -> list[dict]:
  return [{"metric": f"{data['test'].split('::')[-1]} beside a busy core",
           "paper": "not reported", "ours": f"{data['passed']}/{data['times']} passed",
           "command": data["command"]}]


# File stem -> reader; stems not listed must hold schema rows.
READERS: dict[str, Callable[[dict], list[dict]]] = {
    # the held-out protocol's planted row answers the claim; issue 16's run stays a row
    "suppression": suppression_other,
    "suppression_heldout": suppression_heldout_headline,
    "suppression_heldout_doctest": suppression_heldout,
    "suppression_doctest": suppression_other,
    "mc_eval": mc_eval,
    "throughput": throughput,
    "cards": cards,
    "cache_scale": cache_scale,
    "scale_table": scale_table,
    "rehearsal": rehearsal,
    "hessian_block": hessian_block,
    "bank_capacity_128x4": capacity_rows,
    "bank_capacity_256x6": capacity_rows,
    "size_trend": size_rows,
    "prototype_defaults": defaults_rows,
    "bank_alive": alive_rows,
    "serve_load": serve_load_rows,
    "demo_time": demo_time_rows,
    "demo_time_cold": demo_time_rows,
    "preemption_repeat": repeat_rows,
    "bank_capacity_128x4_seeds": capacity_seed_rows,
}
# Variants recorded beside a headline file (other selections, the dense twin): detail in
# RESULTS.md's sections, not rows of the table.
DETAIL_PREFIXES = ("suppression_", "lds_")
# File stem -> (markdown of its own section, the marker name): reproduce.py writes it
# between `<!-- NAME:begin -->` and `<!-- NAME:end -->` in RESULTS.md.
SECTIONS: dict[str, tuple[Callable[[dict], str], str]] = {
    "scale_table": (scale_table_markdown, "scale_table"),
    "rehearsal": (rehearsal_markdown, "rehearsal"),
    "bank_capacity_128x4": (capacity_markdown, "prototype_path_capacity_128x4"),
    "bank_capacity_256x6": (capacity_markdown, "prototype_path_capacity_256x6"),
    "prototype_defaults": (defaults_markdown, "prototype_path_test"),
    "size_trend": (size_markdown, "prototype_path_size"),
    "bank_alive": (alive_markdown, "prototype_path_alive"),
    "serve_load": (serve_load_markdown, "serve_load"),
    "demo_time": (demo_time_markdown, "demo_time"),
    "demo_time_cold": (demo_time_markdown, "demo_time_cold"),
    "lds_default_k128": (lds_markdown, "prototype_path_lds_k128"),
    "lds_default_k512": (lds_markdown, "prototype_path_lds_k512"),
    "preemption_repeat": (repeat_markdown, "preemption_repeat"),
    "bank_capacity_128x4_seeds": (capacity_markdown, "prototype_path_capacity_seeds"),
}
