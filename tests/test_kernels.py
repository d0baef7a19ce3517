"""The top-k reconstruction op: every implementation x distance x mixture x mask x mesh
against the float64 NumPy reference of tests/kernel_cases.py (forward values and ids, and
gradients against autodiff of the XLA reference), then what only some implementations
have: the kernels' ties, arg statistics, block checks, bf16, edge cases, the
implementation switch and its platform resolution, the GPU lowering, the benchmarks.
Interpret mode on CPU; blocks small so K spans several tiles.
"""

import functools
import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernel_cases as kc
from kernel_cases import GPU_INTERP, TPU_INTERP
from pallas_kernels.topk_reconstruct import api, reference, vjp

_assert_matches = kc.assert_matches
_inputs = kc.inputs
_weighted_loss = kc.weighted_loss


def _run(z, p, k, opts, mixture="raw", mask=None):
  fn = jax.jit(lambda z, p, m: api.run_with_options(z, p, k, opts, mixture=mixture, mask_N=m))
  return fn(z, p, mask)


@functools.cache
def _reference_grads(distance, mixture, masked):
  z, p, mask = _case_inputs(distance, mixture, masked)
  n, d, num_protos, k = _SHAPE
  ref = lambda z, p: reference.topk_reconstruct_xla(z, p, k, mixture=mixture,
                                                    distance=distance, mask_N=mask)
  return jax.grad(_weighted_loss(ref, 1, n, num_protos, d, k), (0, 1))(z, p)


_SHAPE = (32, 8, 260, 5)  # N, D, K (3 tiles of 128, 65 per bank shard), k


def _case_inputs(distance, mixture, masked):
  n, d, num_protos, _ = _SHAPE
  seed = 3 * len(distance) + len(mixture) + masked
  z, p, mask = _inputs(seed, n, d, num_protos, masked=masked)
  if masked:
    mask = mask.at[:3].set(False)
  return z, p, mask


_DM = [("cosine", "raw"), ("cosine", "normalized"), ("sqeuclidean", "raw"),
       ("sqeuclidean", "normalized")]
# Every pair of factors, in 20 cases instead of the full 120 (interpret mode is slow): each
# implementation runs every (distance, mixture), meets every mesh (the mesh rotates with the
# implementation's index) and both masks; every (mesh, distance/mixture) pair occurs too.
# test_cases_cover_every_pair checks it.
_IMPLS, _MESHES = list(kc.IMPLEMENTATIONS), list(kc.MESHES)
CASES = [(impl, _MESHES[(i + j) % len(_MESHES)], distance, mixture, (i + j) % 2 == 0)
         for i, impl in enumerate(_IMPLS) for j, (distance, mixture) in enumerate(_DM)]


def test_cases_cover_every_pair():
  seen = {(a, b) for case in CASES for a in case for b in case}
  for xs, ys in ((_IMPLS, _MESHES), (_IMPLS, _DM), (_MESHES, _DM), (_IMPLS, (True, False))):
    for x in xs:
      for y in ys:
        pair = (x, y) if not isinstance(y, tuple) else None
        if pair is None:  # a (distance, mixture) pair: both entries in one case with x
          assert any(x in c and c[2:4] == y for c in CASES), (x, y)
        else:
          assert pair in seen, pair


@pytest.mark.parametrize("impl,mesh,distance,mixture,masked", CASES)
def test_matches_float64_reference(impl, mesh, distance, mixture, masked):
  """Outputs against float64 NumPy; gradients of every output against autodiff of the
  XLA reference; on a mesh, a kernel runs per shard in shard_map. One compile per case."""
  n, d, num_protos, k = _SHAPE
  z, p, mask = _case_inputs(distance, mixture, masked)
  want = kc.numpy_reference(z, p, k, mixture=mixture, distance=distance, mask=mask)
  assert kc.well_separated(want, 1e-5).all()  # float32 ids are exact on these inputs
  kw = dict(distance=distance, mixture=mixture)

  def run(fn, z, p, mask):
    loss = _weighted_loss(lambda z, p: fn(z, p, mask), 1, n, num_protos, d, k)
    grads = jax.grad(loss, (0, 1))(z, p)
    return fn(z, p, mask), grads
  if kc.MESHES[mesh] is None:
    out, grads = jax.jit(functools.partial(run, kc.op(impl, k, **kw)))(z, p, mask)
  else:
    m = kc.make_mesh(kc.MESHES[mesh])
    with jax.set_mesh(m):
      fn = kc.op(impl, k, **kw)
      zs, ps, ms = kc.place(m, z, p, mask)
      if impl in ("pallas_interpret", "gpu_interpret"):
        assert "shard_map" in str(jax.make_jaxpr(fn)(zs, ps, ms))
      out, grads = jax.jit(functools.partial(run, fn))(zs, ps, ms)
  assert isinstance(out, api.TopKReconstruction)
  _assert_matches(out, want, 1e-5)
  kc.assert_grads_close(grads, _reference_grads(distance, mixture, masked))


def test_bf16_forward_matches_reference():
  z, p, mask = _inputs(3, 32, 32, 260, jnp.bfloat16)
  opts = api.KernelOptions(distance="sqeuclidean", **TPU_INTERP)
  out = _run(z, p, 16, opts, "raw", mask)
  ref = reference.topk_reconstruct_reference(z, p, 16, distance="sqeuclidean", mask_N=mask)
  # bf16 products are exact in fp32: ids agree unless two cosines are within fp32 noise.
  assert np.mean(np.asarray(out[0]) == np.asarray(ref[0])) > 0.99
  _assert_matches((ref[0],) + tuple(out[1:]), ref, 1e-2)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_kernel_default_blocks_match_reference(dtype):
  """The GPU kernel body at its shipped default blocks (gpu.default_config: bf16 64x128x64,
  fp32 64x64x64): N, K and D each span two-plus blocks with a partial last one. Integer
  inputs make every product and sum exact, so ids must match exactly (ties included)."""
  from pallas_kernels.topk_reconstruct import gpu  # pylint: disable=import-outside-toplevel
  cfg = gpu.default_config(dtype)
  n, d, num_protos, k = 2 * cfg.block_n + 9, 2 * cfg.block_d + 5, 2 * cfg.block_k + 37, 16
  rng = np.random.default_rng(41)
  z = jnp.asarray(rng.integers(-3, 4, (n, d)), dtype)
  p = jnp.asarray(rng.integers(-3, 4, (num_protos, d)), dtype)
  p = p.at[-5:].set(p[:5])  # exact ties across the first and last tile
  mask = jnp.asarray(rng.random(n) > 0.25)
  out = _run(z, p, k, api.KernelOptions(distance="sqeuclidean", backend="gpu",
                                        interpret=True), "raw", mask)
  ref = reference.topk_reconstruct_reference(z, p, k, distance="sqeuclidean", mask_N=mask)
  _assert_matches(out, ref, 1e-5)
  got = api.argstats(z, p, k, api.KernelOptions(distance="sqeuclidean", backend="gpu",
                                                interpret=True), mask_N=mask)
  want = reference.argstats_reference(z, p, distance="sqeuclidean", mask_N=mask)
  for name, a, b in zip(("row_cos", "col_cos", "row_sq", "col_sq"), got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


def test_ties_go_to_lower_prototype_id():
  """Exact ties (duplicate prototypes in different tiles) and near-ties (one coordinate
  off by one). Integer inputs make every dot product exact, so kernel and reference see
  bitwise-equal cosines whatever their accumulation order."""
  rng = np.random.default_rng(5)
  n, d, k = 16, 16, 8
  base = rng.integers(-3, 4, (60, d)).astype(np.float32)
  near = base[:40].copy()
  near[np.arange(40), rng.integers(0, d, 40)] += 1.0
  p = np.concatenate([base, base[:40][::-1], near], axis=0)  # K = 140
  p = p[rng.permutation(len(p))]
  z = base[rng.integers(0, 60, n)] + rng.integers(-1, 2, (n, d)).astype(np.float32)
  z, p = jnp.asarray(z), jnp.asarray(p)
  ref = reference.topk_reconstruct_reference(z, p, k)
  sims, ids = np.asarray(ref[2]), np.asarray(ref[0])
  # The reference's documented order: value desc, then id asc among exact ties.
  tied = sims[:, :-1] == sims[:, 1:]
  assert tied.sum() >= n, "inputs must contain exact ties"
  assert np.all(ids[:, :-1][tied] < ids[:, 1:][tied])
  for opts in (api.KernelOptions(**TPU_INTERP), api.KernelOptions(**GPU_INTERP)):
    _assert_matches(_run(z, p, k, opts), ref, 1e-5)


def test_arg_statistics_match_reference():
  z, p, mask = _inputs(17, 40, 16, 200)
  got = api.argstats(z, p, 4, api.KernelOptions(distance="sqeuclidean", **TPU_INTERP),
                     mask_N=mask)
  want = reference.argstats_reference(z, p, distance="sqeuclidean", mask_N=mask)
  for name, a, b in zip(("row_cos", "col_cos", "row_sq", "col_sq"), got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


def test_implementation_switch():
  assert api.resolve_implementation(None, "cpu") == "xla_sparse"  # sparse backward
  assert api.resolve_implementation(None, "tpu") == "pallas_tpu"
  assert api.resolve_implementation(None, "rocm") == "xla"
  assert api.resolve_implementation("pallas_interpret", "tpu") == "pallas_interpret"
  with pytest.raises(ValueError, match="implementation"):
    api.resolve_implementation("cuda", "cpu")
  z, p, _ = _inputs(2, 8, 8, 20)
  with pytest.raises(ValueError, match="k must be"):
    api.topk_reconstruct(z, p, 21, implementation="pallas_interpret")
  out = api.topk_reconstruct(z, p, 3, implementation=None)
  _assert_matches(out, reference.topk_reconstruct_reference(z, p, 3), 0.0)


def test_default_is_resolved_for_the_platform_compiled_for():
  """One traced program, lowered for CPU and for TPU: the CPU program holds the CPU speed
  path (barriers, its name scope) and no kernel; the TPU one the Mosaic kernel and no CPU
  path (the choice is not the default backend's: this process runs on CPU)."""
  from pallas_kernels.topk_reconstruct import cpu  # pylint: disable=import-outside-toplevel
  z, p, mask = _inputs(6, 64, 16, 300)

  def f(z, p, mask):
    loss = lambda z, p: jnp.sum(api.topk_reconstruct(z, p, 4, mask_N=mask).z_hat_NxD ** 2)
    return jax.grad(loss, (0, 1))(z, p)
  traced = jax.jit(f).trace(z, p, mask)
  on_cpu = traced.lower(lowering_platforms=("cpu",)).as_text(debug_info=True)
  on_tpu = traced.lower(lowering_platforms=("tpu",)).as_text(debug_info=True)
  assert "optimization_barrier" in on_cpu and f"/{cpu.SCOPE}/" in on_cpu
  assert "tpu_custom_call" not in on_cpu
  assert "optimization_barrier" not in on_tpu and f"/{cpu.SCOPE}/" not in on_tpu
  assert on_tpu.count("tpu_custom_call") == 1
  # float64 inputs take the reference (autodiff, forward mode) on every platform
  with jax.enable_x64(True):
    z64, p64 = z.astype(jnp.float64), p.astype(jnp.float64)
    text = jax.jit(lambda z, p: api.topk_reconstruct(z, p, 4)).trace(z64, p64).lower(
        lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" not in text and "f64" in text


def test_a_fresh_process_compiles_a_program_with_the_op_once():
  """Tracing the default implementation traces every platform's branch; Pallas, imported
  then for the first time, registers trace-context settings, so the next call missed
  jax's cache and compiled the program again (each train step twice). A fresh process,
  since this one has imported Pallas long ago."""
  code = """
import jax, jax.numpy as jnp, numpy as np
from pallas_kernels.topk_reconstruct import api
rng = np.random.default_rng(5)
z, p = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((16, 32), (24, 32)))
f = jax.jit(lambda z, p: api.topk_reconstruct(z, p, 4).z_hat_NxD.sum())
f(z, p).block_until_ready(); f(z + 1, p).block_until_ready()
print("cache size", f._cache_size())
"""
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.split()[-1] == "1", out.stdout


@pytest.mark.parametrize("impl,blocks,message", [
    ("pallas_gpu", dict(block_n=48), "block_n=48: the GPU kernel needs a power of two"),
    ("pallas_gpu", dict(block_d=8), "block_d=8: the GPU kernel needs a power of two >= 16"),
    ("pallas_interpret", dict(block_k=100), "block_k=100: the TPU kernel needs a multiple"),
    ("pallas_interpret", dict(block_n=12), "block_n=12: the TPU kernel needs a multiple of 8"),
    ("pallas_tpu", dict(block_d=64), "block_d is a GPU-only option"),
])
def test_untileable_blocks_are_refused_clearly(impl, blocks, message):
  z, p, _ = _inputs(4, 16, 8, 40)
  with pytest.raises(ValueError, match=message):
    api.topk_reconstruct(z, p, 3, implementation=impl, **blocks)


def test_none_falls_back_to_the_reference_when_a_kernel_is_missing(monkeypatch):
  real_import = api.importlib.import_module

  def no_triton(name, *args):
    if name.endswith(".gpu"):
      raise ImportError("jax.experimental.pallas.triton was removed")
    return real_import(name, *args)
  monkeypatch.setattr(api.importlib, "import_module", no_triton)
  api._kernel_importable.cache_clear()  # pylint: disable=protected-access
  try:
    with pytest.warns(UserWarning, match="pallas_gpu unavailable.*XLA reference"):
      assert api.resolve_implementation(None, "cuda") == "xla"
    assert api.resolve_implementation(None, "tpu") == "pallas_tpu"
  finally:
    api._kernel_importable.cache_clear()  # pylint: disable=protected-access


def test_gpu_kernel_lowers_to_triton_for_h200():
  """The Triton lowering (not PTX compilation) runs on CPU against an abstract H200."""
  from jax._src import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  device = mesh_lib.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                                   abstract_device=device)

  def f(z, p, implementation):
    loss = lambda z, p: jnp.sum(api.topk_reconstruct(
        z, p, 16, implementation=implementation).z_hat_NxD)
    return jax.grad(loss, (0, 1))(z, p)
  for implementation in ("pallas_gpu", None):  # None: the kernel, chosen for cuda
    with jax.sharding.use_abstract_mesh(mesh):
      lowered = jax.jit(f, static_argnums=2).trace(
          jax.ShapeDtypeStruct((256, 200), jnp.bfloat16),
          jax.ShapeDtypeStruct((1000, 200), jnp.bfloat16), implementation).lower(
              lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert text.count("xla.gpu.triton") == 1
    if implementation is not None:  # None's program also carries the other platforms'
      # residuals as zeros (platform_dependent joins them), which XLA removes when the
      # forward and backward are compiled together
      assert "256x1000" not in text and "256,1000" not in text  # no N x K tensor


def test_benchmark_checks_what_it_times(monkeypatch):
  """bench_kernels' rows carry the timed kernel's agreement with the timed reference."""
  from benchmarks import kernel_bench_lib as benchmark  # pylint: disable=import-outside-toplevel
  monkeypatch.setitem(benchmark.SHAPES, "test", (48, 16, 300, 4))
  rows = benchmark.bench_shape("test", jnp.float32, "pallas_interpret", iters=1,
                               distance="cosine")
  kernel_fwd = [r for r in rows if r.impl == "pallas_interpret" and r.pass_.startswith("fwd ")]
  assert len(rows) == 4 and len(kernel_fwd) == 1
  assert kernel_fwd[0].ids_equal == 1.0 and kernel_fwd[0].zhat_rel_err < 1e-5
  assert "| 100.00% |" in benchmark.format_table(rows)


def test_merge_iteration_count_matches_brute_force():
  """benchmark.merge_iterations vs a direct sorted-list simulation of the running top-k."""
  from benchmarks import kernel_bench_lib as benchmark  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(8)
  z, p = rng.standard_normal((32, 12)), rng.standard_normal((96, 12))
  sims = (z / np.linalg.norm(z, axis=1, keepdims=True)) @ (
      p / np.linalg.norm(p, axis=1, keepdims=True)).T
  iters, inserts = [], []
  for b in range(0, 32, 16):
    lists = [[] for _ in range(16)]  # each row's running top-8 (k=5 pads to kp=8)
    for j in range(0, 96, 32):
      counts = []
      for r in range(16):
        tile = list(sims[b + r, j:j + 32])
        new = sorted(lists[r] + tile, reverse=True)[:8]
        counts.append(sum(v in tile for v in new))
        lists[r] = new
      iters.append(max(counts))
      inserts.append(np.mean(counts))
  got = benchmark.merge_iterations(z, p, 5, block_n=16, block_k=32)
  np.testing.assert_allclose(got, (np.mean(iters), np.mean(inserts)), rtol=1e-12)


@pytest.mark.parametrize("sequential", [False, True])
def test_gather_mix_on_bf16_rows_equals_widened_rows(sequential):
  """z_hat and its backward gather bf16 rows and widen after the gather: bitwise the same
  as widening the whole bank to fp32 first (bf16 -> fp32 is exact), for half the bytes."""
  rng = np.random.default_rng(12)
  n, d, num_protos, k = 40, 24, 70, 5
  p = jnp.asarray(rng.standard_normal((num_protos, d)), jnp.bfloat16)
  w = jnp.asarray(rng.random((n, k)), jnp.float32)
  idx = jnp.asarray(rng.integers(0, num_protos, (n, k)), jnp.int32)
  g = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
  new = lambda w, p: vjp.gather_mix(w, idx, p, sequential)
  old = lambda w, p: vjp.gather_mix(w, idx, p.astype(jnp.float32), sequential)
  (out_new, vjp_new), (out_old, vjp_old) = jax.vjp(new, w, p), jax.vjp(old, w, p)
  assert out_new.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(out_new), np.asarray(out_old))
  for a, b in zip(vjp_new(g), vjp_old(g)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  want = np.einsum("nk,nkd->nd", np.asarray(w, np.float64),
                   np.asarray(p, np.float64)[np.asarray(idx)])
  np.testing.assert_allclose(np.asarray(out_new), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gather", ["all", "rows", "loop"])
def test_sparse_mixture_forms_equal_float64(gather):
  """The one sparse reconstruction: each memory form computes sum_j w_j rows[idx_j]."""
  rng = np.random.default_rng()
  n, d, num_rows, k = 33, 20, 50, 6
  w, rows = rng.random((n, k)), rng.standard_normal((num_rows, d))
  idx = rng.integers(0, num_rows, (n, k))
  want = np.einsum("nk,nkd->nd", w, rows[idx])
  with jax.enable_x64(True):
    got = reference.sparse_mixture(jnp.asarray(w), jnp.asarray(idx, jnp.int32),
                                   jnp.asarray(rows), gather=gather)
    assert got.dtype == jnp.float64
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12, atol=1e-12)
  with pytest.raises(ValueError, match="gather="):
    reference.sparse_mixture(jnp.asarray(w), jnp.asarray(idx), jnp.asarray(rows), gather="x")


@pytest.mark.parametrize("opts", [pytest.param(TPU_INTERP, marks=pytest.mark.long), GPU_INTERP],
                         ids=["tpu", "gpu"])  # tpu: make test-long (issue 56 item 7)
def test_edge_cases_match_reference(opts):
  """k = K (every prototype active), a zero token and a zero prototype (the norm guard),
  and a batch whose tokens are all masked (no column statistics: +-inf as the reference)."""
  rng = np.random.default_rng(77)
  n, d, num_protos = 20, 8, 24
  z = rng.standard_normal((n, d)).astype(np.float32)
  p = rng.standard_normal((num_protos, d)).astype(np.float32)
  z[3], p[5] = 0.0, 0.0
  z, p = jnp.asarray(z), jnp.asarray(p)
  for distance in ("cosine", "sqeuclidean"):
    kopts = api.KernelOptions(distance=distance, **opts)
    for k, mask in ((num_protos, None), (4, jnp.zeros((n,), bool))):
      out = _run(z, p, k, kopts, "normalized", mask)
      ref = reference.topk_reconstruct_reference(z, p, k, mixture="normalized",
                                                 distance=distance, mask_N=mask)
      _assert_matches(out, ref, 1e-5)
    kernel = lambda z, p: api.run_with_options(z, p, num_protos, kopts, mixture="normalized")
    ref_fn = lambda z, p: reference.topk_reconstruct_reference(
        z, p, num_protos, mixture="normalized", distance=distance)
    g_kernel = jax.grad(_weighted_loss(kernel, 3, n, num_protos, d, num_protos), (0, 1))(z, p)
    g_ref = jax.grad(_weighted_loss(ref_fn, 3, n, num_protos, d, num_protos), (0, 1))(z, p)
    scale = max(float(jnp.max(jnp.abs(g))) for g in g_ref)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in g_kernel)
    chex.assert_trees_all_close(g_kernel, g_ref, atol=1e-5 * scale, rtol=0)


def test_untileable_blocks_are_refused_on_every_entry_point():
  z, p, _ = _inputs(5, 16, 8, 40)
  with pytest.raises(ValueError, match="block_k=100: the TPU kernel needs a multiple"):
    _run(z, p, 3, api.KernelOptions(interpret=True, block_k=100))
  with pytest.raises(ValueError, match="block_n=24: the GPU kernel needs a power of two"):
    api.argstats(z, p, 3, api.KernelOptions(backend="gpu", interpret=True, block_n=24))
