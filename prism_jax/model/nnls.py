"""The least-squares mixture (`model.mixture="nnls"`): each token's weights on its k active
prototypes are the non-negative least-squares fit of z on them,

    a_t = argmin_{a >= 0} || z_t - sum_j a_j p_{idx_tj} ||^2,

instead of ReLU(cos) (near-uniform: 0.11-0.14 for all 8 active prototypes of a demo token,
issue 53). The active set is still the top-k by cosine (the op in pallas_kernels, on any
implementation); only the weights change, so the decomposition W z = W r + sum_j a_j W p_j
stays exact (r = z - z_hat) and a >= 0 keeps every contribution a prototype's own.

The solve: Lawson & Hanson's active-set NNLS (Solving Least Squares Problems, 1974, ch. 23;
what scipy.optimize.nnls implements), on the k x k Gram system G = R R^T, b = R z of each
token's k rows R, batched over tokens: every row iterates together, a row that has converged
stops changing. The iteration only chooses the passive set (the weights that are not held
at zero); it runs on stopped-gradient inputs. The weights are then one masked solve of the
Gram system on that set, differentiated by JAX: the exact derivative of the NNLS map wherever
its passive set is locally constant (strict complementarity, almost everywhere), in reverse
and forward mode (jax.hessian works through it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.topk_reconstruct.reference import sparse_mixture


def _ridge(G_Nxkxk: jax.Array) -> jax.Array:
  """A tiny multiple of I (k machine epsilons of the mean diagonal): a bank with two equal
  prototypes gives a singular Gram matrix; below rounding, so the fit is unchanged."""
  k = G_Nxkxk.shape[-1]
  eps = jnp.finfo(G_Nxkxk.dtype).eps
  scale = jnp.mean(jnp.diagonal(G_Nxkxk, axis1=-2, axis2=-1), axis=-1) + jnp.finfo(
      G_Nxkxk.dtype).tiny
  return (k * eps * scale)[:, None, None] * jnp.eye(k, dtype=G_Nxkxk.dtype)


def masked_solve(G_Nxkxk: jax.Array, b_Nxk: jax.Array, passive_Nxk: jax.Array) -> jax.Array:
  """The least-squares weights with only the `passive` ones free (the rest 0): G_PP x_P =
  b_P, batched (rows and columns outside P replaced by the identity's)."""
  k = G_Nxkxk.shape[-1]
  both = passive_Nxk[:, :, None] & passive_Nxk[:, None, :]
  A = jnp.where(both, G_Nxkxk, jnp.eye(k, dtype=G_Nxkxk.dtype))
  rhs = jnp.where(passive_Nxk, b_Nxk, 0.0)
  x = jnp.linalg.solve(A, rhs[..., None])[..., 0]
  return jnp.where(passive_Nxk, x, 0.0)


def passive_set(G_Nxkxk: jax.Array, b_Nxk: jax.Array, max_iter: int | None = None
                ) -> jax.Array:
  """Lawson-Hanson's passive set (bool (N, k)) of each row's NNLS problem (module doc)."""
  return lawson_hanson(G_Nxkxk, b_Nxk, max_iter)[0]


def lawson_hanson(G_Nxkxk: jax.Array, b_Nxk: jax.Array, max_iter: int | None = None
                  ) -> tuple[jax.Array, jax.Array]:
  """(passive set, outer iterations taken): every row has converged when the count is
  below max_iter (3k + 4 by default)."""
  n, k = b_Nxk.shape
  max_iter = 3 * k + 4 if max_iter is None else max_iter
  dtype = b_Nxk.dtype
  eps = 10 * k * jnp.finfo(dtype).eps
  tol_w_N = eps * (jnp.max(jnp.abs(b_Nxk), -1) + jnp.finfo(dtype).tiny)  # gradient units

  def inner(carry):
    # Solve on P; where a passive weight would go <= 0, step towards the solution as far as
    # feasibility allows and drop the weights that reach 0 (each pass drops >= 1, so k + 1
    # passes settle every row; most rows settle in the first).
    x, P, settled, moving, it = carry
    s = masked_solve(G_Nxkxk, b_Nxk, P)
    bad = P & (s <= 0)
    any_bad = jnp.any(bad, -1)
    act = moving & ~settled
    ratio = jnp.where(bad, x / jnp.where(bad, x - s, 1.0), jnp.inf)
    alpha = jnp.clip(jnp.min(ratio, -1), 0.0, 1.0)
    stepped = x + alpha[:, None] * (s - x)
    # weight units: what is left of the weight the step drove to 0 is rounding
    tol_x_N = eps * (jnp.max(jnp.abs(jnp.where(P, s, 0.0)), -1) + jnp.finfo(dtype).tiny)
    x = jnp.where((act & any_bad)[:, None], stepped, jnp.where((act & ~any_bad)[:, None], s, x))
    P = jnp.where((act & any_bad)[:, None], P & (x > tol_x_N[:, None]), P)
    x = jnp.where(P, x, 0.0)
    return x, P, settled | (act & ~any_bad), moving, it + 1

  def unsettled(carry):
    _, _, settled, moving, it = carry
    return jnp.any(moving & ~settled) & (it <= k)

  def outer(state):
    x, P, blocked, done, it = state
    w = b_Nxk - jnp.einsum("nij,nj->ni", G_Nxkxk, x)  # the negative gradient
    cand = jnp.where(P | blocked, -jnp.inf, w)
    j = jnp.argmax(cand, -1)
    moving = ~done & (jnp.max(cand, -1) > tol_w_N)  # a zero weight that would lower the loss
    added = moving[:, None] & jax.nn.one_hot(j, k, dtype=bool)
    x, P, _, _, _ = jax.lax.while_loop(
        unsettled, inner, (x, P | added, jnp.zeros(n, bool), moving, jnp.zeros((), jnp.int32)))
    # An index whose own solve put it back at 0 (a gradient above the tolerance that
    # rounding cannot turn into a weight) is not offered again until another one enters:
    # exact Lawson-Hanson never meets it; without this a row would cycle to max_iter.
    rejected = added & ~P
    kept = jnp.any(added & P, -1)
    blocked = jnp.where(kept[:, None], False, blocked | rejected)
    return x, P, blocked, ~moving, it + 1

  def cond(state):
    return jnp.any(~state[3]) & (state[4] < max_iter)

  init = (jnp.zeros((n, k), dtype), jnp.zeros((n, k), bool), jnp.zeros((n, k), bool),
          jnp.zeros(n, bool), jnp.zeros((), jnp.int32))
  out = jax.lax.while_loop(cond, outer, init)
  return out[1], out[4]


def nnls_weights(z_NxD: jax.Array, rows_NxkxD: jax.Array, max_iter: int | None = None
                 ) -> jax.Array:
  """a_Nxk >= 0 minimising ||z_t - sum_j a_tj rows_tj||^2 per token (module doc);
  differentiable in z and the rows."""
  G = jnp.einsum("nid,njd->nij", rows_NxkxD, rows_NxkxD)
  G = G + jax.lax.stop_gradient(_ridge(G))
  b = jnp.einsum("nid,nd->ni", rows_NxkxD, z_NxD)
  P = passive_set(jax.lax.stop_gradient(G), jax.lax.stop_gradient(b), max_iter)
  return jnp.maximum(masked_solve(G, b, jax.lax.stop_gradient(P)), 0.0)


def nnls_mixture(z_NxD: jax.Array, protos_KxD: jax.Array, idx_Nxk: jax.Array
                 ) -> tuple[jax.Array, jax.Array]:
  """(a_Nxk, z_hat_NxD) of the least-squares mixture on the active set `idx_Nxk`, in the
  wider of the inputs' dtype and float32."""
  dtype = jnp.promote_types(jnp.promote_types(z_NxD.dtype, protos_KxD.dtype), jnp.float32)
  protos = protos_KxD.astype(dtype)
  a_Nxk = nnls_weights(z_NxD.astype(dtype), protos[idx_Nxk])
  return a_Nxk, sparse_mixture(a_Nxk, idx_Nxk, protos)
