"""docs/RESULTS.md's fresh-clone timings and their summary rows: `make demo` from
docs/results/demo_time*.json (benchmarks/demo_time.py; two layouts: one commit timed alone,
`stages_s`, issue 45's budget, or two commits side by side, `runs`, issue 53's ratio) and
`make test` from docs/results/suite_time.json (benchmarks/suite_time.py, issue 56's ratio).
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


def _ratio_row(target: str, data: dict, seconds) -> dict:
  """The summary row of `make TARGET` on fresh clones side by side: seconds(run) of each."""
  base, new = data["runs"]["baseline"], data["runs"]["commit"]
  return {"metric": f"make {target} on a fresh clone, install included (CPU), against "
                    f"{base['sha'][:7]} side by side", "paper": "not reported",
          "ours": f"{seconds(new):.0f} s vs {seconds(base):.0f} s: ratio {data['ratio']:.2f} "
                  f"(target ≤ {data['target_ratio']})", "command": data["command"]}


def demo_time_rows(data: dict) -> list[dict]:
  if "runs" in data:
    return [_ratio_row("demo", data, lambda run: run["total_s"])]
  return [{"metric": f"make demo on a fresh clone, install included (CPU, uv cache "
                     f"{data['uv_cache']['state']})",
           "paper": "not reported",
           "ours": f"{data['total_s'] / 60:.1f} min (uv cache {data['uv_cache']['state']}; "
                   f"budget {data['budget_s'] / 60:.0f} min)",
           "command": data["command"]}]


def _suite(part: dict | None) -> str:
  if not part:
    return "–"
  counts = ", ".join(f"{part[k]} {k}" for k in ("passed", "skipped", "failed") if k in part)
  return f"{part['wall_s']:.0f} s ({counts}; pytest {part.get('pytest_s', 0):.0f} s)"


def suite_time_markdown(data: dict) -> str:
  base, new = data["runs"]["baseline"], data["runs"]["commit"]
  lines = [f"`{data['command']}` (commit `{data['commit'][:12]}`), {data['machine']}; "
           f"{_cache(data)}; fresh clones, `make test` in one after the other (install, "
           "import contracts, bytecode, suite).", "",
           f"| target | baseline `{base['sha'][:7]}` | `{new['sha'][:7]}` |", "|---|---|---|",
           f"| make test | {_suite(base['test'])} | {_suite(new['test'])} |"]
  if "test_long" in new or "test_long" in base:
    lines.append(f"| make test-long | {_suite(base.get('test_long'))} | "
                 f"{_suite(new.get('test_long'))} |")
  lines += ["", f"make test ratio **{data['ratio']:.2f}** (target ≤ {data['target_ratio']}: "
                f"{'met' if data['within_target'] else 'NOT met'})."]
  return "\n".join(lines)


def suite_time_rows(data: dict) -> list[dict]:
  return [_ratio_row("test", data, lambda run: run["test"]["wall_s"])]
