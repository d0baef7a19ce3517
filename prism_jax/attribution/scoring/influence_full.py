"""The full prototype-space reference of the cached attribution (influence.py).

`full_scores` needs no cache records: it takes the exact autodiff gradient of the query
loss w.r.t. P, preconditions it with the same H in full rank, and gets ⟨H⁻¹∇_P L_q,
∇_P L_seq⟩ for every training sequence from one JVP of the per-token losses along that
direction (= the exact per-sequence gradient's inner product), streaming the backbone over
the training rows. path="linear" holds a fixed (the cached model, equal to the cache at
rank D); path="full" also differentiates a(P) (similarities).
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from prism_jax.attribution.caching import cache as cache_lib
from prism_jax.attribution.caching import cache_format
from prism_jax.attribution.hessians import curvature as cv
from prism_jax.attribution.scoring.influence import (InfluenceConfig, Preconditioner,
                                             cache_loss_config, query_batch)
from prism_jax.config import LossConfig
from prism_jax.data import batch as batch_lib


def _summed_token_loss(protos, head, model_cfg, loss_cfg, path, weight_N):
  out = cv.head_forward(protos, head, model_cfg, path=path)
  return cv.token_loss(out, head, loss_cfg) * weight_N


@functools.partial(jax.jit, static_argnames=("model_cfg", "loss_cfg", "path"))
def _query_grad(protos, head, model_cfg, loss_cfg, path):
  w = head.mask_N.astype(protos.dtype)
  return jax.grad(lambda p: jnp.sum(_summed_token_loss(p, head, model_cfg, loss_cfg, path,
                                                       w)))(protos)


@functools.partial(jax.jit, static_argnames=("model_cfg", "loss_cfg", "path"))
def _token_directional(protos, head, model_cfg, loss_cfg, path, x_QxKxD):
  """⟨X_q, ∇_P ℓ_t⟩ for every query direction and token: (Q, N), one JVP per direction."""
  w = head.mask_N.astype(protos.dtype)
  f = lambda p: _summed_token_loss(p, head, model_cfg, loss_cfg, path, w)
  return jax.vmap(lambda x: jax.jvp(f, (protos,), (x,))[1])(x_QxKxD)


def full_scores(model, cache: cache_lib.AttributionCache, packed, queries, *,
                loss_cfg: LossConfig | None = None, cfg: InfluenceConfig = InfluenceConfig(),
                path: Literal["linear", "full"] = "linear", split: str = "train",
                max_rows: int | None = None, batch_rows: int = 16,
                precond: Preconditioner | None = None) -> tuple[np.ndarray, np.ndarray]:
  """Exact prototype-space influence of every training sequence on each query.

  `queries`: a list of (tokens, target_positions). Streams `split`'s rows (the first
  `max_rows`; default: the rows the cache was built from) once for all queries.
  Returns (ids_E sorted, scores_QxE).
  """
  loss_cfg = cache_loss_config(cache, loss_cfg)
  max_rows = cache.sizes["num_rows"] if max_rows is None else max_rows
  pre = Preconditioner(cache, cfg) if precond is None else precond
  model_cfg = cv.check_model(model)
  protos = jnp.asarray(model.bank.protos[...], jnp.float32)
  xs = []
  for tokens, positions in queries:
    batch, _ = query_batch(tokens, positions, model.cfg.max_len, model.cfg.vocab_size)
    g_KxD = np.asarray(_query_grad(protos, cv.head_inputs(model, batch), model_cfg, loss_cfg,
                                   path), np.float64)
    rows = np.flatnonzero(np.any(g_KxD != 0, 1))
    p_rows, x = pre.apply(g_KxD[rows] @ pre.u_full, rows, pre.e_full)
    x_full = np.zeros_like(g_KxD)
    x_full[p_rows] = x @ pre.u_full.T
    xs.append(x_full)
  x_QxKxD = jnp.asarray(np.stack(xs), jnp.float32)
  totals: dict[int, np.ndarray] = {}
  for _, batch in cache_format.iter_rows(packed, split, batch_rows, 0, max_rows):
    batch = batch_lib.pad_batch(batch, batch_rows)
    head = cv.head_inputs(model, batch)
    s_QxN = np.asarray(_token_directional(protos, head, model_cfg, loss_cfg, path, x_QxKxD),
                       np.float64)
    ex_N = (batch["example_id"] if cfg.unit == "document" else np.broadcast_to(
        batch["row_id"][:, None], batch["example_id"].shape)).reshape(-1)
    valid = batch["mask"].reshape(-1)
    ids, inv = np.unique(ex_N[valid], return_inverse=True)
    for q in range(len(xs)):
      sums = np.bincount(inv, weights=s_QxN[q][valid], minlength=len(ids))
      for e, v in zip(ids, sums):
        totals.setdefault(int(e), np.zeros(len(xs)))[q] += v
  ids = np.asarray(sorted(totals), np.int64)
  return ids, (np.stack([totals[e] for e in ids], 1) if len(ids) else
               np.zeros((len(xs), 0)))
