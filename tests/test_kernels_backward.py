"""The unsharded layer's single custom_vjp (`vjp.layer`) vs the old composition of
`vjp.stats` (kernel statistics), the mixture (autodiff) and `vjp.gather_mix` (z_hat).

Both run the same interpreted kernel forward; their backwards differ only in the order of
fp32 sums (the bank's two gradient terms are now summed per row before one scatter-add).
"""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.topk_reconstruct import api, reference, vjp
from prism_jax.model.prototypes import mixture_weights

TPU_INTERP = dict(interpret=True, block_n=16, block_k=128)
GPU_INTERP = dict(backend="gpu", interpret=True, block_n=16, block_k=32, block_d=16)


def _old_layer(z, p, valid, k, opts, mixture):
  """The composition `run_with_options` used before `vjp.layer` (still the K-sharded
  path's per-shard composition, sharded._local_kernel)."""
  out = vjp.stats(z, p, valid, k, opts)
  act = mixture_weights(out[0], mixture)
  return out, act, vjp.gather_mix(act, out[1], p, opts.backend == "tpu")


def _new_layer(z, p, valid, k, opts, mixture):
  return vjp.layer(z, p, valid, k, opts, mixture)


def _loss(layer, k, opts, mixture, valid, seed):
  """Random-weighted sum of every differentiable output, so each cotangent is nonzero."""
  def loss(z, p):
    out, act, z_hat = layer(z, p, valid, k, opts, mixture)
    floats = [out[0], out[2], act, z_hat] + ([out[4], out[6]] if len(out) > 4 else [])
    rng = np.random.default_rng(seed)
    total = 0.0
    for x in floats:
      w = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
      total += jnp.sum(w * jnp.where(jnp.isfinite(x), x, 0.0))
    return total
  return loss


@pytest.mark.parametrize("seed,distance,mixture,dtype,backend", [
    (1, "cosine", "raw", jnp.float32, TPU_INTERP),
    (2, "cosine", "raw", jnp.bfloat16, GPU_INTERP),
    # Both backends and dtypes above; the other distance and mixture: make test-long
    # (issue 56 item 7).
    pytest.param(3, "sqeuclidean", "normalized", jnp.float32, GPU_INTERP,
                 marks=pytest.mark.long),
    pytest.param(4, "sqeuclidean", "normalized", jnp.bfloat16, TPU_INTERP,
                 marks=pytest.mark.long),
])
def test_single_vjp_equals_old_composition(seed, distance, mixture, dtype, backend):
  n, d, num_protos, k = 40, 24, 150, 5
  rng = np.random.default_rng(seed)
  z = jnp.asarray(rng.standard_normal((n, d)), dtype)
  p = jnp.asarray(rng.standard_normal((num_protos, d)), dtype)
  valid = jnp.asarray(rng.random(n) > 0.3, jnp.float32)
  opts = api.KernelOptions(distance=distance, **backend)
  seed = int(rng.integers(2**31))
  grads = {}
  for name, layer in (("old", _old_layer), ("new", _new_layer)):
    loss = _loss(layer, k, opts, mixture, valid, seed)
    grads[name] = jax.jit(jax.value_and_grad(loss, (0, 1)))(z, p)
  (v_old, g_old), (v_new, g_new) = grads["old"], grads["new"]
  assert float(v_old) == float(v_new)  # identical forwards
  for a, b in zip(g_new, g_old):
    assert a.dtype == b.dtype == dtype
  scale = max(float(jnp.max(jnp.abs(g.astype(jnp.float32)))) for g in g_old)
  # fp32: summation order only. bf16: the old path rounded each of the bank's two terms
  # to bf16 before adding them, the new one rounds their fp32 sum once.
  tol = 1e-5 if dtype == jnp.float32 else 2.0 ** -7
  chex.assert_trees_all_close(jax.tree.map(lambda g: g.astype(jnp.float32), g_new),
                              jax.tree.map(lambda g: g.astype(jnp.float32), g_old),
                              atol=tol * scale, rtol=0)
  if dtype == jnp.bfloat16:  # new: the fp32 gradient (same values) rounded once to bf16
    loss = _loss(_new_layer, k, opts, mixture, valid, seed)
    g_32 = jax.jit(jax.grad(loss, (0, 1)))(z.astype(jnp.float32), p.astype(jnp.float32))
    for a, b in zip(g_new, g_32):
      a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
      assert np.all(np.abs(a - b) <= 1.05 * 2.0 ** -8 * np.abs(b) + 1e-6 * scale)
  else:  # and both against autodiff of the XLA reference
    def ref_layer(z, p, valid, k, opts, mixture):
      del opts
      r = reference.topk_reconstruct_reference(z, p, k, mixture=mixture, distance=distance,
                                               mask_N=valid > 0)
      out = (r[2], r[0], r[5], None) + ((r[6], None, r[7], None)
                                        if distance == "sqeuclidean" else ())
      return out, r[1], r[3]
    g_ref = jax.grad(_loss(ref_layer, k, opts, mixture, valid, seed), (0, 1))(z, p)
    chex.assert_trees_all_close(g_new, g_ref, atol=1e-5 * scale, rtol=0)


@pytest.mark.parametrize("layer,scatters_per_j", [(_old_layer, 2), (_new_layer, 1)])
def test_bank_gradient_is_one_set_of_k_scatters(layer, scatters_per_j):
  """Unrolled (GPU) form, cosine: the backward's N-row scatter-adds into the K x D bank."""
  n, d, num_protos, k = 24, 8, 40, 3
  z = jax.ShapeDtypeStruct((n, d), jnp.float32)
  p = jax.ShapeDtypeStruct((num_protos, d), jnp.float32)
  valid = jnp.ones((n,), jnp.float32)
  opts = api.KernelOptions(**GPU_INTERP)
  loss = lambda z, p: jnp.sum(layer(z, p, valid, k, opts, "raw")[2])
  text = str(jax.make_jaxpr(jax.grad(loss, 1))(z, p))
  bank = re.findall(rf"f32\[{num_protos},{d}\] = scatter-add", text)
  assert len(bank) == scatters_per_j * k
