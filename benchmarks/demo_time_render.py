"""docs/RESULTS.md's "make demo on a fresh clone" lines and summary row, from
docs/results/demo_time*.json (benchmarks/demo_time.py). Two layouts: one commit timed alone
(`stages_s`, issue 45's budget) or two commits side by side (`runs`, issue 53's ratio).
Flag-free: experiments.reproduce imports it."""


def _cache(data: dict) -> str:
  cache = data["uv_cache"]
  return f"uv's package cache {cache['state']} ({cache['bytes'] / 1e9:.2f} GB at start)"


def demo_time_markdown(data: dict) -> str:
  if "runs" in data:
    return _side_by_side_markdown(data)
  lines = [f"`{data['command']}` (commit `{data['commit'][:12]}`), {data['machine']}; "
           f"{_cache(data)}.", "", "| stage | wall s |", "|---|---|"]
  lines += [f"| {k} | {v:.0f} |" for k, v in data["stages_s"].items()]
  lines += [f"| total | {data['total_s']:.0f} (budget {data['budget_s']}: "
            f"{'within' if data['within_budget'] else 'OVER'}) |"]
  return "\n".join(lines)


def _side_by_side_markdown(data: dict) -> str:
  base, new = data["runs"]["baseline"], data["runs"]["commit"]
  lines = [f"`{data['command']}` (commit `{data['commit'][:12]}`), {data['machine']}; "
           f"{_cache(data)}; fresh clones of both commits, stage by stage in turn.", "",
           f"| stage | baseline `{base['sha'][:7]}` wall s | `{new['sha'][:7]}` wall s | ratio |",
           "|---|---|---|---|"]
  for stage, t in new["stages_s"].items():
    lines.append(f"| {stage} | {base['stages_s'][stage]:.0f} | {t:.0f} | "
                 f"{t / base['stages_s'][stage]:.2f} |")
  lines.append(f"| total | {base['total_s']:.0f} | {new['total_s']:.0f} | "
               f"**{data['ratio']:.2f}** (target ≤ {data['target_ratio']}: "
               f"{'met' if data['within_target'] else 'NOT met'}) |")
  lines.append("")
  for label, run in (("baseline", base), ("this commit", new)):
    demo = run.get("demo", {})
    lines.append(f"- {label} `{run['sha'][:7]}`: demo val CE {demo.get('val_ce', 'n/a')}; "
                 f"RESIDUAL on {demo.get('residual_decided', '?')} of "
                 f"{demo.get('sample_tokens', '?')} sample tokens; faithfulness: "
                 f"{demo.get('faithfulness', 'n/a')}")
  return "\n".join(lines)


def demo_time_rows(data: dict) -> list[dict]:
  if "runs" in data:
    base, new = data["runs"]["baseline"], data["runs"]["commit"]
    return [{"metric": "make demo on a fresh clone, install included (CPU), against "
                       f"{base['sha'][:7]} side by side",
             "paper": "not reported",
             "ours": f"{new['total_s']:.0f} s vs {base['total_s']:.0f} s: ratio "
                     f"{data['ratio']:.2f} (target ≤ {data['target_ratio']})",
             "command": data["command"]}]
  return [{"metric": f"make demo on a fresh clone, install included (CPU, uv cache "
                     f"{data['uv_cache']['state']})",
           "paper": "not reported",
           "ours": f"{data['total_s'] / 60:.1f} min (uv cache {data['uv_cache']['state']}; "
                   f"budget {data['budget_s'] / 60:.0f} min)",
           "command": data["command"]}]
