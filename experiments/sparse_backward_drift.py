"""How far the sparse XLA backward's training drifts from autodiff's: float32 rounding.

  python -m experiments.sparse_backward_drift [--config=byte] [--checkpoints=1,5,10,50,100,170]

Two copies of the same PRISM model (bench_train's configs, random tokens, one batch
repeated) train side by side, `model.implementation=xla` (plain autodiff) and
`xla_sparse` (the same forward, the kernels' sparse layer backward); the table prints
both losses and their relative difference at each checkpoint step.
"""

from __future__ import annotations

from absl import flags

from experiments import bench_train, cli

flags.DEFINE_string("config", "byte", "a bench_train config")
flags.DEFINE_string("kind", "prism_paper", "a bench_train model of that config")
flags.DEFINE_list("checkpoints", ["1", "5", "10", "50", "100", "170"], "steps to compare at")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  from prism_jax.train import apply_overrides  # pylint: disable=g-import-not-at-top
  if FLAGS.config not in bench_train.CONFIGS or FLAGS.kind not in bench_train.kinds(FLAGS.config)[1:]:
    raise ValueError(f"--config={FLAGS.config!r} --kind={FLAGS.kind!r}: choose a PRISM model "
                     f"of bench_train's configs {sorted(bench_train.CONFIGS)}")
  steps = sorted({int(s) for s in FLAGS.checkpoints})
  if not steps or steps[0] < 1:
    raise ValueError(f"--checkpoints must be positive step counts, got {FLAGS.checkpoints}")
  base = bench_train.make_config(FLAGS.config, FLAGS.kind)
  runners = {impl: bench_train.Runner(apply_overrides(base, [f"model.implementation={impl}"]))
             for impl in ("xla", "xla_sparse")}
  print("| step | loss xla (autodiff) | loss xla_sparse | relative difference |")
  print("|---|---|---|---|")
  done = 0
  for step in steps:
    for r in runners.values():
      r.block(step - done)
    done = step
    a, b = runners["xla"].loss, runners["xla_sparse"].loss
    print(f"| {step} | {a:.7f} | {b:.7f} | {abs(a - b) / abs(a):.2e} |", flush=True)


if __name__ == "__main__":
  cli.run(main)
