"""The Pallas kernel behind the K-sharded prototype layer (bank split over `model`).

With implementation="pallas_interpret" on a mesh whose `model` axis is > 1, each shard's
similarity, local top-k and statistics come from the kernel; outputs and gradients must
equal the unsharded XLA layer, and the compiled step must still never communicate
anything similarity-sized.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from prism_jax import sharding
from prism_jax.config import MeshConfig
from prism_jax.model.prototypes import prototype_layer
from test_sharding_prototypes import _inputs, assert_layer_matches, collectives

FIELDS = ("idx_Nxk", "act_Nxk", "sim_Nxk", "z_hat_NxD", "residual_NxD", "row_max_cos_N",
          "col_max_cos_K", "row_min_dist_N", "col_min_dist_K")


def _objective(z, protos, mask, k, distance, mixture, implementation):
  """A scalar touching every differentiable output of the layer with distinct weights."""
  out = prototype_layer(z, protos, k, mask_N=mask, distance=distance, mixture=mixture,
                        residual_routing="plain", implementation=implementation)
  w_k = jnp.arange(1, k + 1, dtype=jnp.float32)
  w_K = jnp.linspace(0.5, 1.5, protos.shape[0])
  fin = lambda x: jnp.where(jnp.isfinite(x), x, 0.0)
  val = (jnp.sum(out.z_hat_NxD ** 2) + jnp.sum(out.act_Nxk * w_k)
         + jnp.sum(out.sim_Nxk * w_k[::-1]) + 0.3 * jnp.sum(out.row_max_cos_N)
         + jnp.sum(out.row_min_dist_N ** 2) + 0.1 * jnp.sum(out.residual_NxD * z)
         + jnp.sum(fin(out.col_min_dist_K) * w_K) + jnp.sum(fin(out.col_max_cos_K) * w_K[::-1]))
  return val, out


@pytest.mark.parametrize("shape,distance,mixture", [
    ((2, 1, 4), "cosine", "raw"), ((1, 1, 8), "sqeuclidean", "normalized")])
def test_kernel_sharded_layer_matches_unsharded_xla(shape, distance, mixture):
  n, num_protos, d, k = 32, 64, 16, 4
  z, protos, mask = _inputs(11 + len(distance) + shape[0], n, num_protos, d)
  grad_fn = jax.value_and_grad(_objective, argnums=(0, 1), has_aux=True)
  (v0, ref), g0 = grad_fn(z, protos, mask, k, distance, mixture, "xla")  # no mesh
  with jax.set_mesh(sharding.make_mesh(MeshConfig(*shape))):
    step = jax.jit(grad_fn, static_argnums=(3, 4, 5, 6))
    jaxpr = str(jax.make_jaxpr(step, static_argnums=(3, 4, 5, 6))(
        z, protos, mask, k, distance, mixture, "pallas_interpret"))
    (v1, out), g1 = step(z, protos, mask, k, distance, mixture, "pallas_interpret")
  assert "pallas_call" in jaxpr and "shard_map" in jaxpr  # the kernel runs per shard
  fields = lambda o: [getattr(o, name) for name in FIELDS]
  assert_layer_matches(FIELDS, fields(ref), fields(out), (v0, g0), (v1, g1), shape, tol=1e-5)


def test_kernel_sharded_hlo_never_communicates_the_similarity_matrix():
  n, num_protos, d, k = 320, 1024, 12, 4  # token, bank, feature, k*m dims never coincide
  data, m = 2, 4
  mesh = sharding.make_mesh(MeshConfig(data, 1, m))

  def loss(z, protos, mask):
    out = prototype_layer(z, protos, k, mask_N=mask, distance="sqeuclidean",
                          implementation="pallas_interpret")
    return (jnp.sum(out.residual_NxD * out.z_hat_NxD) + jnp.mean(out.col_min_dist_K)
            + jnp.mean(out.row_min_dist_N) + jnp.sum(out.act_Nxk))

  with jax.set_mesh(mesh):
    args = (jax.ShapeDtypeStruct((n, d), jnp.float32,
                                 sharding=NamedSharding(mesh, P(("data", "fsdp"), None))),
            jax.ShapeDtypeStruct((num_protos, d), jnp.float32,
                                 sharding=NamedSharding(mesh, P("model", "fsdp"))),
            jax.ShapeDtypeStruct((n,), jnp.bool_, sharding=NamedSharding(
                mesh, P(("data", "fsdp")))))
    lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args)
    assert "tpu_custom_call" not in lowered.as_text()  # interpreted, not Mosaic
    colls = collectives(lowered.compile().as_text())
  assert colls, "expected collectives in the sharded layer"
  n_local, k_local = n // data, num_protos // m
  for kind, shape, _ in colls:
    assert int(np.prod(shape)) < n_local * k_local // 8, f"{kind} {shape} is similarity-sized"
    assert not ({n, n_local} & set(shape) and {num_protos, k_local} & set(shape)), shape
  total = sum(b for _, _, b in colls)
  bound = 4 * (4 * n_local * k * m + 4 * n_local * d + 4 * k_local * d
               + 4 * k_local * data + 2 * n_local * m)
  assert total <= bound, (total, bound)


def test_kernel_sharded_ties_and_k_above_shard_size():
  """k > K/m (each shard's kernel offers all it holds); duplicate prototypes on different
  shards tie exactly and the lower id must win, as in the unsharded XLA layer."""
  z, protos, mask = _inputs(5, 32, 16, 8)
  protos = protos.at[11].set(protos[3]).at[14].set(protos[1])  # shards 5, 7 copy 1, 0
  ref = prototype_layer(z, protos, 6, mask_N=mask, implementation="xla")
  with jax.set_mesh(sharding.make_mesh(MeshConfig(1, 1, 8))):
    out = jax.jit(prototype_layer, static_argnums=2, static_argnames="implementation")(
        z, protos, 6, mask_N=mask, implementation="pallas_interpret")
  np.testing.assert_array_equal(out.idx_Nxk, ref.idx_Nxk)
  idx = np.asarray(ref.idx_Nxk)
  tied = ((idx == 3).any(1) & (idx == 11).any(1)) | ((idx == 1).any(1) & (idx == 14).any(1))
  assert tied.any()  # the comparison above exercised the tie-break
  for name in ("sim_Nxk", "z_hat_NxD", "col_max_cos_K"):
    np.testing.assert_allclose(getattr(out, name), getattr(ref, name), rtol=1e-5, atol=1e-5,
                               err_msg=name)
