"""TopK sparse autoencoder (Gao et al. 2024) on a DenseLM's final hidden state, the place
PRISM's prototype layer sits: the SAE-controller baseline's dictionary.

    s = ReLU(TopK(W_enc (x − b_pre) + b_enc)),   x̂ = W_dec s + b_pre
  loss   ||x − x̂||² / Var(x)  +  α ||e − ê||² / Var(e)  (AuxK: e = x − x̂ reconstructed by
         the top k_aux pre-activations of the dead latents, α = 1/32)
  decoder rows unit-norm: the gradient component parallel to each row is removed before
  Adam and rows are renormalised after every step; b_pre starts at the geometric median.
Trained on train/engine.py's shared Trainer. A latent is dead when it fired on none of a
fixed sample of `dead_sample` tokens at the last check (every `dead_every` steps).
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from prism_jax.losses import token_nll
from prism_jax.train.engine import Trainer

HI = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class SaeConfig:
  num_latents: int = 512
  k: int = 8  # matched to PRISM's k
  k_aux: int = 64  # Gao et al.: d_model / 2
  aux_coef: float = 1.0 / 32
  lr: float = 1e-3
  steps: int = 1500
  batch_tokens: int = 1024
  dead_every: int = 50
  dead_sample: int = 8192
  seed: int = 0

  def __post_init__(self):
    if not 0 < self.k <= self.num_latents:
      raise ValueError(f"SAE k must be in [1, num_latents={self.num_latents}], got {self.k}")
    if not 0 < self.k_aux <= self.num_latents:
      raise ValueError(f"SAE k_aux must be in [1, {self.num_latents}], got {self.k_aux}")


def geometric_median(x_NxD: np.ndarray, iters: int = 100, eps: float = 1e-8) -> np.ndarray:
  """Weiszfeld's iteration, float64."""
  x = np.asarray(x_NxD, np.float64)
  m = x.mean(0)
  for _ in range(iters):
    w = 1.0 / np.maximum(np.linalg.norm(x - m, axis=1), eps)
    new = (w[:, None] * x).sum(0) / w.sum()
    if np.linalg.norm(new - m) < eps * max(1.0, np.linalg.norm(m)):
      return new
    m = new
  return m


def init_params(x_NxD: np.ndarray, cfg: SaeConfig) -> dict[str, jax.Array]:
  d = x_NxD.shape[1]
  rng = np.random.default_rng(cfg.seed)
  dec = rng.standard_normal((cfg.num_latents, d))
  dec /= np.linalg.norm(dec, axis=1, keepdims=True)
  return {"W_enc": jnp.asarray(dec.T, jnp.float32), "b_enc": jnp.zeros(cfg.num_latents),
          "W_dec": jnp.asarray(dec, jnp.float32),
          "b_pre": jnp.asarray(geometric_median(x_NxD), jnp.float32)}


def pre_acts(params, x_NxD):
  return jnp.einsum("nd,dm->nm", x_NxD - params["b_pre"], params["W_enc"],
                    precision=HI) + params["b_enc"]


def encode(params, x_NxD, k: int) -> tuple[jax.Array, jax.Array]:
  """(idx_Nxk, s_Nxk): the top-k latents and their ReLU'd activations."""
  vals, idx = jax.lax.top_k(pre_acts(params, x_NxD), k)
  return idx, jax.nn.relu(vals)


def decode(params, idx_Nxk, s_Nxk):
  return jnp.einsum("nk,nkd->nd", s_Nxk, params["W_dec"][idx_Nxk],
                    precision=HI) + params["b_pre"]


def _var(x_NxD):
  return jnp.mean(jnp.sum((x_NxD - x_NxD.mean(0)) ** 2, -1))


def sae_loss(params, batch, cfg: SaeConfig):
  x = batch["x"]
  pre = pre_acts(params, x)
  vals, idx = jax.lax.top_k(pre, cfg.k)
  x_hat = jnp.einsum("nk,nkd->nd", jax.nn.relu(vals), params["W_dec"][idx],
                     precision=HI) + params["b_pre"]
  mse = jnp.mean(jnp.sum((x - x_hat) ** 2, -1)) / _var(x)
  e = x - jax.lax.stop_gradient(x_hat)
  aux_vals, aux_idx = jax.lax.top_k(jnp.where(batch["dead_M"], pre, -jnp.inf), cfg.k_aux)
  aux_s = jnp.where(jnp.isfinite(aux_vals), jax.nn.relu(aux_vals), 0.0)
  e_hat = jnp.einsum("nk,nkd->nd", aux_s, params["W_dec"][aux_idx], precision=HI)
  aux = jnp.mean(jnp.sum((e - e_hat) ** 2, -1)) / jnp.maximum(_var(e), 1e-12)
  aux = jnp.where(jnp.any(batch["dead_M"]), aux, 0.0)
  loss = mse + cfg.aux_coef * aux
  return loss, {"mse_norm": mse, "aux": aux, "dead_frac": jnp.mean(batch["dead_M"])}


def _unit_rows(w):
  return w / jnp.maximum(jnp.linalg.norm(w, axis=1, keepdims=True), 1e-12)


def remove_parallel_grad() -> optax.GradientTransformation:
  """Drops the component of W_dec's gradient along each (unit) decoder row."""
  def update(updates, state, params):
    g, d = updates["W_dec"], params["W_dec"]
    return {**updates, "W_dec": g - jnp.sum(g * d, 1, keepdims=True) * d}, state
  return optax.GradientTransformation(lambda _: optax.EmptyState(), update)


def renormalise_decoder() -> optax.GradientTransformation:
  """Turns the W_dec update into one that lands on unit-norm rows."""
  def update(updates, state, params):
    new = params["W_dec"] + updates["W_dec"]
    return {**updates, "W_dec": _unit_rows(new) - params["W_dec"]}, state
  return optax.GradientTransformation(lambda _: optax.EmptyState(), update)


class SaeFit(NamedTuple):
  params: dict[str, Any]
  cfg: SaeConfig
  final_metrics: dict[str, float]


def train_sae(x_NxD: np.ndarray, cfg: SaeConfig, log_every: int = 100) -> SaeFit:
  """Fits the SAE on hidden states x (N, D) with the shared Trainer."""
  x_NxD = np.asarray(x_NxD, np.float32)
  if len(x_NxD) < cfg.batch_tokens:
    raise ValueError(f"SAE training needs >= batch_tokens={cfg.batch_tokens} hidden states, "
                     f"got {len(x_NxD)}")
  rng = np.random.default_rng(cfg.seed)
  sample = jnp.asarray(x_NxD[rng.choice(len(x_NxD), min(cfg.dead_sample, len(x_NxD)),
                                        replace=False)])
  dead = {"M": np.zeros(cfg.num_latents, bool)}
  fired = jax.jit(lambda p, x: jnp.zeros(cfg.num_latents, bool).at[
      encode(p, x, cfg.k)[0].reshape(-1)].set(True))

  def batches():
    while True:
      take = rng.integers(0, len(x_NxD), cfg.batch_tokens)
      yield {"x": x_NxD[take], "dead_M": dead["M"].copy()}

  def check_dead(done, state):
    if done % cfg.dead_every == 0:
      dead["M"] = ~np.asarray(fired(state.params, sample))

  tx = optax.chain(remove_parallel_grad(), optax.adam(cfg.lr), renormalise_decoder())
  trainer = Trainer(lambda p, b: sae_loss(p, b, cfg), tx)
  result = trainer.fit(init_params(x_NxD, cfg), batches(), steps=cfg.steps,
                       log_every=log_every, callbacks=[check_dead])
  params = jax.device_get(result.state.params)
  return SaeFit(params, cfg, {k: float(v) for k, v in result.train.items()})


def sae_metrics(fit: SaeFit, model, x_NxD: np.ndarray, targets_N: np.ndarray) -> dict:
  """L0, explained variance, CE-loss recovered (vs mean-ablating x) and dead fraction on
  held-out hidden states x (N, D) with their next tokens."""
  x = jnp.asarray(x_NxD, jnp.float32)
  idx, s = encode(fit.params, x, fit.cfg.k)
  x_hat = decode(fit.params, idx, s)
  ce = lambda h: float(jnp.mean(token_nll(model.backbone.lm_head(h[None])[0],
                                          jnp.asarray(targets_N))))
  ce_orig, ce_sae = ce(x), ce(x_hat)
  ce_ablate = ce(jnp.broadcast_to(x.mean(0), x.shape))
  fired = np.zeros(fit.cfg.num_latents, bool)
  fired[np.asarray(idx)[np.asarray(s) > 0]] = True
  return {"L0": float(np.mean(np.sum(np.asarray(s) > 0, 1))),
          "explained_variance": float(1 - jnp.mean(jnp.sum((x - x_hat) ** 2, -1)) / _var(x)),
          "ce_orig": ce_orig, "ce_sae": ce_sae, "ce_mean_ablated": ce_ablate,
          "ce_loss_recovered": (ce_ablate - ce_sae) / (ce_ablate - ce_orig),
          "dead_fraction": float(1 - fired.mean()), "tokens": int(len(x_NxD))}


def sae_fingerprint(params) -> str:
  h = hashlib.sha256()
  for key in sorted(params):
    arr = np.ascontiguousarray(np.asarray(params[key]))
    h.update(repr((key, arr.shape, str(arr.dtype))).encode())
    h.update(arr.tobytes())
  return h.hexdigest()


def save_sae(path: str, fit: SaeFit) -> None:
  np.savez(path, **{k: np.asarray(v) for k, v in fit.params.items()},
           cfg=np.asarray(repr(dataclasses.asdict(fit.cfg))))


def load_sae(path: str) -> SaeFit:
  with np.load(path) as f:
    params = {k: jnp.asarray(f[k]) for k in ("W_enc", "b_enc", "W_dec", "b_pre")}
    cfg = SaeConfig(**ast.literal_eval(str(f["cfg"])))
  return SaeFit(params, cfg, {})
