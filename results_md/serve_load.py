"""docs/RESULTS.md's "Explorer under load" section and its summary row, from
docs/results/serve_load.json (benchmarks/serve_load.py). Flag-free: experiments.reproduce
imports it."""


def _ms(p: dict) -> str:
  return f"{p['p50_ms']:.0f} / {p['p95_ms']:.0f}"


def serve_load_markdown(data: dict) -> str:
  lat = data["latency"]
  lines = [f"`{data['command']}` (commit `{data['commit'][:12]}`); model {data['model']}, "
           f"length buckets {data['buckets']}; {data['requests']} requests at once (half "
           f"generate of {data['new_tokens']} tokens, half decompose), at most "
           f"{data['concurrency']} in flight, over loopback on this machine's CPU (2 cores, "
           "client included).", "",
           "| request | alone p50 / p95 ms | under load p50 / p95 ms |", "|---|---|---|"]
  for kind in ("generate", "decompose"):
    lines.append(f"| {kind} | {_ms(lat[kind]['alone'])} | {_ms(lat[kind]['loaded'])} |")
  lines += ["", f"Programs compiled: {data['compiles_after_warm']} at warm-up "
                f"({data['warm_s']:.1f} s, every bucket), {data['compiles_after_load']} after "
                f"the load ({'none' if data['compiles_after_load'] == data['compiles_after_warm'] else 'SOME'}"
                f" recompiled). All {data['requests'] + 8} answers checked (status 200; each "
                f"token's slices + residual = its logit); the loaded batch took "
                f"{data['loaded_wall_s']:.1f} s for {data['generated_tokens']} generated "
                "tokens. Requests share one model thread, so latency under load is mostly "
                "queueing."]
  return "\n".join(lines)


def serve_load_rows(data: dict) -> list[dict]:
  lat = data["latency"]
  return [{"metric": "explorer (prism serve) under load, CPU",
           "paper": "not reported",
           "ours": f"{data['requests']} concurrent requests: generate p50/p95 "
                   f"{_ms(lat['generate']['loaded'])} ms, decompose "
                   f"{_ms(lat['decompose']['loaded'])} ms; "
                   f"{data['compiles_after_load'] - data['compiles_after_warm']} recompiles",
           "command": data["command"]}]
