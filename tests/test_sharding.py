"""Mesh from config, the rules table, global batches, and training on 8 simulated devices:
loss and gradients of a step equal the single-device ones, 20 steps track them, and a
checkpoint saved on one mesh resumes on another."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from prism_jax import sharding
from prism_jax.config import Config, DataConfig, MeshConfig, ModelConfig, TrainConfig
from prism_jax.model.lm import build_model
from prism_jax.train import checkpoint as ckpt_lib
from prism_jax.train import state as state_lib
from prism_jax.train import step as step_lib
from prism_jax.train.optimizer import make_optimizer

MESHES = [(8, 1, 1), (2, 2, 2), (1, 2, 4), (1, 1, 8)]
STEPS = 20
CFG = Config(
    model=ModelConfig(vocab_size=64, max_len=16, d_model=32, n_layers=1, n_heads=4,
                      num_prototypes=64, k=4, proto_init="normal"),
    data=DataConfig(seq_len=16),
    train=TrainConfig(steps=STEPS, batch_size=8, lr=1e-2, warmup_steps=2,
                      proto_init_step=0))


def make_batches(cfg: Config, count: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
  """Fresh random global batches in the data contract (inputs, targets, mask)."""
  rng = np.random.default_rng(seed)
  b, t = cfg.train.batch_size, cfg.data.seq_len
  out = []
  for _ in range(count):
    rows = rng.integers(0, cfg.model.vocab_size, (b, t + 1))
    out.append({"inputs": rows[:, :-1].astype(np.int32),
                "targets": rows[:, 1:].astype(np.int32),
                "mask": rng.random((b, t)) > 0.15})
  return out


def capture_grads() -> optax.GradientTransformation:
  """Keeps the latest gradients as its state and passes them on unchanged."""
  return optax.GradientTransformation(
      lambda params: jax.tree.map(jnp.zeros_like, params),
      lambda updates, state, params=None: (updates, updates))


@functools.cache
def compiled(cfg: Config, shape: tuple[int, ...]):
  """(mesh, initial state, train step) for `shape`, built once per mesh.

  The optimizer is C's AdamW chained after `capture_grads`, so the step's new
  opt_state[0] holds the gradients of that step.
  """
  mesh = sharding.make_mesh(MeshConfig(*shape), jax.devices()[:math.prod(shape)])
  tx = optax.chain(capture_grads(), make_optimizer(cfg.train))
  graphdef, state, shardings = state_lib.create_train_state(cfg, mesh, tx)
  step = step_lib.make_train_step(graphdef, cfg, tx, shardings, mesh)
  return mesh, state, step


def train_losses(cfg, shape, batches, state=None):
  """Runs C's jitted train step over `batches`: (losses, first step's grads, state)."""
  mesh, init_state, step = compiled(cfg, shape)
  # the step donates its input: start from a copy of the cached initial state
  state = jax.tree.map(jnp.copy, init_state) if state is None else state
  out, grads = [], None
  with jax.set_mesh(mesh):
    for batch in batches:
      state, metrics = step(state, sharding.make_global_batch(batch, mesh))
      out.append(float(metrics["loss"]))
      if grads is None:
        grads = jax.device_get(state.opt_state[0])
  return np.asarray(out), grads, state


@pytest.fixture(scope="module")
def single_device():
  batches = make_batches(CFG, STEPS)
  ref_losses, grads, _ = train_losses(CFG, (1, 1, 1), batches)
  return batches, grads, ref_losses


def test_mesh_shape_from_config():
  assert sharding.resolve_mesh_shape(MeshConfig(-1, 2, 2), 8) == (2, 2, 2)
  assert sharding.resolve_mesh_shape(MeshConfig(1, 1, -1), 8) == (1, 1, 8)
  with pytest.raises(ValueError, match="cannot be filled"):
    sharding.resolve_mesh_shape(MeshConfig(-1, 3, 1), 8)
  with pytest.raises(ValueError, match="there are 8 devices"):
    sharding.resolve_mesh_shape(MeshConfig(2, 2, 1), 8)
  mesh = sharding.make_mesh(MeshConfig(2, -1, 2))
  assert dict(zip(mesh.axis_names, mesh.axis_sizes)) == {"data": 2, "fsdp": 2, "model": 2}


def test_rules_fit_the_mesh():
  mesh = sharding.make_mesh(MeshConfig(1, 2, 4))
  assert sharding.logical_to_spec(("vocab", "embed")) == P("model", "fsdp")
  # 4 heads cannot split 4 x 2; a 6-wide vocab drops `model` (4), batch keeps what divides
  assert sharding.logical_to_spec(("embed", None, "heads", "kv"), (32, 3, 4, 8), mesh) == \
      P("fsdp", None, "model", None)
  assert sharding.logical_to_spec(("vocab", "embed"), (6, 32), mesh) == P(None, "fsdp")
  mesh8 = sharding.make_mesh(MeshConfig(1, 1, 8))
  assert sharding.logical_to_spec(("heads",), (4,), mesh8) == P(None)
  with pytest.raises(ValueError, match="unknown logical axis 'vocabulary'"):
    sharding.logical_to_spec(("vocabulary",))


def test_state_born_sharded_and_constrain():
  mesh, state, _ = compiled(CFG, (1, 2, 4))
  protos = state.params["bank"]["protos"]
  assert protos.sharding.spec == P("model", "fsdp")
  assert protos.addressable_shards[0].data.shape == (64 // 4, 32 // 2)
  graphdef, fresh, _ = state_lib.create_train_state(CFG, mesh)  # a second, fresh build
  model = nnx.merge(graphdef, fresh.params)
  wte = model.backbone.wte[...]
  assert wte.sharding.spec == P("model", "fsdp") and wte.addressable_shards[0].data.shape == (
      64 // 4, 32 // 2)
  np.testing.assert_array_equal(np.asarray(wte), np.asarray(state.params["backbone"]["wte"]))
  x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 4, 16)), jnp.float32)
  assert sharding.constrain(x, ("batch", "seq", "act_embed")) is x  # no mesh: no-op
  with jax.set_mesh(mesh):
    y = jax.jit(lambda v: sharding.constrain(v * 2, ("batch", "seq", "act_vocab")))(x)
  want = jax.sharding.NamedSharding(mesh, P(("data", "fsdp"), None, "model"))
  assert y.sharding.is_equivalent_to(want, 3)
  np.testing.assert_array_equal(np.asarray(y), 2 * np.asarray(x))


def test_global_batch_from_process_local_rows():
  mesh = sharding.make_mesh(MeshConfig(2, 2, 2))
  assert sharding.process_batch_slice(mesh, 8) == (0, 1)
  batch = make_batches(CFG, 1, seed=3)[0]
  glob = sharding.make_global_batch(batch, mesh)
  assert glob["inputs"].sharding.spec == P(("data", "fsdp"), None)
  assert len({s.index for s in glob["inputs"].addressable_shards}) == 4  # 4 row blocks
  for key, value in batch.items():
    np.testing.assert_array_equal(np.asarray(glob[key]), value)
  with pytest.raises(ValueError, match="cannot be split over the mesh's data\\*fsdp = 4"):
    sharding.make_global_batch({"inputs": batch["inputs"][:6]}, mesh)


def _max_rel(ref_tree, tree):
  errs = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a, np.float64) - b))
                                         / max(np.max(np.abs(a)), 1e-30)), ref_tree, tree)
  return max(jax.tree.leaves(errs))


# (2, 2, 2) uses every mesh axis and stays in make test; the other meshes: make test-long
# (issue 56 item 7).
@pytest.mark.parametrize("shape", [pytest.param(s, marks=pytest.mark.long) if s != (2, 2, 2)
                                   else s for s in MESHES])
def test_training_matches_single_device(single_device, shape):
  batches, ref_grads, ref_losses = single_device
  got, grads, _ = train_losses(CFG, shape, batches)
  err = _max_rel(ref_grads, grads)
  assert err <= 1e-5, f"max relative gradient error {err:.2e} on mesh {shape}"
  np.testing.assert_allclose(got, ref_losses, rtol=1e-5)
  print(f"\nmesh {shape}: step-1 loss rel err {abs(got[0] - ref_losses[0]) / ref_losses[0]:.1e},"
        f" max grad rel err {err:.1e}, max loss rel err over {STEPS} steps "
        f"{np.max(np.abs(got - ref_losses) / ref_losses):.1e}")


LLAMA = dataclasses.replace(CFG, model=dataclasses.replace(
    CFG.model, arch="llama", bias=False, n_kv_heads=2, qkv_bias=True, tie_embeddings=False,
    mlp_dim=48, rope_scaling_factor=4.0, rope_original_max_len=8))


@pytest.mark.parametrize("shape", [(2, 2, 2), pytest.param((1, 2, 4), marks=pytest.mark.long)])
def test_llama_training_matches_single_device(shape):
  """The Llama-family backbone (GQA with 2 kv heads: replicated where the model axis has
  4, untied head, q/k/v biases) on the 8-device mesh: same tolerance as GPT-2's."""
  batches = make_batches(LLAMA, 4, seed=1)
  ref, ref_grads, _ = train_losses(LLAMA, (1, 1, 1), batches)
  got, grads, _ = train_losses(LLAMA, shape, batches)
  assert set(ref_grads["backbone"]) >= {"unembed"}
  err = _max_rel(ref_grads, grads)
  assert err <= 1e-5, f"max relative gradient error {err:.2e} on mesh {shape}"
  np.testing.assert_allclose(got, ref, rtol=1e-5)


def test_checkpoint_resumes_on_another_mesh(single_device, tmp_path):
  batches, _, ref_losses = single_device
  cfg = dataclasses.replace(CFG, mesh=MeshConfig(2, 2, 2))
  first, _, state = train_losses(CFG, (2, 2, 2), batches[:3])
  ckpt = ckpt_lib.Checkpointer(str(tmp_path))
  ckpt.save(3, state, {"step": 3}, cfg)
  ckpt.wait()
  cfg_b = dataclasses.replace(CFG, mesh=MeshConfig(1, 2, 4))
  mesh_b = compiled(CFG, (1, 2, 4))[0]
  tx = optax.chain(capture_grads(), make_optimizer(cfg_b.train))
  restored, data_state = ckpt.restore(3, state_lib.abstract_state(cfg_b, mesh_b, tx))
  ckpt.close()
  assert data_state == {"step": 3} and int(restored.step) == 3
  assert restored.params["bank"]["protos"].sharding.spec == P("model", "fsdp")
  assert restored.params["bank"]["protos"].sharding.mesh.shape["model"] == 4
  np.testing.assert_array_equal(np.asarray(restored.params["bank"]["protos"]),
                                np.asarray(state.params["bank"]["protos"]))
  rest, _, _ = train_losses(CFG, (1, 2, 4), batches[3:6], state=restored)
  np.testing.assert_allclose(np.concatenate([first, rest]), ref_losses[:6], rtol=1e-5)


def test_model_built_under_a_mesh_is_sharded_by_the_rules():
  """Constructing a model inside `jax.set_mesh` shards each parameter via LOGICAL_RULES
  (not flax's eager lookup of logical names) and gives the same values as without a mesh."""
  cfg = ModelConfig(vocab_size=64, max_len=16, d_model=32, n_layers=1, n_heads=2,
                    num_prototypes=16, k=4)
  mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=2, model=2))
  with jax.set_mesh(mesh):
    sharded = build_model(cfg, seed=3)
  plain = build_model(cfg, seed=3)
  assert sharded.backbone.wte[...].sharding.spec == P("model", "fsdp")
  assert sharded.bank.protos[...].sharding.spec == P("model", "fsdp")
  np.testing.assert_array_equal(np.asarray(sharded.bank.protos[...]),
                                np.asarray(plain.bank.protos[...]))


@pytest.mark.long  # make test-long (issue 56 item 7)
def test_llama_remat_and_bf16_steps_track_the_plain_one():
  """The Llama-family step with remat (same values: a recompute, not an approximation) and
  in bfloat16 compute (bf16 rounding: a loose tolerance) beside the fp32 one."""
  batches = make_batches(LLAMA, 2, seed=2)
  ref, ref_grads, _ = train_losses(LLAMA, (1, 1, 1), batches)
  remat = dataclasses.replace(LLAMA, model=dataclasses.replace(LLAMA.model, remat=True))
  got, grads, _ = train_losses(remat, (1, 1, 1), batches)
  np.testing.assert_allclose(got, ref, rtol=1e-6)
  assert _max_rel(ref_grads, grads) <= 1e-5
  bf16 = dataclasses.replace(LLAMA, model=dataclasses.replace(LLAMA.model, dtype="bfloat16"))
  low, _, _ = train_losses(bf16, (1, 1, 1), batches)
  np.testing.assert_allclose(low, ref, rtol=2e-2)
