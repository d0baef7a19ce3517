"""Reference-vs-kernel timing, traffic and roofline for the top-k reconstruction.

Library half of benchmarks/bench_kernels.py (importable from a notebook; moved out of the
kernel op, which ships no benchmark). Every number
comes from one run measuring both implementations side by side.
"""

from __future__ import annotations

import os
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.topk_reconstruct import api, common, reference

# name -> (N tokens per device, D, K, k)
SHAPES = {
    "micro": (256, 64, 512, 16),
    "tiny": (1024, 128, 1024, 16),
    "small": (8192, 768, 8192, 16),
    "medium": (16384, 1024, 8192, 16),
    "large": (32768, 1280, 16384, 16),
    "xl": (65536, 1600, 16384, 16),
}
# Dense peaks (FLOP/s by input dtype) and HBM bandwidth (B/s). fp32 on NVIDIA tensor cores
# runs as 3xTF32 (a third of the TF32 peak); on TPU as a 6-pass bf16 product.
_PEAKS = {
    "H200": ({"bfloat16": 989e12, "float32": 989e12 / 2 / 3}, 4.8e12),
    "H100": ({"bfloat16": 989e12, "float32": 989e12 / 2 / 3}, 3.35e12),
    "TPU v5 lite": ({"bfloat16": 197e12, "float32": 197e12 / 6}, 819e9),
}


class Row(NamedTuple):
  shape: str
  dtype: str
  impl: str
  pass_: str
  ms: float
  gflop: float
  gbytes: float
  tflops: float
  tbps: float
  roofline_pct: float | None
  temp_gib: float
  ids_equal: float | None = None  # fraction of top-k ids equal to the reference's (fwd)
  zhat_rel_err: float | None = None  # max |z_hat - z_hat_ref| / max |z_hat_ref| (fwd)


def device_peaks():
  kind = jax.devices()[0].device_kind
  for name, peaks in _PEAKS.items():
    if name in kind:
      return kind, peaks
  return kind, None


def _cost(compiled):
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  cost = cost or {}
  return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))


def _time(fn, args, iters):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def _fns(impl, k, kw, distance="sqeuclidean"):
  """fwd and fwd+bwd programs; the loss reads every statistic the distance has."""
  def fwd(z, p, mask):
    if impl == "xla":
      return reference.topk_reconstruct_reference(z, p, k, distance=distance, mask_N=mask)
    return api.topk_reconstruct(z, p, k, distance=distance, mask_N=mask,
                                implementation=impl, **kw)

  def fwd_bwd(z, p, mask):
    def loss(z, p):
      out = fwd(z, p, mask)
      col = jnp.where(jnp.isfinite(out[7]), out[7], 0.0)
      return (jnp.sum(out[3] * z.astype(jnp.float32)) + jnp.sum(out[5]) + jnp.sum(out[6])
              + jnp.sum(col))
    return jax.grad(loss, (0, 1))(z, p)
  return {"fwd": fwd, "fwd+bwd": fwd_bwd}


def bench_shape(name, dtype, impl, *, iters=5, seed=0, kernel_kwargs=None,
                distance="sqeuclidean"):
  """Rows for the XLA reference and `impl` at one shape. sqeuclidean (the default here)
  has every statistic; cosine (the model's default) has no row/column distance extrema."""
  n, d, num_protos, k = SHAPES[name]
  rng = np.random.default_rng(seed)
  z = jnp.asarray(rng.standard_normal((n, d), np.float32), dtype)
  p = jnp.asarray(rng.standard_normal((num_protos, d), np.float32), dtype)
  mask = jnp.asarray(rng.random(n) > 0.1)
  _, peaks = device_peaks()
  rows, ref_out = [], None
  for which in ("xla", impl):
    for pass_, fn in _fns(which, k, kernel_kwargs or {}, distance).items():
      compiled = jax.jit(fn).lower(z, p, mask).compile()
      flops, nbytes = _cost(compiled)
      flops = max(flops, 2.0 * n * num_protos * d)  # the similarity product at least
      sec = _time(compiled, (z, p, mask), iters)
      temp = compiled.memory_analysis().temp_size_in_bytes / 2**30
      pct = None
      if peaks is not None:
        roof = max(flops / peaks[0][jnp.dtype(dtype).name], nbytes / peaks[1])
        pct = 100.0 * roof / sec
      check = (None, None)
      if pass_ == "fwd":  # a timing of a wrong kernel is no result: check what was timed
        out = compiled(z, p, mask)
        if which == "xla":
          ref_out = (np.asarray(out[0]), np.asarray(out[3]))
        else:
          check = _agreement(out, ref_out)
        del out
      rows.append(Row(name, jnp.dtype(dtype).name, which, pass_ + _tag(distance), 1e3 * sec,
                      flops / 1e9, nbytes / 1e9, flops / sec / 1e12, nbytes / sec / 1e12,
                      pct, temp, *check))
  return rows


def _tag(distance):
  return "" if distance == "sqeuclidean" else f" ({distance})"


def _agreement(out, ref_out):
  """(fraction of ids equal, max relative z_hat error) of a kernel output vs the reference."""
  ids, z_hat = np.asarray(out[0]), np.asarray(out[3], np.float64)
  ref_ids, ref_z_hat = ref_out[0], np.asarray(ref_out[1], np.float64)
  err = np.max(np.abs(z_hat - ref_z_hat)) / max(np.max(np.abs(ref_z_hat)), 1e-30)
  return float(np.mean(ids == ref_ids)), float(err)


def check_correctness(impl, *, shapes=((512, 96, 1000, 16), (300, 200, 2100, 32)),
                      kernel_kwargs=None):
  """Kernel vs reference on fresh inputs: id agreement, max relative errors (fwd, grads)."""
  lines = []
  for n, d, num_protos, k in shapes:
    for dtype in (jnp.float32, jnp.bfloat16):
      rng = np.random.default_rng(n + k)
      z = jnp.asarray(rng.standard_normal((n, d), np.float32), dtype)
      p = jnp.asarray(rng.standard_normal((num_protos, d), np.float32), dtype)
      mask = jnp.asarray(rng.random(n) > 0.2)
      fk, fr = _fns(impl, k, kernel_kwargs or {}), _fns("xla", k, {})
      out, ref = jax.jit(fk["fwd"])(z, p, mask), jax.jit(fr["fwd"])(z, p, mask)
      ids = float(np.mean(np.asarray(out[0]) == np.asarray(ref[0])))
      rel = lambda a, b: float(jnp.max(jnp.abs(jnp.where(jnp.isfinite(b), a - b, 0.0)))
                               / jnp.max(jnp.abs(jnp.where(jnp.isfinite(b), b, 0.0))))
      err = max(rel(a, b) for a, b in zip(out[1:], ref[1:]))
      gk, gr = jax.jit(fk["fwd+bwd"])(z, p, mask), jax.jit(fr["fwd+bwd"])(z, p, mask)
      gerr = max(rel(a.astype(jnp.float32), b.astype(jnp.float32)) for a, b in zip(gk, gr))
      lines.append(f"N={n} D={d} K={num_protos} k={k} {jnp.dtype(dtype).name}: "
                   f"ids equal {100 * ids:.2f}%  fwd max rel err {err:.2e}  "
                   f"grad max rel err {gerr:.2e}")
  return lines


def merge_iterations(z_NxD, p_KxD, k: int, block_n: int, block_k: int):
  """How much work the kernels' top-k merge (common.merge_topk) does, counted in NumPy.

  Per (token block, prototype tile) the merge loop runs as many times as the most
  insertions any row of the block makes into its running list (kp = padded_k(k) entries).
  Returns (mean loop iterations per tile, mean insertions per row per tile); rows beyond a
  multiple of block_n are dropped."""
  kp = common.padded_k(k)
  unit = lambda x: x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
  zn, pn = unit(np.asarray(z_NxD, np.float64)), unit(np.asarray(p_KxD, np.float64))
  iters, inserts = [], []
  for b in range(0, zn.shape[0] - block_n + 1, block_n):
    s_BxK = zn[b:b + block_n] @ pn.T
    vals = np.full((block_n, kp), -np.inf)
    for j in range(0, s_BxK.shape[1], block_k):
      merged = np.concatenate([vals, s_BxK[:, j:j + block_k]], axis=1)
      top = np.argpartition(-merged, kp - 1, axis=1)[:, :kp]
      from_tile = np.sum(top >= kp, axis=1)
      iters.append(from_tile.max())
      inserts.append(from_tile.mean())
      vals = np.take_along_axis(merged, top, axis=1)
  return float(np.mean(iters)), float(np.mean(inserts))


def format_table(rows):
  head = ("| shape | dtype | impl | pass | ms | GFLOP | GB (cost model) | TFLOP/s | TB/s "
          "| % roofline | temp GiB | speed-up vs xla | ids = ref | z_hat rel err |")
  out = [head, "|" + "---|" * 14]
  base = {(r.shape, r.dtype, r.pass_): r.ms for r in rows if r.impl == "xla"}
  for r in rows:
    pct = "n/a" if r.roofline_pct is None else f"{r.roofline_pct:.1f}"
    speed = base.get((r.shape, r.dtype, r.pass_), float("nan")) / r.ms
    out.append(f"| {r.shape} | {r.dtype} | {r.impl} | {r.pass_} | {r.ms:.2f} | "
               f"{r.gflop:.1f} | {r.gbytes:.2f} | {r.tflops:.2f} | {r.tbps:.3f} | {pct} | "
               f"{r.temp_gib:.3f} | {speed:.2f}x | {_pct(r.ids_equal)} | "
               f"{'-' if r.zhat_rel_err is None else f'{r.zhat_rel_err:.1e}'} |")
  return "\n".join(out)


def _pct(frac):
  return "-" if frac is None else f"{100 * frac:.2f}%"


def aot_memory(topology: str, shape: str, dtype, impl: str = "pallas_tpu"):
  """Compiled temp memory (GiB) of reference vs kernel, compiled ahead of time for one chip
  of a TPU `topology` (needs libtpu); 'OOM' when XLA cannot fit it in the chip's HBM."""
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only: share libtpu
  topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
  mesh = jax.sharding.Mesh(np.array(topo.devices[:1]), ("x",))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  n, d, num_protos, k = SHAPES[shape]
  args = (jax.ShapeDtypeStruct((n, d), dtype, sharding=rep),
          jax.ShapeDtypeStruct((num_protos, d), dtype, sharding=rep),
          jax.ShapeDtypeStruct((n,), jnp.bool_, sharding=rep))
  result = {}
  for which in ("xla", impl):
    for pass_, fn in _fns(which, k, {}).items():
      try:
        compiled = jax.jit(fn).lower(*args).compile()
        result[(which, pass_)] = f"{compiled.memory_analysis().temp_size_in_bytes / 2**30:.3f}"
      except Exception as e:  # pylint: disable=broad-except
        result[(which, pass_)] = "OOM" if "RESOURCE_EXHAUSTED" in str(e) else "error"
  return result
