"""Where the whole train step's time goes: a jax.profiler trace joined to the compiled HLO.

  taskset -c 0 python -m benchmarks.trace_train [--config=byte] [--kind=dense] [--steps=10]
      [--top=15] [--alone]

Builds bench_train's model (`--config`, `--kind`: "dense" or a PRISM variant), runs
`--warmup` untimed steps, times `--steps` untraced, then traces `--steps` and
sums each executed op's time by phase (forward / backward: ops whose HLO op_name carries
autodiff's `transpose(`; optimiser: the step's ops outside the model's jvp; other: the rest)
and kind (matmul: YNNPACK fusions and dots, their reductions included; elementwise: XLA's
own loop fusions, copies, ...), then lists the `--top` ops. Under `taskset -c 0` (one core)
op times add up to the step's wall time; on more cores ops overlap, and `--alone` lists
the ops that ran with no other op beside them (time_alone: the serial ones). The untraced steps'
system CPU time and minor page faults (getrusage) are printed beside their wall and CPU time.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import resource
import tempfile

from absl import flags

from benchmarks import bench_train
from prism_jax.cli import flag_checks as check
from prism_jax.cli import launcher

flags.DEFINE_string("config", "byte", "a bench_train config")
flags.DEFINE_string("kind", "dense", "a bench_train model of that config")
flags.DEFINE_integer("steps", 10, "traced steps")
# bench_train's --warmup, defined here: bench_train defines its flags only when it runs
flags.DEFINE_integer("warmup", 2, "untimed steps after compilation")
flags.DEFINE_integer("top", 15, "ops to list")
flags.DEFINE_string("trace_dir", None, "keep the trace here (default: a temporary dir)")
flags.DEFINE_bool("alone", False, "also list the ops that ran with no other op beside them "
                  "(on several cores: what leaves the others idle)")
FLAGS = flags.FLAGS

OP_LINE = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\S+) .*?op_name=\"([^\"]*)\"", re.M)


def classify(name: str, op_name: str) -> tuple[str, str]:
  """(phase, kind) of an executed HLO op."""
  if "transpose(" in op_name:
    phase = "backward"
  elif "jvp" in op_name:
    phase = "forward"
  elif "/" in op_name:
    phase = "optimiser"
  else:
    phase = "other"
  kind = "matmul" if name.startswith(("ynn_fusion", "dot", "xnn_fusion")) else "elementwise"
  return phase, kind


def trace_ops(runner, steps: int, trace_dir: str):
  """(total traced µs, executions) per executed op name over `steps` steps."""
  import jax  # pylint: disable=g-import-not-at-top
  jax.profiler.start_trace(trace_dir)
  runner.block(steps)
  jax.profiler.stop_trace()
  path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))[-1]
  with gzip.open(path) as f:
    events = json.load(f)["traceEvents"]
  totals, runs = collections.Counter(), collections.Counter()
  for e in events:
    if e.get("ph") == "X" and "name" in e:
      totals[e["name"]] += e.get("dur", 0)
      runs[e["name"]] += 1
  return totals, runs, events


def time_alone(events, ops) -> collections.Counter:
  """µs during which an op of `ops` was the only one of them running (on any thread), per
  op name: on several cores, the ops on the critical path that leave the other cores idle
  (a matmul's own worker threads are not op events, so its time counts as alone too)."""
  spans = [(e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
           if e.get("ph") == "X" and e.get("name") in ops]
  edges = sorted([(start, 1, i) for i, (start, _, _) in enumerate(spans)]
                 + [(end, -1, i) for i, (_, end, _) in enumerate(spans)])
  alone, running, last = collections.Counter(), set(), None
  for t, delta, i in edges:
    if len(running) == 1 and last is not None:
      alone[spans[next(iter(running))][2]] += t - last
    if delta == 1:
      running.add(i)
    else:
      running.discard(i)
    last = t
  return alone


def main(argv):
  del argv
  bench_train.check_model(FLAGS.config, FLAGS.kind)
  if FLAGS.steps < 1:
    raise ValueError(f"--steps must be >= 1, got {FLAGS.steps}")
  check.at_least(1, top=FLAGS.top)
  check.at_least(0, warmup=FLAGS.warmup)
  runner = bench_train.Runner(bench_train.make_config(FLAGS.config, FLAGS.kind))
  runner.block(FLAGS.warmup)
  before = resource.getrusage(resource.RUSAGE_SELF)
  wall, cpu = runner.block(FLAGS.steps)  # untraced timing
  after = resource.getrusage(resource.RUSAGE_SELF)
  # Compiled again (for its HLO text) after the timing: the timed steps run in a process
  # holding one executable, as bench_train's workers do.
  hlo = runner.step.lower(runner.state, runner.batch).compile().as_text()
  ops = {m.group(1): (m.group(2), m.group(3)) for m in OP_LINE.finditer(hlo)}
  sys_s, faults = after.ru_stime - before.ru_stime, after.ru_minflt - before.ru_minflt
  with tempfile.TemporaryDirectory() as tmp:
    totals, runs, events = trace_ops(runner, FLAGS.steps, FLAGS.trace_dir or tmp)
  table = collections.Counter()
  count = collections.Counter()
  for name, us in totals.items():
    if name in ops:
      key = classify(name, ops[name][1])
      table[key] += us
      count[key] += runs[name]
  n = FLAGS.steps
  print(f"{FLAGS.config} {FLAGS.kind}: {1e3 * wall / n:.2f} ms/step wall, {1e3 * cpu / n:.2f} "
        f"CPU (of which system {1e3 * sys_s / n:.2f}), {faults / n:,.0f} minor page faults/step, "
        f"untraced; traced op time "
        f"{sum(table.values()) / n / 1e3:.2f} ms/step")
  print("| phase | kind | ms/step | ops/step |")
  print("|---|---|---|---|")
  for key in sorted(table):
    print(f"| {key[0]} | {key[1]} | {table[key] / n / 1e3:.2f} | {count[key] / n:.0f} |")
  print("\n| op | shape | HLO op_name | ms/step |\n|---|---|---|---|")
  named = [(us, name) for name, us in totals.items() if name in ops]
  for us, name in sorted(named, reverse=True)[:FLAGS.top]:
    shape, op_name = ops[name]
    print(f"| {name} | {shape.split('{')[0]} | {op_name[-48:]} | {us / n / 1e3:.2f} |")
  if FLAGS.alone:
    print("\nOps running alone (no other op of the step at the same time), ms/step:\n"
          "| op | shape | HLO op_name | ms/step alone |\n|---|---|---|---|")
    for name, us in time_alone(events, ops).most_common(FLAGS.top):
      shape, op_name = ops[name]
      print(f"| {name} | {shape.split('{')[0]} | {op_name[-48:]} | {us / n / 1e3:.2f} |")


if __name__ == "__main__":
  launcher.run(main)
