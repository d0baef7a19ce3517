"""One D×D block ∂²L/∂p_i∂p_j of the bank's Hessian at any bank size, exact or K-FAC.

The exact functions of hessian.py form the whole (K·D)² matrix (34 GB in float64 at the
tiny preset's K 512, D 128). `hessian_block` needs D Hessian-vector products instead: the
tangents are the D unit directions of row p_i (jvp of ∇_P L, forward over reverse), and
the p_j row of each product is one row of the block:

    (H e_{i,a})[p_j] = ∂²L/∂p_j∂p_{i,a} = block(i, j)[a, :]     (H symmetric)

L is `curvature.bank_loss` (the model's head, prism_jax.losses' terms) averaged over the
batches, each batch weighing as one training step's loss. Memory is that of `chunk`
products at once (each one forward and backward of the head, N·K and N·V arrays).
`kfac_block` is the matching block of the §4 model A ⊗ G + blockdiag(μ_i I).
"""

from __future__ import annotations

import functools
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from prism_jax.attribution.hessians import curvature as cv
from prism_jax.attribution.hessians.curvature_stats import CurvatureStats
from prism_jax.config import LossConfig, ModelConfig


@functools.partial(jax.jit, static_argnames=("model_cfg", "loss_cfg", "path", "terms"))
def _block_rows(head: cv.HeadInputs, i, j, tangents_CxD, *, model_cfg: ModelConfig,
                loss_cfg: LossConfig, path: str, terms: str) -> jax.Array:
  """Rows a of block(i, j) for the C tangent directions e_a of p_i: (C, D)."""
  grad = jax.grad(lambda p: cv.bank_loss(p, head, model_cfg, loss_cfg, path=path,
                                         terms=terms))
  p0 = head.protos_KxD
  # ∇_{p_j} L as a function of p_i alone: its jvp along t is the p_j row of H t, t in p_i.
  grad_j_of_pi = lambda x_D: grad(p0.at[i].set(x_D))[j]
  return jax.vmap(lambda t_D: jax.jvp(grad_j_of_pi, (p0[i],), (t_D,))[1])(tangents_CxD)


def hessian_block(model: Any, batches: Iterable[dict[str, Any]], i: int, j: int, *,
                  loss_cfg: LossConfig = LossConfig(), path: str = "full",
                  terms: str = "all", dtype: Any = None, chunk: int = 32) -> np.ndarray:
  """Exact ∂²L/∂p_i∂p_j, (D, D) float64 numpy, of the mean batch loss over `batches`.

  Args:
    model: the PrismLM (model.kind "prism") whose bank P the Hessian is taken in.
    batches: an iterable of at least one batch, each a dict of "inputs", "targets" and
      "mask" arrays of one (B, T) shape; L is the mean of the batches' losses, each batch
      weighing as one training step's loss.
    i: the row prototype id, an int in [0, K).
    j: the column prototype id, an int in [0, K).
    loss_cfg: the loss weights of L (curvature.bank_loss: CE + λ_rec REC + λ_1 R1 + λ_2 R2;
      the terms that read W z_hat must be 0). Default: `LossConfig()`.
    path: "full" (default: the activations move with P) or "linear" (activations fixed),
      as in curvature.bank_loss.
    terms: which loss terms enter L: "all" (default), "output" (CE + λ_rec REC) or
      "clustering" (λ_1 R1 + λ_2 R2), as in curvature.bank_loss.
    dtype: the dtype the head is evaluated in; None (default) is float64 under
      jax.enable_x64, float32 otherwise.
    chunk: Hessian-vector products run at once (memory grows with it), positive; 32 by
      default.

  Returns:
    The block ∂²L/∂p_i∂p_j as a float64 numpy array of shape (D, D): entry [a, b] is
    ∂²L/∂p_{i,a}∂p_{j,b}.
  """
  model_cfg = cv.check_model(model)
  num_k, d = model_cfg.num_prototypes, model_cfg.d_model
  for name, v in (("i", i), ("j", j)):
    if not isinstance(v, (int, np.integer)) or not 0 <= v < num_k:
      raise ValueError(f"{name}={v!r} is not a prototype id in [0, K={num_k})")
  if chunk <= 0:
    raise ValueError(f"chunk must be positive, got {chunk}")
  if dtype is None:
    dtype = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
  eye_DxD = jnp.eye(d, dtype=dtype)
  total, count = np.zeros((d, d)), 0
  for batch in batches:
    head = cv.head_inputs(model, batch, dtype)
    rows = [_block_rows(head, i, j, eye_DxD[lo:lo + chunk], model_cfg=model_cfg,
                        loss_cfg=loss_cfg, path=path, terms=terms)
            for lo in range(0, d, chunk)]
    total += np.asarray(jnp.concatenate(rows), np.float64)
    count += 1
  if count == 0:
    raise ValueError("hessian_block needs at least one batch")
  return total / count


def kfac_block(stats: CurvatureStats, i: int, j: int) -> np.ndarray:
  """Block (i, j) of A ⊗ G + blockdiag(μ_i I): A_ij G (+ μ_i I on the diagonal), (D, D)."""
  num_k = stats.mu.shape[0]
  if not (0 <= i < num_k and 0 <= j < num_k):
    raise ValueError(f"(i, j)=({i}, {j}) is not a pair of prototype ids in [0, K={num_k})")
  a_ij = float(stats.A[i, j])
  block = a_ij * stats.G
  if i == j:
    block = block + stats.mu[i] * np.eye(stats.G.shape[0])
  return block
