"""`make demo` on a fresh clone, timed by stage: install, train + sample, report.

  python -m benchmarks.demo_time [--results_json=docs/results/demo_time.json]

Clones this repository's HEAD into a temporary directory and runs the demo target's three
stages there as `make demo` does: the library's install (`make .venv/.installed-base`,
uv, requirements/lock.txt), `prism demo`, `prism report`. Wall times on this machine; the
package cache's state (uv's, warm when it already holds the wheels) is recorded with them.
"""

import json
import os
import shutil
import subprocess
import tempfile
import time

from absl import flags

from benchmarks import flag_checks as check
from prism_jax.cli import launcher

flags.DEFINE_string("results_json", "docs/results/demo_time.json", "where the results go")
FLAGS = flags.FLAGS
BUDGET_S = 180  # issue 45: a fresh clone's `make demo`, install included


def _uv_cache() -> dict:
  path = os.environ.get("UV_CACHE_DIR") or os.path.expanduser("~/.cache/uv")
  size = 0
  for root, _, files in os.walk(path):
    size += sum(os.path.getsize(os.path.join(root, f)) for f in files
                if os.path.isfile(os.path.join(root, f)))
  return {"path": path, "bytes": size, "state": "warm" if size > 100e6 else "cold"}


def main(argv):
  del argv
  # written after minutes of cloning, installing and training; relative to the cwd
  check.output_file("results_json", FLAGS.results_json)
  from prism_jax.cli import provenance  # pylint: disable=g-import-not-at-top
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  cache = _uv_cache()
  tmp = tempfile.mkdtemp(prefix="demo_time_")
  try:
    clone = os.path.join(tmp, "p")
    subprocess.run(["git", "clone", "-q", repo, clone], check=True)
    stages = [("install", ["make", "-s", ".venv/.installed-base"]),
              ("train + sample", [".venv/bin/prism", "demo"]),
              ("report", [".venv/bin/prism", "report", "--workdir=runs/demo",
                          "--prompt=The for statement"])]
    times = {}
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for name, cmd in stages:
      t0 = time.perf_counter()
      res = subprocess.run(cmd, cwd=clone, env=env, capture_output=True, text=True)
      times[name] = time.perf_counter() - t0
      if res.returncode:
        raise RuntimeError(f"{name} failed: {res.stderr[-2000:]}")
      print(f"{name}: {times[name]:.1f} s", flush=True)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  total = sum(times.values())
  out = {**provenance.record("benchmarks.demo_time"), "stages_s": times, "total_s": total,
         "budget_s": BUDGET_S, "within_budget": total <= BUDGET_S, "uv_cache": cache,
         "machine": f"{os.cpu_count()} cores"}
  with open(FLAGS.results_json, "w") as f:
    json.dump(out, f, indent=2)
  print(f"total {total:.1f} s (budget {BUDGET_S} s); uv cache {cache['state']}")


if __name__ == "__main__":
  launcher.run(main)
