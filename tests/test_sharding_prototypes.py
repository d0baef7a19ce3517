"""The K-sharded prototype layer: equals the unsharded layer (values and gradients), and
its compiled HLO never communicates the N x K similarity matrix."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_kernels.topk_reconstruct import sharded as sharded_op
from prism_jax import sharding
from prism_jax.config import MeshConfig
from prism_jax.model.prototypes import prototype_layer, topk_reconstruct_xla

FIELDS = ("idx", "act", "sim", "z_hat", "row_max_cos", "col_max_cos", "row_min_dist",
          "col_min_dist")


def _inputs(seed, n, num_protos, d):
  rng = np.random.default_rng(seed)
  z = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
  protos = jnp.asarray(rng.normal(size=(num_protos, d)), jnp.float32)
  mask = jnp.asarray(rng.random(n) > 0.25)
  return z, protos, mask


def _objective(fn, z, protos, mask, k, distance, mixture):
  """A scalar touching every differentiable output with distinct weights."""
  out = fn(z, protos, k, mask_N=mask, distance=distance, mixture=mixture)
  _, act, sim, z_hat, row_max, col_max, row_min, col_min = out
  w_k = jnp.arange(1, k + 1, dtype=jnp.float32)
  w_K = jnp.linspace(0.5, 1.5, protos.shape[0])
  finite = jnp.isfinite(col_min)
  val = (jnp.sum(z_hat ** 2) + jnp.sum(act * w_k) + jnp.sum(sim * w_k[::-1])
         + 0.3 * jnp.sum(row_max) + jnp.sum(row_min ** 2)
         + jnp.sum(jnp.where(finite, col_min, 0.0) * w_K)
         + jnp.sum(jnp.where(jnp.isfinite(col_max), col_max, 0.0) * w_K[::-1]))
  return val, out


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(a)), 1e-30))


@pytest.mark.parametrize("shape,distance,mixture", [
    ((8, 1, 1), "sqeuclidean", "raw"), ((2, 2, 2), "cosine", "raw"),
    ((1, 2, 4), "sqeuclidean", "normalized"), ((1, 1, 8), "cosine", "normalized")])
def test_sharded_layer_matches_unsharded(shape, distance, mixture):
  k = 4
  z, protos, mask = _inputs(sum(shape) + len(distance), 64, 32, 16)
  grad_fn = jax.value_and_grad(_objective, argnums=(1, 2), has_aux=True)
  (v0, out0), g0 = grad_fn(topk_reconstruct_xla, z, protos, mask, k, distance, mixture)
  mesh = sharding.make_mesh(MeshConfig(*shape))
  with jax.set_mesh(mesh):
    sharded = jax.jit(grad_fn, static_argnums=(0, 4, 5, 6))
    (v1, out1), g1 = sharded(_k_sharded, z, protos, mask, k, distance, mixture)
  assert_layer_matches(FIELDS, out0, out1, (v0, g0), (v1, g1), shape, tol=2e-5)


def _k_sharded(z, protos, k, **kw):
  """The op's K-sharded path on the mesh axes of the rules table (XLA per shard)."""
  return sharded_op.topk_reconstruct_sharded(z, protos, k, model_axis="model",
                                             token_axes=sharding.mesh_axes("tokens"), **kw)


def assert_layer_matches(names, ref, out, ref_value_grads, value_grads, shape, tol):
  """`out` (a mesh run) equals `ref` (one device): the same active prototypes in the same
  order, every other output within `tol` (and infinite in the same places), the objective
  within 1e-5 relative and its (dz, dprotos) gradients within 1e-5 relative error."""
  np.testing.assert_array_equal(ref[0], out[0])  # same active prototypes, same order
  for name, a, b in zip(names[1:], ref[1:], out[1:]):
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_array_equal(np.isfinite(a), np.isfinite(b), err_msg=name)
    np.testing.assert_allclose(b[np.isfinite(b)], a[np.isfinite(a)], rtol=tol, atol=tol,
                               err_msg=name)
  (v0, g0), (v1, g1) = ref_value_grads, value_grads
  assert abs(float(v1) - float(v0)) <= 1e-5 * abs(float(v0))
  for name, a, b in zip(("dz", "dprotos"), g0, g1):
    assert _rel(a, b) <= 1e-5, f"{name} relative error {_rel(a, b):.2e} on mesh {shape}"


def test_more_shards_than_k_per_shard_and_ties():
  """k > K/m (each shard offers all it has); duplicate prototypes on different shards
  tie exactly and the lower id must win, as in the unsharded layer."""
  z, protos, mask = _inputs(7, 32, 16, 8)
  protos = protos.at[11].set(protos[3]).at[14].set(protos[1])  # shards 5, 7 copy 1, 0
  ref = topk_reconstruct_xla(z, protos, 6, mask_N=mask)
  with jax.set_mesh(sharding.make_mesh(MeshConfig(1, 1, 8))):
    out = jax.jit(prototype_layer, static_argnums=2)(z, protos, 6, mask_N=mask)
  np.testing.assert_array_equal(out.idx_Nxk, ref[0])
  idx = np.asarray(ref[0])
  tied_rows = ((idx == 3).any(1) & (idx == 11).any(1)) | ((idx == 1).any(1) & (idx == 14).any(1))
  assert tied_rows.any()  # the comparison above exercised the tie-break
  np.testing.assert_allclose(out.z_hat_NxD, ref[3], rtol=1e-5, atol=1e-5)


def test_routing_and_bad_bank_size():
  z, protos, mask = _inputs(3, 16, 12, 8)
  assert not sharded_op.use_sharded(12, "model")  # no mesh: unsharded path
  with jax.set_mesh(sharding.make_mesh(MeshConfig(1, 2, 4))):
    assert sharded_op.model_shards("model") == 4
    txt = jax.jit(prototype_layer, static_argnums=2).lower(z, protos, 3).as_text()
    assert "shard_map" in txt or "sdy.manual_computation" in txt
  with jax.set_mesh(sharding.make_mesh(MeshConfig(1, 1, 8))):
    with pytest.raises(ValueError, match="K=12 prototypes cannot be sharded"):
      prototype_layer(z, protos, 3)


_COLLECTIVE = re.compile(r"=\s*(\(.*?\)|\S+)\s+(all-gather|all-reduce|reduce-scatter|"
                         r"all-to-all|collective-permute)(-start)?\(")
_SHAPE = re.compile(r"(pred|s8|u8|s32|u32|f32|bf16|f16|s64|f64)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "f64": 8}


def collectives(hlo_text: str) -> list[tuple[str, tuple[int, ...], int]]:
  """(kind, result shape, result bytes) of every collective in compiled HLO text."""
  out = []
  for line in hlo_text.splitlines():
    m = _COLLECTIVE.search(line)
    if not m:
      continue
    for dtype, dims in _SHAPE.findall(m.group(1)):
      shape = tuple(int(x) for x in dims.split(",") if x)
      out.append((m.group(2), shape, int(np.prod(shape, dtype=np.int64)) * _BYTES[dtype]))
  return out


def _layer_step_hlo(mesh, n, num_protos, d, k):
  """Compiled forward+backward of the layer inside a loss, inputs sharded as in training."""
  def loss(z, protos, mask):
    out = prototype_layer(z, protos, k, mask_N=mask)
    return (jnp.sum(out.residual_NxD * out.z_hat_NxD) + jnp.mean(out.col_min_dist_K)
            + jnp.mean(out.row_min_dist_N) + jnp.sum(out.act_Nxk))
  tok = NamedSharding(mesh, P(("data", "fsdp")))
  with jax.set_mesh(mesh):
    args = (jax.ShapeDtypeStruct((n, d), jnp.float32,
                                 sharding=NamedSharding(mesh, P(("data", "fsdp"), None))),
            jax.ShapeDtypeStruct((num_protos, d), jnp.float32,
                                 sharding=NamedSharding(mesh, P("model", "fsdp"))),
            jax.ShapeDtypeStruct((n,), jnp.bool_, sharding=tok))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile().as_text()


def test_hlo_never_communicates_the_similarity_matrix():
  n, d, k = 768, 16, 4  # sizes chosen so token and bank dims never coincide
  mesh = sharding.make_mesh(MeshConfig(2, 1, 4))
  data, m = 2, 4
  totals = {}
  for num_protos in (4096, 8192):
    colls = collectives(_layer_step_hlo(mesh, n, num_protos, d, k))
    assert colls, "expected collectives in the sharded layer"
    local_sim = (n // data) * (num_protos // m)  # one device's similarity block
    for kind, shape, _ in colls:
      size = int(np.prod(shape))
      assert size < local_sim // 8, f"{kind} of shape {shape} is similarity-sized"
      assert not ({n, n // data} & set(shape) and {num_protos, num_protos // m} & set(shape))
    totals[num_protos] = sum(b for _, _, b in colls)
    # O(N k m): candidates (values + ids, forward + backward), the z_hat psum (n x D,
    # forward + backward), and the bank-gradient reduce over data (K/m x D, + transpose).
    n_local, k_local = n // data, num_protos // m
    bound = 4 * (4 * n_local * k * m + 4 * n_local * d + 4 * k_local * d
                 + 4 * k_local * data + 2 * n_local * m)
    assert totals[num_protos] <= bound, (totals[num_protos], bound)
  # Doubling K adds only the bank-gradient reduction (K/m x D values), nothing N x K.
  growth = totals[8192] - totals[4096]
  assert growth <= 4 * 4 * (4096 // m) * (d + data), growth
  print(f"\ncollective bytes per device per step (N={n}, D={d}, k={k}, mesh 2x1x4): "
        f"K=4096 -> {totals[4096]}, K=8192 -> {totals[8192]}; N*K*4 = {n * 4096 * 4}")
