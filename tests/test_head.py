"""One head (model/head.py): for every head option, attribution's gradients w.r.t. the bank
and the Hessian blocks equal autodiff through PrismLM itself, in float64.

References, all through the real PrismLM forward (float64 parameters) and losses.total_loss:
  * full path: jax.grad / jax.hessian of the training loss w.r.t. model.bank.protos;
  * linear path (the cache's per-token a_t g_tᵀ): the gradient w.r.t. the model's "bank"
    tap probe (g_t = ∂ℓ_t/∂ẑ_t) times the activations a_t the tap records.
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from prism_jax.attribution.hessians import curvature as cv
from prism_jax.attribution.hessians import hessian_block as hb
from prism_jax.config import LossConfig, ModelConfig
from prism_jax.losses import token_nll, token_rec, total_loss
from prism_jax.model.lm import build_model
from prism_jax.model.tap import Tap

LOSS = LossConfig(lambda_rec=0.3, lambda_r1=0.2, lambda_r2=0.1)
CFG = ModelConfig(vocab_size=13, max_len=8, d_model=6, n_layers=1, n_heads=2, mlp_ratio=2,
                  num_prototypes=7, k=3)
VALUES = (("raw", "normalized"), ("none", "learned"), ("cosine", "sqeuclidean"),
          ("straight_through", "plain"))
# Every value of every option, and every pair of values of any two options (a strength-2
# covering array: 5 rows instead of the 16 of the full product; the test asserts it).
OPTIONS = [tuple(VALUES[o][bit] for o, bit in enumerate(row))
           for row in ((0, 0, 0, 0), (0, 1, 1, 1), (1, 0, 1, 1), (1, 1, 0, 1), (1, 1, 1, 0))]


def _model(seed, **options):
  """A float64 PrismLM with every parameter (bank, mixture scale, norms) drawn afresh."""
  model = build_model(dataclasses.replace(CFG, **options), seed)
  graphdef, state = nnx.split(model)
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  leaves = [(l + 0.4 * jax.random.normal(k, l.shape)).astype(jnp.float64)
            for l, k in zip(leaves, keys)]
  return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


def _batch(seed, b=2, t=6):
  rng = np.random.default_rng(seed)
  mask = rng.random((b, t)) > 0.25
  mask[0, 0] = True
  return dict(inputs=rng.integers(0, CFG.vocab_size, (b, t)).astype(np.int32),
              targets=rng.integers(0, CFG.vocab_size, (b, t)).astype(np.int32), mask=mask)


def _model_loss(model, batch, implementation):
  """The training loss through PrismLM as a function of the bank."""
  gdef, p_state, rest = nnx.split(model, lambda path, _: path[-1] == "protos", ...)

  def loss(protos_KxD):
    m = nnx.merge(gdef, jax.tree.map(lambda _: protos_KxD, p_state), rest)
    m.bank.implementation = implementation
    return total_loss(m(jnp.asarray(batch["inputs"]), mask_BxT=jnp.asarray(batch["mask"])),
                      jnp.asarray(batch["targets"]), jnp.asarray(batch["mask"]), LOSS)[0]
  return loss


def _model_token_grads(model, batch):
  """(a_NxK, g_NxD) of PrismLM's "bank" tap: ∂Σ_t ℓ_t/∂probe and the recorded a."""
  inputs, targets, mask = (jnp.asarray(batch[k]) for k in ("inputs", "targets", "mask"))

  def summed(probe_BxTxD):
    tap = Tap({"bank": probe_BxTxD})
    out = model(inputs, mask_BxT=mask, tap=tap)
    n, d = inputs.size, CFG.d_model
    ell_N = (token_nll(out.logits_BxTxV.reshape(n, -1), targets.reshape(-1))
             + LOSS.lambda_rec * token_rec(out.z_BxTxD.reshape(n, d),
                                           out.protos.residual_NxD, LOSS.rec_kind))
    return jnp.sum(jnp.where(mask.reshape(-1), ell_N, 0.0)), tap.inputs["bank"]

  g, a = jax.grad(summed, has_aux=True)(jnp.zeros(inputs.shape + (CFG.d_model,), jnp.float64))
  return np.asarray(a).reshape(inputs.size, -1), np.asarray(g).reshape(inputs.size, -1)


def _close(got, want, tol=1e-10):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape
  assert np.max(np.abs(got - want)) <= tol * max(np.max(np.abs(want)), 1.0), \
      np.max(np.abs(got - want))


@pytest.mark.parametrize("mixture,scale,distance,routing", OPTIONS)
def test_attribution_and_hessian_blocks_equal_autodiff_through_prismlm(mixture, scale,
                                                                       distance, routing):
  seed = OPTIONS.index((mixture, scale, distance, routing))
  with jax.enable_x64(True):
    model = _model(seed, mixture=mixture, mixture_scale=scale, distance=distance,
                   residual_routing=routing)
    batch = _batch(100 + seed)
    mcfg, p0 = model.cfg, model.bank.protos[...]
    assert p0.dtype == jnp.float64
    head = cv.head_inputs(model, batch, jnp.float64)
    # Full path: bank_loss and its gradient against PrismLM with its default kernel.
    lib = _model_loss(model, batch, mcfg.implementation)
    _close(cv.bank_loss(p0, head, mcfg, LOSS), lib(p0))
    _close(jax.grad(lambda p: cv.bank_loss(p, head, mcfg, LOSS))(p0), jax.grad(lib)(p0))
    # Linear path: the cache's per-token records a_t g_tᵀ against PrismLM's tap.
    og = cv.output_grads(model, batch, LOSS, dtype=jnp.float64)
    a_ref, g_ref = _model_token_grads(model, batch)
    m = np.asarray(og.mask_N)
    a_got = np.zeros_like(a_ref)
    np.put_along_axis(a_got, np.asarray(og.idx_Nxk), np.asarray(og.act_Nxk), axis=1)
    _close(np.einsum("nk,nd->nkd", a_got, og.g_NxD)[m],
           np.einsum("nk,nd->nkd", a_ref, g_ref)[m])
    # Hessian blocks: forward over reverse restricted to p_i, against jax.hessian of the
    # PrismLM loss (the "xla" kernel: forward mode).
    h_ref = jax.hessian(_model_loss(model, batch, "xla"))(p0)  # (K, D, K, D)
    for i, j in ((1, 4), (3, 3)):
      _close(hb.hessian_block(model, [batch], i, j, loss_cfg=LOSS), h_ref[i, :, j, :])


def test_options_cover_every_pair_of_values():
  for a, b in itertools.combinations(range(len(VALUES)), 2):
    assert {(row[a], row[b]) for row in OPTIONS} == set(itertools.product(VALUES[a], VALUES[b]))


def test_head_refuses_what_it_does_not_model():
  with jax.enable_x64(True):
    model = _model(0, mixture_scale="learned")
    batch = _batch(1)
    head = cv.head_inputs(model, batch, jnp.float64)
    with pytest.raises(ValueError, match="loss.lambda_proto_kl=1.0 is not modelled"):
      cv.bank_loss(head.protos_KxD, head, model.cfg, LossConfig(lambda_proto_kl=1.0))
    with pytest.raises(ValueError, match="i=7 is not a prototype id"):
      hb.hessian_block(model, [batch], 7, 0)
    with pytest.raises(ValueError, match="needs at least one batch"):
      hb.hessian_block(model, [], 0, 0)
