"""The real model's capture (model/tap.py): a zero-probe forward equals the plain one bit
for bit; Σ_t δ aᵀ of every probed linear map equals the autodiff gradient of its weights
(float64, so the comparison is tight); residual streams are the blocks' outputs; float64
parameters compute in float64."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from prism_jax import sharding
from prism_jax.config import ModelConfig
from prism_jax.losses import token_nll
from prism_jax.model.lm import build_model
from prism_jax.model.tap import BLOCK_LAYERS, Tap

CFG = ModelConfig(vocab_size=29, max_len=8, d_model=8, n_layers=2, n_heads=2, mlp_ratio=2,
                  num_prototypes=10, k=3, implementation="xla")
OUT = {"qkv": 3 * CFG.d_model, "attn_out": CFG.d_model, "mlp_fc": CFG.d_mlp,
       "mlp_proj": CFG.d_model, "bank": CFG.d_model}


def _model(seed, dtype=jnp.float32, **kw):
  model = build_model(dataclasses.replace(CFG, **kw), seed)
  graphdef, state = nnx.split(model)
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  leaves = [(l + 0.3 * jax.random.normal(k, l.shape)).astype(dtype)  # biases, LN too
            for l, k in zip(leaves, keys)]
  return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


def _batch(seed, batch=3, seq=7):
  rng = np.random.default_rng(seed)
  tok = jnp.asarray(rng.integers(0, CFG.vocab_size, (batch, seq + 1)), jnp.int32)
  return tok[:, :-1], tok[:, 1:], jnp.asarray(rng.random((batch, seq)) > 0.2)


def _names(with_bank=True):
  return [f"block{i}.{n}" for i in range(CFG.n_layers) for n in BLOCK_LAYERS] + (
      ["bank"] if with_bank else [])


def _probes(names, batch, seq, dtype):
  return {n: jnp.zeros((batch, seq, OUT[n.split(".")[-1]]), dtype) for n in names}


def test_zero_probes_change_nothing_and_streams_are_block_outputs():
  model = _model(0)
  inputs, _, mask = _batch(1)
  plain = model(inputs, mask_BxT=mask)
  tap = Tap(_probes(_names(), *inputs.shape, jnp.float32), streams=("block0", "z"))
  tapped = model(inputs, mask_BxT=mask, tap=tap)
  np.testing.assert_array_equal(np.asarray(tapped.logits_BxTxV), np.asarray(plain.logits_BxTxV))
  np.testing.assert_array_equal(np.asarray(tap.inputs["z"]), np.asarray(plain.z_BxTxD))
  bb = model.backbone
  pos = bb.positions(inputs)
  after0 = bb.blocks[0](bb.embed(inputs, pos), pos)[0]
  np.testing.assert_array_equal(np.asarray(tap.inputs["block0"]), np.asarray(after0))
  assert tap.inputs["block1.mlp_fc"].shape == inputs.shape + (CFG.d_model + 1,)
  assert tap.inputs["bank"].shape == inputs.shape + (CFG.num_prototypes,)


def test_bad_probe_shape_and_unknown_axis_are_named():
  model = _model(6)
  inputs, _, _ = _batch(7)
  probes = _probes(_names(), *inputs.shape, jnp.float32)
  probes["block1.mlp_fc"] = jnp.zeros(inputs.shape + (CFG.d_model,))  # out is d_mlp
  with pytest.raises(ValueError, match="probe 'block1.mlp_fc' has shape"):
    model(inputs, tap=Tap(probes))
  assert sharding.mesh_axes("tokens") == ("data", "fsdp") and sharding.mesh_axes("kv") == ()
  with pytest.raises(ValueError, match="unknown logical axis 'protos'"):
    sharding.mesh_axes("protos")


def test_probe_gradients_give_every_linear_maps_weight_gradient_float64():
  with jax.enable_x64(True):
    model = _model(2, jnp.float64)
    inputs, targets, mask = _batch(3)
    w = mask.astype(jnp.float64)
    names = _names(with_bank=False)

    def probe_loss(probes):
      tap = Tap(probes)
      logits = model(inputs, tap=tap).logits_BxTxV
      assert logits.dtype == jnp.float64  # float64 parameters: float64 compute
      return jnp.sum(token_nll(logits, targets) * w), tap.inputs

    deltas, acts = jax.grad(probe_loss, has_aux=True)(_probes(names, *inputs.shape,
                                                             jnp.float64))

    def loss(m):
      return jnp.sum(token_nll(m(inputs).logits_BxTxV, targets) * w)

    grads = nnx.grad(loss)(model)
    d = CFG.d_model
    for i in range(CFG.n_layers):
      blk = grads.backbone.blocks[i]
      ref = {"qkv": (blk.attn.qkv_kernel[...].reshape(d, -1),
                     blk.attn.qkv_bias[...].reshape(-1)),
             "attn_out": (blk.attn.out_kernel[...].reshape(-1, d), blk.attn.out_bias[...]),
             "mlp_fc": (blk.mlp.fc_kernel[...], blk.mlp.fc_bias[...]),
             "mlp_proj": (blk.mlp.proj_kernel[...], blk.mlp.proj_bias[...])}
      for n, (kernel, bias) in ref.items():
        key = f"block{i}.{n}"
        got = np.einsum("bto,bti->oi", deltas[key], acts[key])  # (out, in + bias)
        want = np.concatenate([np.asarray(kernel), np.asarray(bias)[None]], 0).T
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12, err_msg=key)


def test_bank_probe_is_the_gradient_through_z_hat():
  """Straight-through: δ_bank = ∂loss/∂(head input); plain routing: ẑ cancels in the head
  input (r + ẑ = z), so the bank gets no gradient through ẑ."""
  inputs, targets, _ = _batch(4)
  for routing, nonzero in (("straight_through", True), ("plain", False)):
    model = _model(5, residual_routing=routing)

    def probe_loss(probes):
      tap = Tap(probes)
      logits = model(inputs, tap=tap).logits_BxTxV
      return jnp.sum(token_nll(logits, targets)), tap.inputs

    deltas, acts = jax.grad(probe_loss, has_aux=True)(_probes(["bank"], *inputs.shape,
                                                             jnp.float32))
    z = model(inputs).z_BxTxD
    g_head = jax.grad(lambda h: jnp.sum(token_nll(model.backbone.lm_head(h), targets)))(z)
    want = g_head if nonzero else jnp.zeros_like(g_head)
    np.testing.assert_allclose(deltas["bank"], want, rtol=1e-5, atol=1e-6)
    out = model(inputs).protos
    a_NxK = np.asarray(acts["bank"]).reshape(-1, CFG.num_prototypes)
    np.testing.assert_allclose(np.take_along_axis(a_NxK, np.asarray(out.idx_Nxk), 1),
                               out.act_Nxk, rtol=0, atol=0)
    assert np.count_nonzero(a_NxK, 1).max() <= CFG.k
