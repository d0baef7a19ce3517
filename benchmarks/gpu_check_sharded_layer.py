"""GPU check: the K-sharded prototype layer with the Pallas kernel vs the XLA reference.

Runs on one device with a (1,1,1) mesh (outputs and gradients), e.g. on a lent H200:
  python -m benchmarks.gpu_check_sharded_layer [--impl=pallas_gpu]
(`IMPL=pallas_gpu` in the environment, the older spelling, sets the default of --impl.)
"""

import os

from absl import flags

from pallas_kernels.topk_reconstruct import api
from prism_jax.cli import launcher

flags.DEFINE_enum("impl", os.environ.get("IMPL", "pallas_gpu"),
                  [i for i in api.IMPLEMENTATIONS if i is not None],
                  "the sharded layer's implementation checked against the XLA reference")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from pallas_kernels.topk_reconstruct import reference  # pylint: disable=g-import-not-at-top
  from pallas_kernels.topk_reconstruct import sharded  # pylint: disable=g-import-not-at-top
  from prism_jax import sharding  # pylint: disable=g-import-not-at-top
  from prism_jax.config import MeshConfig  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  z = jnp.asarray(rng.normal(size=(512, 64)), jnp.float32)
  p = jnp.asarray(rng.normal(size=(1000, 64)), jnp.float32)
  mask = jnp.asarray(rng.random(512) > 0.2)

  def f(fn, z, p, **kw):
    o = fn(z, p, 8, mask_N=mask, distance="sqeuclidean", **kw)
    return (jnp.sum(o[3] ** 2) + jnp.sum(o[1]) + jnp.sum(o[6])
            + jnp.sum(jnp.where(jnp.isfinite(o[7]), o[7], 0))), o

  g = jax.value_and_grad(f, argnums=(1, 2), has_aux=True)
  (_, o0), g0 = g(reference.topk_reconstruct_xla, z, p)
  with jax.set_mesh(sharding.make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])):
    layer = lambda *a, **k: sharded.topk_reconstruct_sharded(
        *a, model_axis="model", token_axes=sharding.mesh_axes("tokens"),
        opts=api.kernel_options(FLAGS.impl, "sqeuclidean"), **k)
    (_, o1), g1 = jax.jit(lambda z, p: g(layer, z, p))(z, p)
  rel = lambda a, b: float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a)))
  print(FLAGS.impl, "ids equal frac", float(jnp.mean(o0[0] == o1[0])), "z_hat rel",
        rel(o0[3], o1[3]), "dz rel", rel(g0[0], g1[0]), "dp rel", rel(g0[1], g1[1]))


if __name__ == "__main__":
  launcher.run(main)
