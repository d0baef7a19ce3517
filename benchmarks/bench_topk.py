"""The prototype layer's CPU top-k: XLA's TopK call (N x K) against topk_major (K x N).

  JAX_PLATFORMS=cpu python -m benchmarks.bench_topk [--shapes=byte,small] [--groups=8,16,32]
      [--reps=30] [--rounds=7]

Per shape (N tokens, K prototypes, D, k: benchmarks/configs.py's byte and small configs), in one
process and interleaved round by round: `lax.top_k` of the N x K similarities (what the
CPU forward ran before round 4), `topk_major.top_k` of the same matrix laid out K x N at
each group width of `--groups`, and the whole forward statistics `cpu.kernel_stats`
(the similarity matmul included) in both layouts. Medians over rounds of the per-call wall
time; "x" is the TopK call's (or the N x K statistics') time over the row's. Every row's
indices are checked equal to `lax.top_k`'s.
"""

from __future__ import annotations

import time

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import configs
from prism_jax.cli import flag_checks as check
from pallas_kernels.topk_reconstruct import cpu, reference, topk_major
from prism_jax.cli import launcher

SHAPES = ("byte", "small")  # configs.layer_shape: (N, D, K, k) of the train configs
flags.DEFINE_list("shapes", list(SHAPES), f"of {sorted(SHAPES)}")
flags.DEFINE_list("groups", ["8", "16", "32"], "topk_major group widths to time")
flags.DEFINE_integer("reps", 30, "calls per timed block")
flags.DEFINE_integer("rounds", 7, "timed blocks per row (median reported)")
FLAGS = flags.FLAGS


def stats_NxK(z, p, valid, k):
  """The forward statistics as before round 4: N x K similarity, lax.top_k."""
  s = reference.similarity(z, p)
  sim, idx = cpu.top_k(s.cos_NxK, k)
  return (sim, idx) + reference.first_extremum(
      jnp.where(valid[:, None], s.cos_NxK, -jnp.inf), 0, largest=True)


def timed(fn, args, reps: int) -> float:
  start = time.perf_counter()
  for _ in range(reps):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / reps


def rows_of(name: str):
  n, d, num_protos, k = configs.layer_shape(name)
  rng = np.random.default_rng(0)
  z = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
  p = jnp.asarray(rng.normal(size=(num_protos, d)), jnp.float32)
  valid = jnp.ones(n, bool)
  cos = reference.similarity(z, p).cos_NxK
  cos_t = jnp.asarray(np.ascontiguousarray(np.asarray(cos).T))
  want = np.asarray(jax.lax.top_k(cos, k)[1])
  rows = [("top-k", "lax.top_k (N x K)", jax.jit(lambda c: jax.lax.top_k(c, k)), (cos,))]
  default = topk_major.GROUP
  for group in map(int, FLAGS.groups):
    topk_major.GROUP = group  # read at trace time: each jit below is traced now
    fn = jax.jit(lambda c: topk_major.top_k(c, k))
    np.testing.assert_array_equal(np.asarray(fn(cos_t)[1]), want)
    rows.append(("top-k", f"topk_major G={group} (K x N)", fn, (cos_t,)))
  topk_major.GROUP = default
  rows.append(("statistics", "N x K + lax.top_k", jax.jit(lambda *a: stats_NxK(*a, k)),
               (z, p, valid)))
  new = jax.jit(lambda *a: cpu.kernel_stats(*a, k))
  np.testing.assert_array_equal(np.asarray(new(z, p, valid)[1]), want)
  rows.append(("statistics", "cpu.kernel_stats (K x N)", new, (z, p, valid)))
  return (n, num_protos, d, k), rows


def main(argv):
  del argv
  unknown = sorted(set(FLAGS.shapes) - set(SHAPES))
  if unknown:
    raise ValueError(f"--shapes: unknown {unknown}; choose from {sorted(SHAPES)}")
  check.not_empty(shapes=FLAGS.shapes)
  check.numbers("groups", FLAGS.groups, int, low=1)
  check.at_least(1, reps=FLAGS.reps, rounds=FLAGS.rounds)
  print("| shape | N x K x D, k | what | implementation | ms | x |\n|---|---|---|---|---|---|")
  for name in FLAGS.shapes:
    dims, rows = rows_of(name)
    for _, _, fn, args in rows:
      jax.block_until_ready(fn(*args))  # compiled and warm
    times = [[] for _ in rows]
    for r in range(FLAGS.rounds):
      order = range(len(rows)) if r % 2 == 0 else reversed(range(len(rows)))
      for i in order:
        times[i].append(timed(rows[i][2], rows[i][3], FLAGS.reps))
    med = [1e3 * float(np.median(t)) for t in times]
    base = {}
    for (what, label, _, _), ms in zip(rows, med):
      base.setdefault(what, ms)
      print(f"| {name} | {dims[0]} x {dims[1]} x {dims[2]}, {dims[3]} | {what} | {label} | "
            f"{ms:.3f} | {base[what] / ms:.2f}x |")


if __name__ == "__main__":
  launcher.run(main)
