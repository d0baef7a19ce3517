"""The training state as a plain pytree, born sharded on a mesh.

The NNX model is split once into a static `graphdef` and its parameters as a pure dict
(`nnx.to_pure_dict`); `nnx.merge(graphdef, params)` rebuilds the module inside jit. The
state below is what the jitted step consumes/donates and what orbax saves.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from prism_jax import sharding as shard_lib
from prism_jax.config import Config, ModelConfig
from prism_jax.model.lm import build_model
from prism_jax.train.optimizer import make_optimizer


class TrainState(NamedTuple):
  step: jax.Array  # int32 scalar: number of completed updates
  params: dict[str, Any]  # nnx.to_pure_dict of the model's Params
  opt_state: optax.OptState


def default_mesh(cfg: Config, devices=None) -> jax.sharding.Mesh:
  """The mesh from `cfg.mesh` (default: every device on the data axis)."""
  return shard_lib.make_mesh(cfg.mesh, devices)


def model_template(model_cfg: ModelConfig):
  """(graphdef, abstract nnx.State with logical-axis metadata) without allocating."""
  with shard_lib.no_mesh():
    abstract = nnx.eval_shape(lambda: build_model(model_cfg, 0))
  return nnx.split(abstract)


def state_shardings(cfg: Config, mesh: jax.sharding.Mesh,
                    tx: optax.GradientTransformation | None = None,
                    template=None) -> TrainState:
  """NamedShardings for every leaf of the TrainState on `mesh` (from the rules table).

  Optimiser leaves that mirror a parameter (Adam mu/nu) take the parameter's sharding;
  scalars (counts) are replicated. `template`: model_template(cfg.model) when the caller
  has it already.
  """
  tx = make_optimizer(cfg.train) if tx is None else tx
  _, abstract_state = model_template(cfg.model) if template is None else template
  param_sh = nnx.to_pure_dict(shard_lib.param_shardings(abstract_state, mesh))
  abstract_params = nnx.to_pure_dict(abstract_state)
  replicated = NamedSharding(mesh, P())
  opt_abstract = jax.eval_shape(tx.init, abstract_params)
  opt_sh = optax.tree_map_params(tx, lambda _, s: s, opt_abstract, param_sh,
                                 transform_non_params=lambda _: replicated,
                                 is_leaf=lambda x: isinstance(x, NamedSharding))
  return TrainState(replicated, param_sh, opt_sh)


def abstract_state(cfg: Config, mesh: jax.sharding.Mesh,
                   tx: optax.GradientTransformation | None = None) -> TrainState:
  """ShapeDtypeStructs carrying this mesh's shardings: the orbax restore target."""
  tx = make_optimizer(cfg.train) if tx is None else tx
  shardings = state_shardings(cfg, mesh, tx)
  shapes = jax.eval_shape(lambda: init_fn(cfg, tx)())
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      shapes, shardings)


def init_fn(cfg: Config, tx: optax.GradientTransformation):
  """The state's init as a function of nothing (jit it with out_shardings to place it)."""
  def init() -> TrainState:
    with shard_lib.no_mesh():  # out_shardings place the leaves; no eager constraints
      model = build_model(cfg.model, cfg.train.seed)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params))
  return init


def create_train_state(cfg: Config, mesh: jax.sharding.Mesh | None = None,
                       tx: optax.GradientTransformation | None = None):
  """(graphdef, TrainState born sharded on `mesh`, its shardings).

  Parameters are a pure function of `cfg.train.seed` (threefry is partitionable, so the
  values do not depend on the mesh shape).
  """
  mesh = default_mesh(cfg) if mesh is None else mesh
  tx = make_optimizer(cfg.train) if tx is None else tx
  graphdef, _ = model_template(cfg.model)
  shardings = state_shardings(cfg, mesh, tx)
  state = jax.jit(init_fn(cfg, tx), out_shardings=shardings)()
  return graphdef, state, shardings

