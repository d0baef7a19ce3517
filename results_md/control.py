"""experiments.reproduce's readers of the control and evaluation experiments' results
(suppression, held-out suppression, multiple choice with controllers) and their sections'
renderers, and CAVEATS: what a recorded file cannot say about itself (the model or protocol
it measured has since been replaced), appended by its reader to its rows."""

from __future__ import annotations

# What a recorded file cannot say about itself: the model or protocol it measured has
# been replaced since (shown in its rows; the sections say the same).
CAVEATS = {
    "suppression": "issue 30's held-out protocol replaced it (selection texts held no "
                   "held-out word there; set size chosen on validation prompts): "
                   "suppression_heldout.json",
    "mc_eval": "measured on issue 11's round-1 tiny model (λ_proto 1, K 512), not today's "
               "default; not re-measured",
    "faithfulness": "issue 11's sweep at K 512; the demo's recipe (K 16384 on the "
                    "trained backbone) is demo_recipe_test.json",
    "cards": "on the demo model of issue 11's round 1: λ_proto 1, K 512",
    "rehearsal": "ran before train.revive_every existed, and its bank collapsed: section "
                 "'CPU pod rehearsal'",
    "cache_scale": "random-init `small`; build rate of this 2-core CPU under load",
}


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


def suppression_superseded(data: dict) -> list[dict]:
  """Issue 16's suppression: the same row, flagged as the protocol issue 30 replaced."""
  row = suppression(data)[0]
  del row["claim"]
  row["metric"] += ", issue 16's protocol (superseded)"
  row["note"] += "; " + CAVEATS["suppression"]
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
  dropped = sum(r.get("dropped_too_long", 0) for r in rows)
  caveat = CAVEATS["mc_eval"] + (f"; {dropped} items with an option too long for the "
                                 "context dropped (`--too_long=drop`, the default when it "
                                 "ran; today's default truncates)" if dropped else "")
  for row in out:
    row["note"] = f"{caveat}; {row['note']}"
  return out


def _ci(v: list[float], scale: float = 100, fmt: str = ".1f") -> str:
  return f"{scale * v[0]:{fmt}} [{scale * v[1]:{fmt}}, {scale * v[2]:{fmt}}]"


def mc_markdown(data: dict) -> str:
  """The multiple-choice section's table (held-out half, paired-bootstrap 95% CIs)."""
  dropped = sum(r.get("dropped_too_long", 0) for r in data["rows"])
  lines = [f"`{data['command']}` (commit `{data['commit'][:12]}`); {CAVEATS['mc_eval']}"
           + (f"; items with an option too long for the context dropped (`--too_long=drop`, "
              f"the default when it ran: {dropped} in all; today's default truncates)"
              if dropped else "") + ".", "",
           "| task | n eval (dropped) | chance | dense | PRISM | PRISM + controller | "
           "dense + SAE controller | Δ controller | Δ SAE controller | nnz w PRISM / SAE |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in data["rows"]:
    a, d = r["acc"], r["delta"]
    n = f"{r['n_eval']}" + (f" ({r['dropped_too_long']})" if r.get("dropped_too_long") else "")
    lines.append(f"| {r['task']} | {n} | {100 * r['chance']:.0f} | {_ci(a['dense'])} | "
                 f"{_ci(a['prism'])} | {_ci(a['prism+ctrl'])} | {_ci(a['dense+sae_ctrl'])} | "
                 f"{_ci(d['prism+ctrl - prism'])} | {_ci(d['dense+sae_ctrl - dense'])} | "
                 f"{r['prism_controller_nnz']} / {r['sae_controller_nnz']} |")
  return "\n".join(lines)


def heldout_markdown(data: dict) -> str:
  """The held-out suppression protocol's choice (validation prompts) and its one test
  measurement, CIs over prompts."""
  c, rows = data["choices"], data["rows"]
  base = c["validation_rows"][0]["base_rate"]
  lines = [f"`{data['command']}` (commit `{data['commit'][:12]}`)", "",
           f"Validation (the choice; rule: {c['rule']}):", "",
           f"| set | refill | selection-half rate (unedited {base:.3f}) | fall | neutral ppl |",
           "|---|---|---|---|---|"]
  for v in c["validation_rows"]:
    chosen = v["num"] == c["set_size"]["chosen"] and v["refill"] == c["refill"]["chosen"]
    cells = [str(v["num"]), "yes" if v["refill"] else "no", f"{v['rate']:.3f}",
             f"{100 * v['fall']:.1f}%", _pct(v["ppl_change"])]
    lines.append("| " + " | ".join(f"**{x}**" if chosen else x for x in cells) + " |")
  fall = lambda r: (f"{100 * r['rate_fall']['mean']:.1f}% [{100 * r['rate_fall']['lo']:.1f}, "
                    f"{100 * r['rate_fall']['hi']:.1f}]") if "rate_fall" in r else "-"
  rate = lambda r: f"{r['rate']['mean']:.3f} [{r['rate']['lo']:.3f}, {r['rate']['hi']:.3f}]"
  ppl = lambda r: "inf" if r["ppl"] == float("inf") else f"{r['ppl']:.3f} ({_pct(r['ppl_change'])})"
  lines += ["", f"Test, once ({len(data['protocol']['test']['prompts'])} prompts × "
            f"{data['protocol']['generations_per_prompt']} generations):", "",
            "| condition | held-out rate [95% CI over prompts] | fall [95% CI] | neutral ppl "
            "(change) | KL | argmax change |", "|---|---|---|---|---|---|"]
  rnd = [r for r in rows if r["condition"].startswith("random")]
  for r in rows:
    if r in rnd:
      continue
    lines.append(f"| {r['condition']} | {rate(r)} | {fall(r)} | {ppl(r)} | {r['kl']:.4f} | "
                 f"{100 * r['argmax_change']:.2f}% |")
  if rnd:
    span = lambda f: f"{min(map(f, rnd)):.3f}–{max(map(f, rnd)):.3f}"
    lines.append(f"| {len(rnd)} random sets of {rnd[0]['prototypes']} (range) | "
                 f"{span(lambda r: r['rate']['mean'])} | "
                 f"{min(100 * r['rate_fall']['mean'] for r in rnd):.1f}% to "
                 f"{max(100 * r['rate_fall']['mean'] for r in rnd):+.1f}% | "
                 f"{min(100 * r['ppl_change'] for r in rnd):+.1f}% to "
                 f"{max(100 * r['ppl_change'] for r in rnd):+.1f}% | "
                 f"{span(lambda r: r['kl'])} | "
                 f"{min(100 * r['argmax_change'] for r in rnd):.1f}–"
                 f"{max(100 * r['argmax_change'] for r in rnd):.1f}% |")
  return "\n".join(lines)
