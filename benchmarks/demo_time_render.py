"""docs/RESULTS.md's "make demo on a fresh clone" lines and summary row, from
docs/results/demo_time.json (benchmarks/demo_time.py). Flag-free: experiments.reproduce
imports it."""


def demo_time_markdown(data: dict) -> str:
  cache = data["uv_cache"]
  lines = [f"`{data['command']}` (commit `{data['commit'][:12]}`), {data['machine']}; uv's "
           f"package cache {cache['state']} ({cache['bytes'] / 1e9:.2f} GB at start).", "",
           "| stage | wall s |", "|---|---|"]
  lines += [f"| {k} | {v:.0f} |" for k, v in data["stages_s"].items()]
  lines += [f"| total | {data['total_s']:.0f} (budget {data['budget_s']}: "
            f"{'within' if data['within_budget'] else 'OVER'}) |"]
  return "\n".join(lines)


def demo_time_rows(data: dict) -> list[dict]:
  return [{"metric": f"make demo on a fresh clone, install included (CPU, uv cache "
                     f"{data['uv_cache']['state']})",
           "paper": "not reported",
           "ours": f"{data['total_s'] / 60:.1f} min (uv cache {data['uv_cache']['state']}; "
                   f"budget {data['budget_s'] / 60:.0f} min)",
           "command": data["command"]}]
