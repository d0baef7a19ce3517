"""A test run N times in a row beside a busy core: does it hold under load (no flake)?

  python -m experiments.repeat_test --test=tests/test_preemption.py::test_sigterm_to_one_of_two_processes_saves_one_step_and_resumes_exactly \
      [--times=20 --busy=1 --results_json=docs/results/preemption_repeat.json]

Starts --busy processes that spin a core each for the whole run (the load a shared CI box
or a data loader puts beside training), then runs the test --times times, one pytest
process each, in the order given, stopping at nothing: every outcome and wall time is
recorded. The JSON (argv + commit) feeds docs/RESULTS.md.
"""

import multiprocessing
import subprocess
import sys
import time

from absl import flags

from prism_jax.cli import flag_checks as check
from prism_jax.cli import launcher

flags.DEFINE_string("test", None, "pytest node id")
flags.DEFINE_integer("times", 20, "runs in a row")
flags.DEFINE_integer("busy", 1, "spinning processes beside the runs")
flags.DEFINE_string("results_json", None, "where the results go")
flags.mark_flag_as_required("test")
FLAGS = flags.FLAGS


def _spin():
  while True:
    pass


def main(argv):
  del argv
  from prism_jax.cli import provenance  # pylint: disable=g-import-not-at-top
  if FLAGS.times < 1 or FLAGS.busy < 0:
    raise ValueError("--times must be >= 1 and --busy >= 0")
  check.existing("test", FLAGS.test.split("::")[0], "test file")
  check.output_file("results_json", FLAGS.results_json)
  spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(FLAGS.busy)]
  for p in spinners:
    p.start()
  runs = []
  try:
    for i in range(FLAGS.times):
      t0 = time.perf_counter()
      res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            FLAGS.test], capture_output=True, text=True)
      runs.append({"run": i + 1, "passed": res.returncode == 0,
                   "wall_s": round(time.perf_counter() - t0, 1),
                   "tail": "" if res.returncode == 0 else res.stdout[-1500:]})
      print(f"run {i + 1}/{FLAGS.times}: {'pass' if res.returncode == 0 else 'FAIL'} "
            f"({runs[-1]['wall_s']} s)", flush=True)
  finally:
    for p in spinners:
      p.terminate()
  out = {**provenance.record("experiments.repeat_test"), "test": FLAGS.test,
         "busy_processes": FLAGS.busy, "times": FLAGS.times,
         "passed": sum(r["passed"] for r in runs), "runs": runs}
  if FLAGS.results_json:
    provenance.write_results(FLAGS.results_json, out)
  print(f"{out['passed']}/{FLAGS.times} passed beside {FLAGS.busy} busy core(s)")


if __name__ == "__main__":
  launcher.run(main)
