"""`make demo` on fresh clones of two commits, side by side, timed by stage.

  python -m benchmarks.demo_time [--baseline=14df241] [--commit=HEAD] \
      [--results_json=docs/results/demo_time.json]

Clones this repository twice (--baseline and --commit) into a temporary directory and runs
the demo target's three stages in each, as `make demo` does: the library's install
(`make .venv/.installed-base`: uv, requirements/lock.txt), `prism demo`, `prism report`.
The two clones take turns stage by stage (the order alternates), so a change in the
machine's load falls on both; they share the package cache (uv's: its state is recorded).
Wall seconds per stage and in all, the ratio commit / baseline, and what each demo printed
that says it trained as well: its val CE, its faithfulness line and how many of the
sample's tokens the residual decided (RESIDUAL).
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
flags.DEFINE_string("results_json", "docs/results/demo_time.json", "where the results go")
FLAGS = flags.FLAGS
TARGET_RATIO = 0.6  # issue 53: a fresh clone's `make demo` <= 0.6 x 14df241's
STAGES = (("install", ["make", "-s", ".venv/.installed-base"]),
          ("train + sample", [".venv/bin/prism", "demo"]),
          ("report", [".venv/bin/prism", "report", "--workdir=runs/demo",
                      "--prompt=The for statement"]))


def demo_facts(stdout: str) -> dict:
  """What `prism demo` printed about the model it trained: its val CE, its faithfulness
  line and how many of its sample's tokens the residual decided (RESIDUAL)."""
  facts = {}
  loss = re.search(r"^validation: loss ([0-9.]+)", stdout, re.M)
  if loss:
    facts["val_ce"] = float(loss.group(1))
  faith = re.search(r"^faithfulness: (.*?)\n  \(", stdout, re.M | re.S)
  if faith:
    facts["faithfulness"] = " ".join(faith.group(1).split())
  trust = re.search(r"of (\d+) tokens; RESIDUAL marks the (\d+)", stdout)
  if trust:
    facts["sample_tokens"], facts["residual_decided"] = int(trust.group(1)), int(trust.group(2))
  return facts


def main(argv):
  del argv
  # written after minutes of cloning, installing and training; relative to the cwd
  check.output_file("results_json", FLAGS.results_json)
  from prism_jax.cli import provenance  # pylint: disable=g-import-not-at-top
  cache = side_by_side.uv_cache()
  tmp = tempfile.mkdtemp(prefix="demo_time_")
  runs = {"baseline": {"ref": FLAGS.baseline}, "commit": {"ref": FLAGS.commit}}
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  try:
    for label, run in runs.items():
      run["dir"] = os.path.join(tmp, label)
      run["sha"] = side_by_side.clone(run["ref"], run["dir"])
      run["stages_s"] = {}
    for i, (stage, cmd) in enumerate(STAGES):
      order = list(runs) if i % 2 == 0 else list(runs)[::-1]
      for label in order:
        run = runs[label]
        t0 = time.perf_counter()
        res = subprocess.run(cmd, cwd=run["dir"], env=env, capture_output=True, text=True)
        run["stages_s"][stage] = time.perf_counter() - t0
        if res.returncode:
          raise RuntimeError(f"{label} {stage} failed: {res.stderr[-2000:]}")
        if stage == "train + sample":
          run["demo"] = demo_facts(res.stdout)
        print(f"{label} {stage}: {run['stages_s'][stage]:.1f} s", flush=True)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  for run in runs.values():
    run.pop("dir")
    run["total_s"] = sum(run["stages_s"].values())
  ratio = runs["commit"]["total_s"] / runs["baseline"]["total_s"]
  out = {**provenance.record("benchmarks.demo_time"), "runs": runs, "ratio": ratio,
         "target_ratio": TARGET_RATIO, "within_target": ratio <= TARGET_RATIO,
         "uv_cache": cache, "machine": f"{os.cpu_count()} cores"}
  provenance.write_results(FLAGS.results_json, out)
  print(f"total: commit {runs['commit']['total_s']:.1f} s, baseline "
        f"{runs['baseline']['total_s']:.1f} s, ratio {ratio:.3f} (target <= {TARGET_RATIO})")


if __name__ == "__main__":
  launcher.run(main)
