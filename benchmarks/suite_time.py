"""`make test` on fresh clones of two commits, one after the other on this machine.

  python -m benchmarks.suite_time [--baseline=14df241] [--commit=HEAD] [--long] \
      [--results_json=docs/results/suite_time.json]

Clones this repository twice (--commit, then --baseline) into a temporary directory and runs
`make test` in each, the measured commit first, as CI does on a clean clone (the venv's
install, the import contracts, the bytecode, the suite), sharing uv's package cache (its
state is recorded). Wall seconds of each, the ratio commit / baseline (issue 56: <= 0.7),
and each suite's pytest summary (passed, skipped, pytest's own seconds). With --long,
`make test-long` runs after it in each clone that has the target, so CI's whole suite
(test + test-long) stands beside it.
"""

import os
import re
import shutil
import subprocess
import tempfile
import time

from absl import flags

from benchmarks import side_by_side
from prism_jax.cli import flag_checks as check
from prism_jax.cli import launcher

flags.DEFINE_string("baseline", "14df241", "the commit compared against")
flags.DEFINE_string("commit", "HEAD", "the commit measured")
flags.DEFINE_bool("long", False, "also time `make test-long` in each clone that has it")
flags.DEFINE_string("results_json", "docs/results/suite_time.json", "where the results go")
FLAGS = flags.FLAGS
TARGET_RATIO = 0.7  # issue 56: a fresh clone's `make test` <= 0.7 x 14df241's


def _time(target: str, cwd: str, env: dict, must_pass: bool) -> dict:
  """Wall seconds and pytest's summary of `make target`. A failing run of the measured
  commit stops the benchmark; the baseline's is recorded with its failures (an old commit's
  flaky test still ran the whole suite, so its time stands)."""
  t0 = time.perf_counter()
  res = subprocess.run(["make", target], cwd=cwd, env=env, capture_output=True, text=True)
  wall = time.perf_counter() - t0
  if res.returncode and must_pass:
    raise RuntimeError(f"make {target} in {cwd} failed:\n{res.stdout[-3000:]}"
                       f"{res.stderr[-2000:]}")
  out = {"wall_s": wall, **side_by_side.pytest_summary(res.stdout + res.stderr)}
  if res.returncode:
    out["failed_tail"] = (res.stdout + res.stderr)[-1500:]
  return out


def _has_target(cwd: str, target: str) -> bool:
  with open(os.path.join(cwd, "Makefile")) as f:
    return re.search(rf"^{re.escape(target)}:", f.read(), re.M) is not None


def main(argv):
  del argv
  check.output_file("results_json", FLAGS.results_json)  # written after ~25 minutes
  from prism_jax.cli import provenance  # pylint: disable=g-import-not-at-top
  cache = side_by_side.uv_cache()
  tmp = tempfile.mkdtemp(prefix="suite_time_")
  # The measured commit first: a suite that fails there stops the run before the baseline's.
  runs = {"commit": {"ref": FLAGS.commit}, "baseline": {"ref": FLAGS.baseline}}
  env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "VIRTUAL_ENV"))}
  env["JAX_PLATFORMS"] = "cpu"
  try:
    for label, run in runs.items():
      run["dir"] = os.path.join(tmp, label)
      run["sha"] = side_by_side.clone(run["ref"], run["dir"])
      run["test"] = _time("test", run["dir"], env, must_pass=label == "commit")
      print(f"{label} make test: {run['test']}", flush=True)
    for label, run in runs.items():
      if FLAGS.long and _has_target(run["dir"], "test-long"):
        run["test_long"] = _time("test-long", run["dir"], env, must_pass=label == "commit")
        print(f"{label} make test-long: {run['test_long']}", flush=True)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  for run in runs.values():
    run.pop("dir")
  ratio = runs["commit"]["test"]["wall_s"] / runs["baseline"]["test"]["wall_s"]
  out = {**provenance.record("benchmarks.suite_time"), "runs": runs, "ratio": ratio,
         "target_ratio": TARGET_RATIO, "within_target": ratio <= TARGET_RATIO,
         "uv_cache": cache, "machine": f"{os.cpu_count()} cores"}
  provenance.write_results(FLAGS.results_json, out)
  print(f"make test: commit {runs['commit']['test']['wall_s']:.0f} s, baseline "
        f"{runs['baseline']['test']['wall_s']:.0f} s, ratio {ratio:.3f} "
        f"(target <= {TARGET_RATIO})")


if __name__ == "__main__":
  launcher.run(main)
