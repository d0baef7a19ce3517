"""The functional prototype layer against a float64 NumPy reference.

Inputs are fresh random draws. Top-k tests build tie-free inputs with clear gaps (prototypes
along random orthogonal directions, token coefficients on a shuffled, evenly spaced grid), or
explicit ties (duplicate prototype rows) to pin the documented tie-break: lower id first.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from prism_jax.model.prototypes import PrototypeBank, prototype_layer

IMPL = "xla"  # the reference implementation; kernels are tested against it elsewhere


def np_reference(z, p, k, mixture="raw", distance="cosine", mask=None):
  """float64 oracle. Ties in similarity go to the lower prototype id."""
  z = np.asarray(z, np.float64)
  p = np.asarray(p, np.float64)
  cos = (z @ p.T) / np.linalg.norm(z, axis=1)[:, None] / np.linalg.norm(p, axis=1)[None, :]
  ids = np.arange(p.shape[0])
  idx = np.stack([np.lexsort((ids, -row))[:k] for row in cos])
  sim = np.take_along_axis(cos, idx, axis=1)
  act = np.maximum(sim, 0.0)
  if mixture == "normalized":
    act = act / np.maximum(act.sum(1, keepdims=True), 1e-6)
  z_hat = np.einsum("nk,nkd->nd", act, p[idx])
  valid = np.ones(len(z), bool) if mask is None else np.asarray(mask, bool)
  if distance == "cosine":
    dist = 1.0 - cos
  else:
    dist = ((z[:, None, :] - p[None, :, :]) ** 2).sum(-1)
  col_max_cos = np.where(valid[:, None], cos, -np.inf).max(0)
  col_min_dist = np.where(valid[:, None], dist, np.inf).min(0)
  return dict(idx=idx, act=act, sim=sim, z_hat=z_hat, residual=z - z_hat,
              row_max_cos=cos.max(1), col_max_cos=col_max_cos, row_min_dist=dist.min(1),
              col_min_dist=col_min_dist)


def gapped_inputs(rng, n, num_protos, d, dup=None):
  """Prototypes = random scales x orthonormal directions (D >= K distinct); token
  coefficients are a shuffled grid, so adjacent cosines differ by >= ~1e-3.

  `dup` maps duplicate id -> source id: row dup becomes an exact copy of row source.
  """
  distinct = num_protos - (0 if dup is None else len(dup))
  assert d >= distinct + 2
  q, _ = np.linalg.qr(rng.normal(size=(d, d)))
  dirs = q[:distinct]
  scales = rng.uniform(0.5, 3.0, size=(distinct, 1))
  base = dirs * scales
  grid = np.linspace(-1.0, 1.0, distinct)
  coef = np.stack([rng.permutation(grid) for _ in range(n)])
  off = rng.normal(size=(n, d - distinct)) @ q[distinct:] * 0.3  # off the span of P
  z = (coef @ dirs + off) * rng.uniform(0.5, 2.0, size=(n, 1))
  if dup is None:
    p = base
  else:
    others = [i for i in range(num_protos) if i not in dup]
    p = np.zeros((num_protos, d))
    p[others] = base
    for i, src in dup.items():
      p[i] = p[src]
  return z.astype(np.float32), p.astype(np.float32)


def assert_matches(out, ref, atol=2e-5):
  np.testing.assert_array_equal(np.asarray(out.idx_Nxk), ref["idx"])
  for name, field in (("act", "act_Nxk"), ("sim", "sim_Nxk"), ("z_hat", "z_hat_NxD"),
                      ("residual", "residual_NxD"), ("row_max_cos", "row_max_cos_N"),
                      ("col_max_cos", "col_max_cos_K"), ("row_min_dist", "row_min_dist_N"),
                      ("col_min_dist", "col_min_dist_K")):
    got = np.asarray(getattr(out, field), np.float64)
    scale = max(1.0, float(np.max(np.abs(ref[name][np.isfinite(ref[name])]), initial=0)))
    np.testing.assert_allclose(got, ref[name], rtol=0, atol=atol * scale, err_msg=name)
    assert getattr(out, field).dtype == jnp.float32, field


@pytest.mark.parametrize("num_protos,k,mixture", [
    (37, 1, "raw"), (37, 5, "normalized"), (37, 37, "raw"), (129, 16, "raw"),
    (129, 129, "normalized"), (8, 3, "normalized")])
def test_topk_and_reconstruction_vs_float64(num_protos, k, mixture):
  rng = np.random.default_rng(100 + num_protos * 7 + k)
  z, p = gapped_inputs(rng, 24, num_protos, num_protos + 7)
  out = prototype_layer(jnp.asarray(z), jnp.asarray(p), k, mixture=mixture,
                        implementation=IMPL)
  ref = np_reference(z, p, k, mixture)
  assert out.idx_Nxk.dtype == jnp.int32 and out.idx_Nxk.shape == (24, k)
  assert_matches(out, ref)
  assert np.all(np.asarray(out.act_Nxk) >= 0)
  if mixture == "normalized":  # rows with any positive similarity form a convex mixture
    sums = np.asarray(out.act_Nxk).sum(1)
    np.testing.assert_allclose(sums[ref["sim"][:, 0] > 0], 1.0, rtol=1e-5)


def test_default_implementation_matches_float64():
  """The path models use (implementation=None: best available for the backend)."""
  rng = np.random.default_rng(3)
  z, p = gapped_inputs(rng, 20, 45, 50)
  mask = rng.random(20) < 0.7
  out = prototype_layer(jnp.asarray(z), jnp.asarray(p), 6, mixture="normalized",
                        mask_N=jnp.asarray(mask))
  assert_matches(out, np_reference(z, p, 6, "normalized", mask=mask))


def test_generic_random_inputs_give_a_valid_topk():
  """Unstructured Gaussian inputs (D < K): the returned set is a top-k up to fp32 error."""
  rng = np.random.default_rng(7)
  z = rng.normal(size=(40, 12)).astype(np.float32)
  p = rng.normal(size=(61, 12)).astype(np.float32)
  k = 9
  out = prototype_layer(jnp.asarray(z), jnp.asarray(p), k, implementation=IMPL)
  ref = np_reference(z, p, k)
  cos = (z.astype(np.float64) @ p.T.astype(np.float64)) / np.outer(
      np.linalg.norm(z.astype(np.float64), axis=1), np.linalg.norm(p.astype(np.float64), axis=1))
  idx = np.asarray(out.idx_Nxk)
  chosen = np.take_along_axis(cos, idx, 1)
  kth = np.sort(cos, 1)[:, ::-1][:, k - 1]
  assert np.all(chosen >= kth[:, None] - 1e-6)
  assert all(len(set(row)) == k for row in idx)
  assert np.all(np.diff(chosen, axis=1) <= 1e-6)  # decreasing similarity
  np.testing.assert_allclose(np.asarray(out.sim_Nxk), chosen, atol=1e-6)
  np.testing.assert_allclose(np.asarray(out.z_hat_NxD),
                             np.einsum("nk,nkd->nd", np.maximum(chosen, 0), p[idx]), atol=1e-5)
  np.testing.assert_allclose(np.asarray(out.row_max_cos_N), ref["row_max_cos"], atol=1e-6)


def test_ties_go_to_the_lower_prototype_id():
  rng = np.random.default_rng(11)
  num_protos, k = 40, 7
  dup = {3: 30, 17: 30, 39: 5, 0: 12, 25: 12, 26: 12}  # copies of rows 30, 5 and 12
  z, p = gapped_inputs(rng, 48, num_protos, 40, dup=dup)
  out = prototype_layer(jnp.asarray(z), jnp.asarray(p), k, implementation=IMPL)
  ref = np_reference(z, p, k)
  # The construction must exercise ties inside the top-k and across the k-th boundary.
  groups = [(3, 17, 30), (5, 39), (0, 12, 25, 26)]
  ranks = np.argsort(np.argsort(-(z.astype(np.float64) @ p.T.astype(np.float64)) /
                                np.linalg.norm(p, axis=1), axis=1, kind="stable"), axis=1)
  straddle = any(np.any((ranks[:, list(g)].min(1) < k) & (ranks[:, list(g)].max(1) >= k))
                 for g in groups)
  inside = any(np.any(ranks[:, list(g)].max(1) < k) for g in groups)
  assert straddle and inside
  assert_matches(out, ref)


@pytest.mark.parametrize("distance", ["cosine", "sqeuclidean"])
def test_masked_column_statistics_and_min_distances(distance):
  rng = np.random.default_rng(21 if distance == "cosine" else 22)
  z = rng.normal(size=(30, 10)).astype(np.float32)
  p = (rng.normal(size=(23, 10)) * rng.uniform(0.5, 2, size=(23, 1))).astype(np.float32)
  mask = rng.random(30) < 0.6
  mask[0] = False  # make sure a masked token exists
  out = prototype_layer(jnp.asarray(z), jnp.asarray(p), 4, distance=distance,
                        mask_N=jnp.asarray(mask), implementation=IMPL)
  ref = np_reference(z, p, 4, distance=distance, mask=mask)
  unmasked = np_reference(z, p, 4, distance=distance)
  assert not np.allclose(ref["col_max_cos"], unmasked["col_max_cos"])  # the mask matters
  tol = 1e-5 if distance == "cosine" else 2e-4  # |z|²+|p|²-2z·p loses digits in fp32
  for name, field in (("row_max_cos", "row_max_cos_N"), ("col_max_cos", "col_max_cos_K"),
                      ("row_min_dist", "row_min_dist_N"), ("col_min_dist", "col_min_dist_K")):
    np.testing.assert_allclose(np.asarray(getattr(out, field)), ref[name], rtol=tol, atol=tol,
                               err_msg=name)
  # No valid token at all: column maxima are -inf, column minima +inf.
  none = prototype_layer(jnp.asarray(z), jnp.asarray(p), 4, distance=distance,
                         mask_N=jnp.zeros(30, bool), implementation=IMPL)
  assert np.all(np.isneginf(np.asarray(none.col_max_cos_K)))
  assert np.all(np.isposinf(np.asarray(none.col_min_dist_K)))


def np_zhat(z, p, idx, mixture="raw"):
  """float64 reconstruction for a FIXED active set (top-k is locally constant)."""
  cos = np.einsum("nd,nkd->nk", z, p[idx]) / np.linalg.norm(z, axis=1)[:, None] / (
      np.linalg.norm(p[idx], axis=2))
  act = np.maximum(cos, 0)
  if mixture == "normalized":
    act = act / np.maximum(act.sum(1, keepdims=True), 1e-6)
  return np.einsum("nk,nkd->nd", act, p[idx])


@pytest.mark.parametrize("mixture", ["raw", "normalized"])
def test_residual_gradient_routing(mixture):
  rng = np.random.default_rng(31)
  n, num_protos, d, k = 4, 12, 14, 3
  z, p = gapped_inputs(rng, n, num_protos, d)
  g = rng.normal(size=(n, d)).astype(np.float32)

  def objective(routing):
    def f(z_, p_):
      out = prototype_layer(z_, p_, k, residual_routing=routing, mixture=mixture,
                            implementation=IMPL)
      return jnp.sum(out.residual_NxD * g)
    return jax.grad(f, argnums=(0, 1))(jnp.asarray(z), jnp.asarray(p))

  gz_st, gp_st = objective("straight_through")
  gz_pl, gp_pl = objective("plain")
  # Straight-through: r = z - sg(z_hat): identity in z, nothing reaches the bank.
  np.testing.assert_array_equal(np.asarray(gz_st), g)
  assert np.all(np.asarray(gp_st) == 0.0)
  # Plain: r = z - z_hat, checked against float64 central differences of the reference.
  z64, p64, g64 = z.astype(np.float64), p.astype(np.float64), g.astype(np.float64)
  idx = np_reference(z, p, k)["idx"]
  fd_eps = 1e-6

  def fd(x, which):
    grad = np.zeros_like(x)
    for pos in np.ndindex(x.shape):
      hi, lo = x.copy(), x.copy()
      hi[pos] += fd_eps
      lo[pos] -= fd_eps
      args_hi = (hi, p64) if which == "z" else (z64, hi)
      args_lo = (lo, p64) if which == "z" else (z64, lo)
      f_hi = np.sum((args_hi[0] - np_zhat(*args_hi, idx, mixture)) * g64)
      f_lo = np.sum((args_lo[0] - np_zhat(*args_lo, idx, mixture)) * g64)
      grad[pos] = (f_hi - f_lo) / (2 * fd_eps)
    return grad

  np.testing.assert_allclose(np.asarray(gz_pl), fd(z64, "z"), atol=2e-4, rtol=1e-3)
  np.testing.assert_allclose(np.asarray(gp_pl), fd(p64, "p"), atol=2e-4, rtol=1e-3)
  used = np.zeros(num_protos, bool)
  used[idx.ravel()] = True
  assert np.all(np.abs(np.asarray(gp_pl))[used].sum(1) > 0)
  assert np.all(np.asarray(gp_pl)[~used] == 0.0)
  # Values agree whatever the routing.
  for routing in ("straight_through", "plain"):
    out = prototype_layer(jnp.asarray(z), jnp.asarray(p), k, residual_routing=routing,
                          mixture=mixture, implementation=IMPL)
    np.testing.assert_allclose(np.asarray(out.residual_NxD),
                               z64 - np_zhat(z64, p64, idx, mixture), atol=2e-5)


def test_bf16_inputs_give_fp32_outputs():
  rng = np.random.default_rng(41)
  z, p = gapped_inputs(rng, 8, 20, 24)
  out = prototype_layer(jnp.asarray(z, jnp.bfloat16), jnp.asarray(p, jnp.bfloat16), 4,
                        implementation=IMPL)
  ref = np_reference(np.asarray(jnp.asarray(z, jnp.bfloat16), np.float64),
                     np.asarray(jnp.asarray(p, jnp.bfloat16), np.float64), 4)
  assert out.z_hat_NxD.dtype == jnp.float32 and out.residual_NxD.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(out.z_hat_NxD), ref["z_hat"], atol=1e-4)


def test_bank_module_wraps_the_function():
  rng = np.random.default_rng(51)
  bank = PrototypeBank(19, 6, 4, rngs=nnx.Rngs(params=3), mixture="normalized",
                       distance="sqeuclidean", implementation=IMPL)
  assert bank.protos[...].shape == (19, 6)
  z = jnp.asarray(rng.normal(size=(11, 6)), jnp.float32)
  mask = jnp.asarray(rng.random(11) < 0.5)
  got = bank(z, mask)
  want = prototype_layer(z, bank.protos[...], 4, mixture="normalized", distance="sqeuclidean",
                         mask_N=mask, implementation=IMPL)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(ValueError, match="k must be"):
    PrototypeBank(4, 6, 5, rngs=nnx.Rngs(params=0))


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(k=38), ValueError, "k must be an int in \\[1, K=37\\]"),
    (dict(k=0), ValueError, "k must be an int"),
    (dict(k=2.0), ValueError, "k must be an int"),
    (dict(k=True), ValueError, "k must be an int"),
    (dict(protos_shape=(37, 9)), ValueError, "feature sizes differ: z has D=8, protos has D=9"),
    (dict(z_shape=(2, 3, 8)), ValueError, "expects z of shape \\(N, D\\)"),
    (dict(z_dtype=np.int32), TypeError, "z must be a floating dtype, got int32"),
    (dict(protos_dtype=np.int32), TypeError, "protos must be a floating dtype"),
    (dict(residual_routing="stright"), ValueError, "residual_routing='stright'"),
    (dict(mixture="softmax"), ValueError, "mixture='softmax'"),
    (dict(distance="l1"), ValueError, "distance='l1'"),
    (dict(implementation="cuda"), ValueError, "implementation='cuda'"),
    (dict(mask_N=np.ones(6, bool)), ValueError, "mask must have shape \\(N,\\)=\\(5,\\)"),
    (dict(mask_N=np.ones((5, 1), bool)), ValueError, "mask must have shape"),
])
def test_bad_inputs_raise_clear_errors(kwargs, exc, match):
  rng = np.random.default_rng(61)
  kwargs = dict(kwargs)
  z = rng.normal(size=kwargs.pop("z_shape", (5, 8))).astype(kwargs.pop("z_dtype", np.float32))
  p = rng.normal(size=kwargs.pop("protos_shape", (37, 8))).astype(
      kwargs.pop("protos_dtype", np.float32))
  k = kwargs.pop("k", 3)
  if "mask_N" in kwargs:
    kwargs["mask_N"] = jnp.asarray(kwargs["mask_N"])
  with pytest.raises(exc, match=match):
    prototype_layer(jnp.asarray(z), jnp.asarray(p), k, **kwargs)


def test_extremum_statistics_give_ties_to_the_lowest_id():
  """Row/column extrema of exactly tied entries send their whole gradient to the lowest
  prototype / token id (as lax.top_k and the Pallas kernels do), not an even split."""
  from prism_jax.model.prototypes import topk_reconstruct_xla  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(19)
  p = rng.standard_normal((6, 5)).astype(np.float32)
  p[4] = p[1]  # prototypes 1 and 4 tie for every token
  z = rng.standard_normal((7, 5)).astype(np.float32)
  # Tokens 1 and 5 are equal and close to prototype 1 (= 4): the same row maximum, tied
  # between prototypes 1 and 4, and tied with each other for those columns' maxima.
  z[1] = z[5] = p[1] + 0.1 * rng.standard_normal(5).astype(np.float32)
  z, p = jnp.asarray(z), jnp.asarray(p)
  for distance, out_id in (("cosine", 4), ("cosine", 5), ("sqeuclidean", 6), ("sqeuclidean", 7)):
    g_p, g_z = jax.grad(lambda p, z: jnp.sum(topk_reconstruct_xla(
        z, p, 2, distance=distance)[out_id]), (0, 1))(p, z)
    g_p, g_z = np.asarray(g_p), np.asarray(g_z)
    if out_id in (4, 6):  # row statistics: tokens 1 and 5 tie between prototypes 1 and 4
      assert np.all(g_p[4] == 0.0) and np.any(g_p[1] != 0.0)
    else:  # column statistics of prototypes 1 and 4: tokens 1 and 5 tie
      assert np.all(g_z[5] == 0.0) and np.any(g_z[1] != 0.0)
