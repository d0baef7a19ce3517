"""Ahead-of-time Mosaic compile of the TPU kernel for a v5e topology (needs libtpu: the
`tpu-aot` extra). At the XL shape (N=65,536, D=1,600, K=16,384, k=16) the compiled
program must hold no N x K buffer: its temporaries stay far below the 4 GiB an fp32
N x K matrix takes, while the XLA reference's exceed it."""

import importlib.util
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.topk_reconstruct import api

pytestmark = [
    pytest.mark.tpu_aot,
    pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                       reason="libtpu not installed (pip install -e '.[tpu-aot]')"),
]


# libtpu takes a process-wide lockfile; AOT compiles from two processes (pytest-xdist
# workers, another compile check) are safe, so let them share it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def _compile(fn, n, d, num_protos, dtype):
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  topo = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")
  mesh = jax.sharding.Mesh(np.array(topo.devices[:1]), ("x",))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  args = (jax.ShapeDtypeStruct((n, d), dtype, sharding=rep),
          jax.ShapeDtypeStruct((num_protos, d), dtype, sharding=rep),
          jax.ShapeDtypeStruct((n,), jnp.bool_, sharding=rep))
  return jax.jit(fn).lower(*args).compile()


@pytest.mark.parametrize("distance,dtype", [("sqeuclidean", jnp.bfloat16),
                                            ("cosine", jnp.float32)])
def test_mosaic_compiles_forward_and_backward(distance, dtype):
  def fwd_bwd(z, p, mask):
    def loss(z, p):
      out = api.topk_reconstruct(z, p, 16, distance=distance, mask_N=mask,
                                 implementation="pallas_tpu")
      return jnp.sum(out.z_hat_NxD) + jnp.sum(out.row_min_dist_N)
    return jax.grad(loss, (0, 1))(z, p)
  compiled = _compile(fwd_bwd, 512, 256, 1000, dtype)
  assert "prism_topk_tpu" in compiled.as_text()


def test_xl_forward_has_no_nxk_buffer():
  n, d, num_protos = 65536, 1600, 16384
  nxk_bytes = n * num_protos * 4

  def fwd(z, p, mask):
    return api.topk_reconstruct(z, p, 16, mask_N=mask, implementation="pallas_tpu")
  compiled = _compile(fwd, n, d, num_protos, jnp.float32)
  temp = compiled.memory_analysis().temp_size_in_bytes
  print(f"XL forward temp {temp / 2**30:.3f} GiB (N x K fp32 = {nxk_bytes / 2**30:.1f} GiB)")
  assert temp < nxk_bytes / 2
  shapes = re.findall(r"\[([0-9,]+)\]", compiled.as_text())
  assert not [s for s in shapes if f"{n}" in s and f"{num_protos}" in s], "an N x K array"


def test_mosaic_compiles_sharded_over_tokens():
  """Data-parallel training: under a 4-chip mesh whose token axis the caller names, the op
  runs the kernel per shard in shard_map (Mosaic kernels cannot be auto-partitioned), for
  the kernel and for the default implementation resolved for TPU."""
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  topo = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")
  mesh = jax.sharding.Mesh(np.array(topo.devices).reshape(4, 1), ("data", "model"),
                           axis_types=(jax.sharding.AxisType.Auto,) * 2)
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def fwd_bwd(z, p, mask, implementation):
    def loss(z, p):
      out = api.topk_reconstruct(z, p, 16, mask_N=mask, implementation=implementation,
                                 token_axes=("data",), model_axis="model")
      return jnp.sum(out.z_hat_NxD) + jnp.sum(out.col_min_dist_K)
    return jax.grad(loss, (0, 1))(z, p)
  for implementation in ("pallas_tpu", None):
    with jax.set_mesh(mesh):
      compiled = jax.jit(fwd_bwd, static_argnums=3).lower(
          jax.ShapeDtypeStruct((2048, 256), jnp.float32, sharding=rows),
          jax.ShapeDtypeStruct((1000, 256), jnp.float32, sharding=rep),
          jax.ShapeDtypeStruct((2048,), jnp.bool_, sharding=rows), implementation).compile()
    text = compiled.as_text()
    assert "prism_topk_tpu" in text and "all-gather" in text, implementation
