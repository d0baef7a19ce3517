"""The explorer under load on loopback: latency of generate and decompose requests.

  python -m benchmarks.serve_load --workdir=runs/demo [--requests=64 --concurrency=16
      --new_tokens=16 --results_json=docs/results/serve_load.json]

Starts `prism serve`'s application on uvicorn (127.0.0.1, a free port) over the run, warms
its length buckets, then sends 8 requests one at a time (the unloaded latency) and
--requests at once (half generate, half decompose; prompts cut from validation rows), at
most --concurrency in flight. Every answer is checked (200; each token's slices + residual
= its logit); the compile count before and after shows whether anything recompiled.
Latencies are wall times on this machine's CPU (two cores shared with the client).
"""

import json
import time

import numpy as np
from absl import flags

from prism_jax.cli import flag_checks as check
from prism_jax.cli import launcher

flags.DEFINE_string("workdir", "runs/demo", "trained PRISM run")
flags.DEFINE_integer("requests", 64, "concurrent requests (half generate, half decompose)")
flags.DEFINE_integer("concurrency", 16, "requests in flight at most")
flags.DEFINE_integer("new_tokens", 16, "tokens per generate request")
flags.DEFINE_integer("seed", 0, "prompt choice")
flags.DEFINE_string("results_json", "docs/results/serve_load.json", "where the results go")
FLAGS = flags.FLAGS


def _jobs(explorer, num: int, rng) -> list[tuple[str, dict]]:
  rows = np.asarray(explorer.packed().rows("val")["tokens"])
  tok, jobs = explorer.run.tokenizer, []
  for n in range(num):
    row = rows[rng.integers(len(rows))]
    ids = [int(i) for i in row[:int(rng.integers(4, 25))] if i != tok.eos_id] or [int(row[0])]
    if n % 2:
      jobs.append(("decompose", {"ids": ids if len(ids) > 1 else ids * 2}))
    else:
      jobs.append(("generate", {"ids": ids, "max_new_tokens": FLAGS.new_tokens,
                                "seed": int(rng.integers(1000))}))
  return jobs


def _check(answers) -> None:
  for a in answers:
    if a["status"] != 200:
      raise RuntimeError(f"{a['kind']} answered {a['status']}: {a['answer']}")
    toks = a["answer"]["tokens"]
    for t in toks:
      total = sum(s["contrib"] for s in t["slices"]) + t["residual"]
      if abs(total - t["logit"]) > 1e-4 * max(1.0, abs(t["logit"])):
        raise RuntimeError(f"{a['kind']}: slices sum to {total}, logit {t['logit']}")


def main(argv):
  del argv
  check.at_least(1, requests=FLAGS.requests, concurrency=FLAGS.concurrency,
                 new_tokens=FLAGS.new_tokens)
  check.existing("workdir", FLAGS.workdir, "run directory")
  check.output_file("results_json", FLAGS.results_json)  # relative to the cwd
  from prism_jax import __version__  # pylint: disable=g-import-not-at-top
  from prism_jax.cli import provenance  # pylint: disable=g-import-not-at-top
  from prism_jax.serve import client, server  # pylint: disable=g-import-not-at-top
  t0 = time.perf_counter()
  app, explorer = server.build(FLAGS.workdir, do_warm=False)
  load_s = time.perf_counter() - t0
  warm_s = server.warm(explorer)
  compiles_warm = explorer.engine.compiles()
  rng = np.random.default_rng(FLAGS.seed)
  with server.running(app) as url:
    single = client.load_test(url, _jobs(explorer, 8, rng), concurrency=1)
    t0 = time.perf_counter()
    loaded = client.load_test(url, _jobs(explorer, FLAGS.requests, rng),
                              concurrency=FLAGS.concurrency)
    wall = time.perf_counter() - t0
  _check(single + loaded)
  by_kind = {}
  for kind in ("generate", "decompose"):
    by_kind[kind] = {
        "alone": client.percentiles([a["ms"] for a in single if a["kind"] == kind]),
        "loaded": client.percentiles([a["ms"] for a in loaded if a["kind"] == kind])}
  gen_tokens = sum(len(a["answer"]["tokens"]) for a in loaded if a["kind"] == "generate")
  m = explorer.mcfg
  out = {**provenance.record("benchmarks.serve_load"), "version": __version__,
         "model": f"d {m.d_model} x {m.n_layers}, K {m.num_prototypes}, k {m.k}, "
                  f"context {m.max_len}",
         "buckets": list(explorer.engine.buckets), "requests": FLAGS.requests,
         "concurrency": FLAGS.concurrency, "new_tokens": FLAGS.new_tokens,
         "load_s": load_s, "warm_s": warm_s, "compiles_after_warm": compiles_warm,
         "compiles_after_load": explorer.engine.compiles(), "loaded_wall_s": wall,
         "generated_tokens": gen_tokens, "all_answers_checked": True, "latency": by_kind}
  provenance.write_results(FLAGS.results_json, out)
  print(json.dumps({k: out[k] for k in ("compiles_after_warm", "compiles_after_load",
                                        "loaded_wall_s", "latency")}, indent=1))


if __name__ == "__main__":
  launcher.run(main)
