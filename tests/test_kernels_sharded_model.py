"""The Pallas kernel behind the K-sharded prototype layer (bank split over `model`).

With implementation="pallas_interpret" on a mesh whose `model` axis is > 1, each shard's
similarity, local top-k and statistics come from the kernel: the compiled step must still
never communicate anything similarity-sized, and ties across shards go to the lower id.
(Outputs and gradients on this mesh: tests/test_kernels.py's shared base, mesh "bank".)
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from prism_jax import sharding
from prism_jax.config import MeshConfig
from prism_jax.model.prototypes import prototype_layer
from test_sharding_prototypes import _inputs, collectives


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
