"""The shared base of the top-k reconstruction op's tests: every implementation, distance,
mixture, mask and mesh path, against a float64 NumPy reference written here from the
maths (PRISM.md §1), independent of the op's own reference.py.

Shapes are small (interpret-mode Pallas is slow) but K spans several kernel tiles and is
not a multiple of them. Fresh random inputs; float32 top-k ids are compared exactly where
the float64 gap between neighbours is wide enough for float32 rounding not to swap them.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from pallas_kernels.topk_reconstruct import api

EPS = 1e-6
TPU_INTERP = dict(interpret=True, block_n=16, block_k=128)
GPU_INTERP = dict(backend="gpu", interpret=True, block_n=16, block_k=32, block_d=16)

# name -> keyword arguments of api.topk_reconstruct (the GPU kernel interpreted has no
# implementation name: it runs through api.run_with_options with its options)
IMPLEMENTATIONS = {
    "default": dict(implementation=None),
    "xla": dict(implementation="xla"),
    "xla_sparse": dict(implementation="xla_sparse"),
    "pallas_interpret": dict(implementation="pallas_interpret", block_n=8, block_k=128),
    "gpu_interpret": None,
}
# name -> (data, fsdp, model) mesh sizes on the 8 CPU devices; None: no mesh
MESHES = {"none": None, "tokens": (4, 2, 1), "bank": (2, 1, 4)}


def inputs(seed: int, n: int, d: int, num_protos: int, dtype=jnp.float32, masked=True):
  rng = np.random.default_rng(seed)
  z = jnp.asarray(rng.standard_normal((n, d)), dtype)
  p = jnp.asarray(rng.standard_normal((num_protos, d)), dtype)
  mask = jnp.asarray(rng.random(n) > 0.3) if masked else None
  return z, p, mask


def numpy_reference(z, p, k: int, *, mixture="raw", distance="cosine", mask=None):
  """The op's eight outputs in float64 NumPy (ties: lower prototype id)."""
  z, p = np.asarray(z, np.float64), np.asarray(p, np.float64)
  n = z.shape[0]
  valid = np.ones(n, bool) if mask is None else np.asarray(mask, bool)
  nz = np.maximum(np.linalg.norm(z, axis=1), EPS)
  np_ = np.maximum(np.linalg.norm(p, axis=1), EPS)
  cos = (z @ p.T) / nz[:, None] / np_[None, :]
  idx = np.argsort(-cos, axis=1, kind="stable")[:, :k]
  sim = np.take_along_axis(cos, idx, 1)
  act = np.maximum(sim, 0.0)
  if mixture == "normalized":
    act = act / np.maximum(act.sum(1, keepdims=True), EPS)
  z_hat = np.einsum("nk,nkd->nd", act, p[idx])
  col_max = np.where(valid[:, None], cos, -np.inf).max(0)
  if distance == "cosine":
    row_min, col_min = 1.0 - sim[:, 0], 1.0 - col_max
  else:
    sq = np.maximum((z * z).sum(1)[:, None] + (p * p).sum(1)[None, :] - 2.0 * z @ p.T, 0.0)
    row_min, col_min = sq.min(1), np.where(valid[:, None], sq, np.inf).min(0)
  return api.TopKReconstruction(idx, act, sim, z_hat, sim[:, 0], col_max, row_min, col_min)


def well_separated(ref, tol: float) -> np.ndarray:
  """Rows whose k+1 largest cosines are more than `tol` apart (float32 ids are exact)."""
  sims = np.asarray(ref.sim_Nxk)
  return np.all(np.abs(np.diff(sims, axis=1)) > tol, axis=1)


def assert_matches(out, ref, rtol: float, *, ids=True):
  """Ids exactly (where `ids`), every value within rtol of its output's largest value,
  and the same non-finite entries (columns with no valid token)."""
  if ids:
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(ref[0]), err_msg="idx")
  for name, a, b in zip(api.TopKReconstruction._fields[1:], out[1:], ref[1:]):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    np.testing.assert_array_equal(np.isfinite(a), np.isfinite(b), err_msg=name)
    fin = np.isfinite(b)
    scale = max(np.max(np.abs(b[fin]), initial=0.0), 1e-30)
    np.testing.assert_allclose(a[fin], b[fin], rtol=0, atol=rtol * scale, err_msg=name)


def weighted_loss(fn, seed: int, n: int, num_protos: int, d: int, k: int):
  """A random-weighted sum of every differentiable output (each cotangent nonzero);
  `fn(z, p)` returns the op's outputs."""
  rng = np.random.default_rng(seed)
  shapes = [(n, k), (n, k), (n, d), (n,), (num_protos,), (n,), (num_protos,)]
  weights = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]

  def loss(z, p):
    out = fn(z, p)
    return sum(jnp.sum(w * jnp.where(jnp.isfinite(o), o, 0.0))
               for w, o in zip(weights, out[1:]))
  return loss


def assert_grads_close(got, want, rtol: float = 1e-5):
  scale = max(float(jnp.max(jnp.abs(g))) for g in want)
  chex.assert_trees_all_close(got, want, atol=rtol * scale, rtol=0)


def op(name: str, k: int, **kw):
  """fn(z, p, mask) running implementation `name` with the mesh axes of the rules."""
  axes = dict(token_axes=("data", "fsdp"), model_axis="model")
  if name == "gpu_interpret":
    opts = api.KernelOptions(distance=kw["distance"], **GPU_INTERP)
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.shape.get("model", 1) > 1:
      from pallas_kernels.topk_reconstruct import sharded  # pylint: disable=import-outside-toplevel
      return lambda z, p, m: sharded.topk_reconstruct_sharded(
          z, p, k, mixture=kw["mixture"], distance=kw["distance"], mask_N=m, opts=opts,
          token_axes=axes["token_axes"], model_axis="model")
    return lambda z, p, m: api.run_with_options(z, p, k, opts, mixture=kw["mixture"],
                                                mask_N=m, token_axes=axes["token_axes"])
  return lambda z, p, m: api.topk_reconstruct(z, p, k, mask_N=m, **IMPLEMENTATIONS[name],
                                              **axes, **kw)


def make_mesh(sizes):
  return jax.make_mesh(sizes, ("data", "fsdp", "model"), axis_types=(AxisType.Auto,) * 3)


def place(mesh, z, p, mask):
  """z and the mask split over the token axes, the bank over `model`."""
  tokens = P(("data", "fsdp"))
  z = jax.device_put(z, NamedSharding(mesh, P(("data", "fsdp"), None)))
  p = jax.device_put(p, NamedSharding(mesh, P("model", None)))
  mask = None if mask is None else jax.device_put(mask, NamedSharding(mesh, tokens))
  return z, p, mask
