"""Cost of the checkpoint digests (train/integrity.py): ms per GB, and mesh independence.

  JAX_PLATFORMS=cpu python -m benchmarks.bench_checksum [--mb=256] [--devices=8]

For float32 and bfloat16 arrays of --mb MB in total (a params-like tree of a few leaves),
times `integrity.digest` (what a save adds) and `integrity.verify` (what a restore adds:
the digest plus the finiteness check) on one device and sharded over --devices devices,
and checks the digest is the same either way. `sum ms` is one float32 jnp.sum over the same
arrays: the floor of any pass that reads every byte. Prints a markdown table.
"""

import time

from absl import flags

from prism_jax.cli import flag_checks as check
from prism_jax.cli import launcher

_MB = flags.DEFINE_integer("mb", 256, "MB of array data per row")
_DEVICES = flags.DEFINE_integer("devices", 8, "CPU devices for the sharded rows")
_ITERS = flags.DEFINE_integer("iters", 5, "timed repetitions (median reported)")


def _tree(mb: int, dtype, rng):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  itemsize = jnp.dtype(dtype).itemsize
  rows = mb * 2**20 // itemsize // 1024 // 4  # four leaves of (rows, 1024)
  return {f"w{i}": jnp.asarray(rng.standard_normal((rows, 1024), dtype="float32"), dtype)
          for i in range(4)}


def _median_ms(fn, iters: int) -> float:
  fn()  # compile
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return 1e3 * sorted(times)[len(times) // 2]


def main(argv):
  del argv
  check.at_least(1, mb=_MB.value, devices=_DEVICES.value, iters=_ITERS.value)
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_num_cpu_devices", _DEVICES.value)
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from prism_jax.train import integrity  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(0)
  mesh = jax.make_mesh((len(jax.devices()),), ("data",))
  print(f"backend {jax.default_backend()}, {len(jax.devices())} devices, "
        f"{_MB.value} MB per row, median of {_ITERS.value}")
  print("| dtype | placement | GB | sum ms | digest ms | digest ms/GB | verify ms | "
        "verify ms/GB | same digest |")
  print("|---|---|---|---|---|---|---|---|---|")
  total = jax.jit(lambda t: sum(jnp.sum(x, dtype=jnp.float32) for x in jax.tree.leaves(t)))
  for dtype in (jnp.float32, jnp.bfloat16):
    tree = _tree(_MB.value, dtype, rng)
    want = integrity.digest(tree)
    gb = integrity.nbytes(tree) / 1e9
    placements = {"1 device": tree,
                  f"sharded x{len(jax.devices())}": jax.device_put(
                      tree, NamedSharding(mesh, P("data", None)))}
    for name, t in placements.items():
      same = integrity.digest(t) == want
      ms_s = _median_ms(lambda t=t: total(t).block_until_ready(), _ITERS.value)
      ms_d = _median_ms(lambda t=t: integrity.digest(t), _ITERS.value)
      ms_v = _median_ms(lambda t=t: integrity.verify(t, want, "bench"), _ITERS.value)
      print(f"| {jnp.dtype(dtype).name} | {name} | {gb:.3f} | {ms_s:.1f} | {ms_d:.1f} | "
            f"{ms_d / gb:.0f} | "
            f"{ms_v:.1f} | {ms_v / gb:.0f} | {same} |")


if __name__ == "__main__":
  launcher.run(main)
