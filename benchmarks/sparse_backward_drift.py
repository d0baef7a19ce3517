"""How far training with a custom backward drifts from plain autodiff's: float32 rounding.

  python -m benchmarks.sparse_backward_drift [--config=byte] [--kind=prism_paper]
      [--backward=sparse] [--checkpoints=1,5,10,50,100,170]

Two copies of the same model (bench_train's configs, random tokens, one batch repeated)
train side by side, and the table prints both losses and their relative difference at each
checkpoint step. `--backward=sparse` (a PRISM model): `model.implementation=xla` (plain
autodiff) against `xla_sparse` (the same forward, the kernels' sparse layer backward).
`--backward=matmul` (dense or PRISM): the backbone's linear maps through
`transformer.matmul` (CPU's weight-gradient orientation) against plain autodiff of `x @ w`.
"""

from __future__ import annotations

from absl import flags

from benchmarks import bench_train
from prism_jax.cli import flag_checks as check
from prism_jax.cli import launcher

flags.DEFINE_string("config", "byte", "a bench_train config")
flags.DEFINE_string("kind", "prism_paper", "a bench_train model of that config")
flags.DEFINE_enum("backward", "sparse", ["sparse", "matmul"],
                  "the custom backward compared with plain autodiff (see the module doc)")
flags.DEFINE_list("checkpoints", ["1", "5", "10", "50", "100", "170"], "steps to compare at")
FLAGS = flags.FLAGS


def runners(base) -> dict:
  """{"autodiff": Runner, "custom": Runner} for --backward, and how to run each one's block
  (the autodiff matmul runner is traced with transformer.matmul swapped for x @ w)."""
  from prism_jax.train import apply_overrides  # pylint: disable=g-import-not-at-top
  if FLAGS.backward == "sparse":
    return {name: (bench_train.Runner(apply_overrides(base, [f"model.implementation={impl}"])),
                   None) for name, impl in (("autodiff", "xla"), ("custom", "xla_sparse"))}
  plain = lambda x, w: x @ w
  return {"autodiff": (bench_train.Runner(base), plain), "custom": (bench_train.Runner(base), None)}


def block(runner, matmul, n: int) -> None:
  if matmul is None:
    runner.block(n)
    return
  from prism_jax.model import transformer  # pylint: disable=g-import-not-at-top
  custom, transformer.matmul = transformer.matmul, matmul
  try:  # the swap matters on the first call (the step is traced then); later calls reuse it
    runner.block(n)
  finally:
    transformer.matmul = custom


def main(argv):
  del argv
  bench_train.check_model(FLAGS.config, FLAGS.kind, prism_only=FLAGS.backward == "sparse")
  check.not_empty(checkpoints=FLAGS.checkpoints)
  steps = sorted(set(check.numbers("checkpoints", FLAGS.checkpoints, int, low=1)))
  pair = runners(bench_train.make_config(FLAGS.config, FLAGS.kind))
  label = {"sparse": ("xla (autodiff)", "xla_sparse"),
           "matmul": ("x @ w (autodiff)", "transformer.matmul")}[FLAGS.backward]
  print(f"| step | loss {label[0]} | loss {label[1]} | relative difference |")
  print("|---|---|---|---|")
  done = 0
  for step in steps:
    for runner, matmul in pair.values():
      block(runner, matmul, step - done)
    done = step
    a, b = pair["autodiff"][0].loss, pair["custom"][0].loss
    print(f"| {step} | {a:.7f} | {b:.7f} | {abs(a - b) / abs(a):.2e} |", flush=True)


if __name__ == "__main__":
  launcher.run(main)
