"""PrismLM and its dense twin DenseLM on the same backbone.

PrismLM replaces the dense output path W z by W r + W z_hat, where z_hat is the sparse
prototype mixture and r the residual (PRISM.md §1). In value this equals W z; the split is
what makes attribution and control native.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from prism_jax.config import ModelConfig
from prism_jax.model import head as head_lib
from prism_jax.model.head import prism_head
from prism_jax.model.params import const_param
from prism_jax.model.prototypes import PrototypeBank, PrototypeOutput
from prism_jax.model.tap import Tap
from prism_jax.model.token_ids import check_token_ids
from prism_jax.model.backbones import backbone_class
from prism_jax.model.transformer import KVCache


class LMOutput(NamedTuple):
  logits_BxTxV: jax.Array  # fp32
  z_BxTxD: jax.Array  # final hidden state after the final norm, fp32
  protos: PrototypeOutput | None  # flattened over N = B*T tokens; None for DenseLM
  caches: list[KVCache] | None = None


class DenseLM(nnx.Module):
  """GPT-2-style decoder with a tied LM head: the baseline every comparison uses."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.backbone = backbone_class(cfg.arch)(cfg, rngs=rngs)

  def __call__(self, tokens_BxT, positions_BxT=None, *, mask_BxT=None, caches=None,
               tap: Tap | None = None, dropout_key: jax.Array | None = None):
    """`dropout_key` (training only) turns on model.dropout in the backbone."""
    z_BxTxD, caches = self.backbone(tokens_BxT, positions_BxT, caches, tap, dropout_key)
    return self.head(z_BxTxD, mask_BxT, tap)._replace(caches=caches)

  def head(self, z_BxTxD, mask_BxT=None, tap: Tap | None = None) -> LMOutput:
    """Logits from the final hidden state (the tied LM head)."""
    del mask_BxT, tap  # the dense twin has no prototype statistics to mask, no bank
    return LMOutput(self.backbone.lm_head(z_BxTxD), z_BxTxD, None)

  def init_cache(self, batch: int):
    return self.backbone.init_cache(batch, jnp.dtype(self.cfg.dtype))


class PrismLM(nnx.Module):
  """The backbone with the prototype layer on z; returns logits and the decomposition."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.backbone = backbone_class(cfg.arch)(cfg, rngs=rngs)
    self.bank = PrototypeBank(cfg.num_prototypes, cfg.d_model, cfg.k, rngs=rngs,
                              residual_routing=cfg.residual_routing, mixture=cfg.mixture,
                              distance=cfg.distance, implementation=cfg.implementation)
    if cfg.mixture_scale == "learned":
      self.mix_log_scale = const_param((), 0.0, ())  # s = exp(.) > 0 keeps a >= 0

  def __call__(self, tokens_BxT, positions_BxT=None, *, mask_BxT=None, caches=None,
               tap: Tap | None = None, dropout_key: jax.Array | None = None,
               residual_keep_BxT=None):
    """`mask_BxT` marks valid (non-padding) tokens for the prototype statistics;
    `dropout_key` (training only) turns on model.dropout in the backbone;
    `residual_keep_BxT` (training only: residual dropout) drops r_t from the logits where
    False, so those logits are W z_hat; the returned decomposition keeps the true r_t."""
    z_BxTxD, caches = self.backbone(tokens_BxT, positions_BxT, caches, tap, dropout_key)
    return self.head(z_BxTxD, mask_BxT, tap, residual_keep_BxT)._replace(caches=caches)

  def head(self, z_BxTxD, mask_BxT=None, tap: Tap | None = None,
           residual_keep_BxT=None) -> LMOutput:
    """The prototype layer on z and the tied LM head on r + ẑ (model/head.py, the one head).
    With a tap probing "bank", ẑ = Pᵀ a gets the probe and a (B, T, K), the dense
    activations, is recorded."""
    batch, seq, _ = z_BxTxD.shape
    logits, protos = prism_head(
        z_BxTxD, self.bank.protos[...], self.backbone.unembedding(), self.cfg,
        mix_log_scale=self.mix_log_scale[...] if self.cfg.mixture_scale == "learned" else None,
        mask_N=None if mask_BxT is None else mask_BxT.reshape(batch * seq), tap=tap,
        residual_keep_N=residual_keep_BxT, implementation=self.bank.implementation)
    return LMOutput(logits, z_BxTxD, protos)

  def mixture_scale(self) -> jax.Array:
    """The learned mixture scale s (1.0 without `mixture_scale="learned"`)."""
    return head_lib.mixture_scale(
        self.cfg, self.mix_log_scale[...] if self.cfg.mixture_scale == "learned" else None)

  def proto_path_logits(self, protos: PrototypeOutput, batch: int, seq: int) -> jax.Array:
    """W z_hat, (B, T, V): the logits of the prototype path alone (faithfulness, aux CE)."""
    return self.backbone.lm_head(protos.z_hat_NxD.reshape(batch, seq, -1))

  def init_cache(self, batch: int):
    return self.backbone.init_cache(batch, jnp.dtype(self.cfg.dtype))

  def proto_logit_signatures(self) -> jax.Array:
    """W p_i for every prototype: its fixed token-logit signature, (K, V)."""
    return jnp.einsum("kd,vd->kv", self.bank.protos[...], self.backbone.unembedding(),
                      precision=jax.lax.Precision.HIGHEST)


def build_model(cfg: ModelConfig, seed: int = 0) -> DenseLM | PrismLM:
  cls = PrismLM if cfg.kind == "prism" else DenseLM
  return cls(cfg, rngs=nnx.Rngs(params=seed))


class Decomposition(NamedTuple):
  """Logit of `target` for every token: logit = sum(contrib_Nxk) + residual_N."""

  idx_Nxk: jax.Array
  contrib_Nxk: jax.Array  # a_{t,i} <W_y, p_i>
  residual_N: jax.Array  # <W_y, r_t>
  logit_N: jax.Array  # <W_y, r_t + z_hat_t>, the model's logit of y


def decompose(model: PrismLM, protos: PrototypeOutput, target_N: jax.Array) -> Decomposition:
  """Per-prototype logit contributions and the residual slice for target tokens, in fp32.

  Args:
    model: the PrismLM whose bank and tied embedding (W) produced `protos`.
    protos: the model's `PrototypeOutput` for N tokens (`LMOutput.protos`, the B*T tokens
      flattened row-major).
    target_N: the token id y whose logit is decomposed at each of the N tokens, (N,)
      integers in [0, vocab_size) (checked on the host; a ValueError otherwise).

  Returns:
    A `Decomposition`: `idx_Nxk` (the active prototype ids of `protos`, (N, k)) and, in
    float32, `contrib_Nxk` (a_{t,i} <W_y, p_i>, (N, k)), `residual_N` (<W_y, r_t>, (N,))
    and `logit_N` (<W_y, r_t + z_hat_t>, the model's logit of y, (N,)), so that
    logit_N = contrib_Nxk.sum(-1) + residual_N (up to rounding).
  """
  target_N = check_token_ids(target_N, model.cfg.vocab_size, "decompose target ids")
  hi = jax.lax.Precision.HIGHEST
  w_NxD = model.backbone.unembedding()[target_N].astype(jnp.float32)
  p_NxkxD = model.bank.protos[...][protos.idx_Nxk].astype(jnp.float32)
  contrib = protos.act_Nxk * jnp.einsum("nkd,nd->nk", p_NxkxD, w_NxD, precision=hi)
  residual = jnp.einsum("nd,nd->n", protos.residual_NxD, w_NxD, precision=hi)
  logit = jnp.einsum("nd,nd->n", protos.residual_NxD + protos.z_hat_NxD, w_NxD, precision=hi)
  return Decomposition(protos.idx_Nxk, contrib, residual, logit)


def _unit(x_NxD: np.ndarray) -> np.ndarray:
  x = np.asarray(x_NxD, np.float64)
  return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def kmeans_pp_pick(x_NxD: np.ndarray, num: int, rng: np.random.Generator,
                   centres_CxD: np.ndarray | None = None) -> np.ndarray:
  """`num` distinct row indices of x spread by k-means++ seeding on cosine distance: each
  next row drawn with probability ∝ its distance to the nearest centre so far. `centres`
  (e.g. the prototypes still in use) start the set; without them the first row is uniform."""
  unit = _unit(x_NxD)
  if num > len(unit):
    raise ValueError(f"k-means++ needs at least {num} rows, got {len(unit)}")
  picks: list[int] = []
  if centres_CxD is None or not len(centres_CxD):
    picks.append(int(rng.integers(len(unit))))
    best_dist = 1.0 - unit @ unit[picks[0]]
  else:  # in float32 blocks: N x C cosines of a real bank
    c = _unit(centres_CxD).astype(np.float32)
    best_dist = 1.0 - np.concatenate([(unit[i:i + 4096].astype(np.float32) @ c.T).max(-1)
                                      for i in range(0, len(unit), 4096)]).astype(np.float64)
  while len(picks) < num:
    weights = np.maximum(best_dist, 0.0)
    weights[picks] = 0.0
    total = weights.sum()
    nxt = (int(rng.choice(len(unit), p=weights / total)) if total > 0
           else int(rng.choice(np.setdiff1d(np.arange(len(unit)), picks))))
    picks.append(nxt)
    best_dist = np.minimum(best_dist, 1.0 - unit @ unit[nxt])
  return np.asarray(picks)


def init_prototypes_from_hidden(model: PrismLM, tokens_BxT: jax.Array, *, seed: int = 0,
                                mask_BxT: jax.Array | None = None,
                                kmeans_pp: bool = True,
                                z_BxTxD: np.ndarray | None = None) -> np.ndarray:
  """Set the bank to hidden states z of given tokens (PRISM.md §1 'prototype init').

  Picks K distinct valid token positions, spread by k-means++ seeding on cosine distance
  when `kmeans_pp` (else uniformly at random). Returns the chosen flat token indices.
  `z_BxTxD`: the tokens' hidden states when the caller computed them (the training loop:
  a jitted forward whose result every process holds).
  """
  if z_BxTxD is None:
    z_BxTxD, _ = model.backbone(tokens_BxT)
  z_NxD = np.asarray(z_BxTxD, np.float64).reshape(-1, z_BxTxD.shape[-1])
  valid = np.ones(len(z_NxD), bool) if mask_BxT is None else np.asarray(mask_BxT).reshape(-1)
  candidates = np.flatnonzero(valid)
  num_protos = model.cfg.num_prototypes
  if len(candidates) < num_protos:
    raise ValueError(f"prototype init needs at least K={num_protos} valid tokens, "
                     f"got {len(candidates)}; pass more tokens")
  rng = np.random.default_rng(seed)
  if not kmeans_pp:
    chosen = rng.choice(candidates, num_protos, replace=False)
  else:
    chosen = candidates[kmeans_pp_pick(z_NxD[candidates], num_protos, rng)]
  model.bank.protos[...] = jnp.asarray(z_NxD[chosen], jnp.float32)
  return chosen
