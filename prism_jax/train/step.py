"""The pure jitted train step (donated state) and the eval step.

`train_step(state, batch) -> (state, metrics)`; metrics are device scalars that the loop
fetches one step late. During the dense warm-up of a PRISM model (before its bank is set
from data) the loss is the dense CE of W z: the random bank is bypassed, so nothing but
the backbone trains and the bank's optimiser moments stay zero.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from prism_jax import faithfulness
from prism_jax import grounding
from prism_jax import losses
from prism_jax import sharding as shard_lib
from prism_jax.config import Config
from prism_jax.train import accumulate
from prism_jax.train import engine
from prism_jax.train.optimizer import lr_schedule
from prism_jax.train.state import TrainState

BATCH_KEYS = ("inputs", "targets", "mask")


def device_batch(batch: dict[str, np.ndarray], mesh: jax.sharding.Mesh,
                 global_batch: int) -> dict[str, jax.Array]:
  """This process's rows of a batch -> global arrays split over the data axes."""
  local = {k: np.asarray(batch[k]) for k in BATCH_KEYS}
  return shard_lib.make_global_batch(local, mesh, global_batch)


def uses_dense_warmup(cfg: Config) -> bool:
  return (cfg.model.kind == "prism" and cfg.model.proto_init == "data"
          and (cfg.train.proto_init_step == "auto" or cfg.train.proto_init_step > 0))


def step_key(cfg: Config, step: jax.Array, stream: int) -> jax.Array:
  """The randomness of training step `step` (dropout: stream 0, residual dropout: 1), a
  pure function of (train.seed, step, stream): a resumed run draws the same masks."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.key(cfg.train.seed), step), stream)


def _dropout_key(cfg: Config, step) -> jax.Array | None:
  return None if cfg.model.dropout == 0.0 or step is None else step_key(cfg, step, 0)


def _dense_loss(model, batch, dropout_key=None, share=None
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
  z_BxTxD, _ = model.backbone(batch["inputs"], dropout_key=dropout_key)
  logits = model.backbone.lm_head(z_BxTxD)
  vocab = logits.shape[-1]
  ce = losses.cross_entropy(logits.reshape(-1, vocab), batch["targets"].reshape(-1),
                            batch["mask"].reshape(-1))
  if share is not None:  # a microbatch's share of the batch's mean (gradient accumulation)
    ce = share["weight"] * ce
  return ce, {"ce": ce, "loss": ce}


def _residual_keep(cfg: Config, step: jax.Array, shape) -> jax.Array | None:
  """Residual dropout's keep mask (issue 11): deterministic from the seed and the step."""
  rate = cfg.model.residual_dropout
  if cfg.model.kind != "prism" or rate == 0.0:
    return None
  return jax.random.bernoulli(step_key(cfg, step, 1), 1.0 - rate, shape)


def _model_loss(model, batch, cfg: Config, step=None, share=None
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
  keep = None
  if step is not None:
    keep = (_residual_keep(cfg, step, batch["inputs"].shape) if share is None
            else share.get("residual_keep_BxT"))
  extra = {} if keep is None else {"residual_keep_BxT": keep}  # DenseLM takes no keep mask
  out = model(batch["inputs"], mask_BxT=batch["mask"], dropout_key=_dropout_key(cfg, step),
              **extra)
  proto_logits = None
  if out.protos is not None and cfg.loss.needs_proto_logits:
    proto_logits = model.proto_path_logits(out.protos, *batch["inputs"].shape)
  return losses.total_loss(out, batch["targets"], batch["mask"], cfg.loss, step=step,
                           proto_logits_BxTxV=proto_logits, share=share)


def make_train_step(graphdef, cfg: Config, tx: optax.GradientTransformation,
                    shardings: TrainState, mesh: jax.sharding.Mesh, *,
                    dense_phase: bool = False) -> Callable:
  """Jitted `train_step(state, batch) -> (state, metrics)` with the state donated: the
  model's loss through the shared step builder (prism_jax.train.engine.make_step).

  `dense_phase=True` builds the warm-up variant (dense CE through W z; see module doc).
  """

  def loss_fn(params, batch, step, share=None):
    if cfg.train.trainable == "prototypes" and not dense_phase:  # frozen backbone: no backward
      params = {**params, "backbone": jax.lax.stop_gradient(params["backbone"])}
    model = nnx.merge(graphdef, params)
    if dense_phase:
      return _dense_loss(model, batch, _dropout_key(cfg, step), share)
    return _model_loss(model, batch, cfg, step, share)

  batch_sh = {k: shard_lib.batch_sharding(mesh) for k in BATCH_KEYS}
  accum = cfg.train.grad_accum
  return engine.make_step(loss_fn, tx, state_shardings=shardings, batch_shardings=batch_sh,
                           schedule=lr_schedule(cfg.train), pass_step=True, grad_accum=accum,
                           prepass=None if accum == 1 else _shares(graphdef, cfg, dense_phase))


def _shares(graphdef, cfg: Config, dense_phase: bool) -> Callable:
  """The prepass of an accumulated step (prism_jax/train/accumulate.py): each microbatch's
  share of the batch. Token-mean terms weigh a microbatch by its valid tokens; R1 (a mean
  over prototypes of the nearest token of the *whole* batch) needs every microbatch's
  nearest distances first: one forward per microbatch, no gradient, then each prototype is
  owned by the microbatch holding its nearest token (the first on a tie). Residual dropout's
  mask is drawn for the whole batch and split like the rows, so it equals the unsplit
  step's. (model.dropout > 0 draws its masks per microbatch: the same distribution, not the
  same bits.)"""

  def prepass(params, micro, step):
    num = micro["mask"].shape[0]
    tokens_M = jnp.sum(micro["mask"], axis=(1, 2)).astype(jnp.float32)
    share = {"weight": tokens_M / jnp.maximum(jnp.sum(tokens_M), 1.0)}
    if dense_phase or cfg.model.kind != "prism":
      return share
    model_of = lambda p: nnx.merge(graphdef, p)

    def nearest(_, mb):
      out = model_of(params)(mb["inputs"], mask_BxT=mb["mask"])
      return None, out.protos.col_min_dist_K

    _, col_MxK = jax.lax.scan(nearest, None, micro)
    col_MxK = jax.lax.stop_gradient(col_MxK)
    best_K = jnp.min(col_MxK, axis=0)
    owner_K = jnp.argmin(col_MxK, axis=0)
    finite_K = jnp.isfinite(best_K)
    share["r1_owner_K"] = (jnp.arange(num)[:, None] == owner_K[None]) & finite_K[None]
    share["r1_count"] = jnp.broadcast_to(jnp.sum(finite_K).astype(jnp.float32), (num,))
    rows = micro["inputs"].shape[0] * micro["inputs"].shape[1]
    keep = _residual_keep(cfg, step, (rows,) + micro["inputs"].shape[2:])
    if keep is not None:  # split like the rows (accumulate.split)
      share["residual_keep_BxT"] = accumulate.split(keep, num)
    return share

  return prepass


def eval_stats_init(cfg: Config) -> dict[str, Any]:
  """Running sufficient statistics of the evaluation metrics (summed over batches)."""
  stats: dict[str, Any] = {"nll_sum": jnp.zeros((), jnp.float32),
                           "tokens": jnp.zeros((), jnp.float32)}
  if cfg.model.kind == "prism":
    stats["grounding"] = grounding.grounding_init(cfg.model.num_prototypes)
    stats["faithfulness"] = faithfulness.faithfulness_init()
  return stats


def make_eval_step(graphdef, cfg: Config, param_shardings: Any,
                   mesh: jax.sharding.Mesh) -> Callable:
  """Jitted `eval_step(params, batch, stats) -> stats` accumulating eval statistics."""

  def eval_step(params, batch, stats):
    model = nnx.merge(graphdef, params)
    out = model(batch["inputs"], mask_BxT=batch["mask"])
    vocab = out.logits_BxTxV.shape[-1]
    mask_N = batch["mask"].reshape(-1)
    maskf_N = mask_N.astype(jnp.float32)
    nll_N = losses.token_nll(out.logits_BxTxV.reshape(-1, vocab), batch["targets"].reshape(-1))
    new = dict(stats)
    new["nll_sum"] = stats["nll_sum"] + jnp.sum(nll_N * maskf_N)
    new["tokens"] = stats["tokens"] + jnp.sum(maskf_N)
    if out.protos is not None:
      z_NxD = out.z_BxTxD.reshape(-1, out.z_BxTxD.shape[-1])
      new["grounding"] = grounding.grounding_update(stats["grounding"], out.protos, z_NxD,
                                                    mask_N)
      proto_logits = model.proto_path_logits(out.protos, *batch["inputs"].shape)
      new["faithfulness"] = faithfulness.faithfulness_update(
          stats["faithfulness"], out.logits_BxTxV.reshape(-1, vocab),
          proto_logits.reshape(-1, vocab), batch["targets"].reshape(-1), mask_N)
    return new

  batch_sh = {k: shard_lib.batch_sharding(mesh) for k in BATCH_KEYS}
  return jax.jit(eval_step, in_shardings=(param_shardings, batch_sh, None))


def eval_stats_finalize(stats: dict[str, Any]) -> dict[str, float]:
  """Host-side metrics: val loss (CE), perplexity and, for PRISM, the grounding metrics
  of prism_jax.grounding (r1_bar, r2_bar, residual_share, dead prototypes) and the
  faithfulness metrics of prism_jax.faithfulness (proto_ce, agreement, ...), and `usage`:
  each prototype's count of tokens that selected it ((K,) int64, not a scalar)."""
  s = jax.device_get(stats)
  tokens = max(float(s["tokens"]), 1.0)
  ce = float(s["nll_sum"]) / tokens
  out = {"loss": ce, "perplexity": float(np.exp(min(ce, 80.0))), "tokens": float(s["tokens"])}
  if "grounding" in s:
    g = grounding.grounding_finalize(s["grounding"])
    out.update(r1_bar=g["r1_bar"], r2_bar=g["r2_bar"], residual_share=g["residual_share"],
               dead_prototypes=float(g["dead"]), dead_frac=g["dead_frac"], usage=g["usage"])
  if "faithfulness" in s:
    out.update(faithfulness.faithfulness_finalize(s["faithfulness"]))
  return out
