"""The least-squares mixture (model.mixture="nnls", prism_jax/model/nnls.py; issue 53 item 3).

References: scipy.optimize.nnls (Lawson-Hanson in float64) for the weights; float64 central
finite differences for the gradients; jax's forward mode against its reverse mode (what
jax.hessian needs). Then a run trained with the mixture: its decomposition is exact, and the
attribution cache, cards, a Hessian block and a refilled suppression all work on it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.optimize import nnls as scipy_nnls

import prism_jax
from prism_jax.control.suppression import suppressed_logits
from prism_jax.model import nnls
from prism_jax.model.prototypes import IMPLEMENTATIONS, prototype_layer
from prism_jax.train import apply_overrides, train
from prism_jax.config import LossConfig, preset
from test_checkpoint_bad_inputs import SETS, _corpus


def _problem(seed, n=200, k=8, d=24):
  """Random tokens and rows where some optimal weights are 0 and some are not."""
  rng = np.random.default_rng(seed)
  rows = rng.normal(size=(n, k, d))
  z = rng.normal(size=(n, d)) + rng.uniform(0.2, 1.0, (n, 1)) * rows.mean(1)
  return z, rows


def test_weights_equal_scipy_nnls():
  z, rows = _problem(0)
  with jax.enable_x64(True):
    a = np.asarray(nnls.nnls_weights(jnp.asarray(z), jnp.asarray(rows)))
  ref = np.stack([scipy_nnls(r.T, t)[0] for r, t in zip(rows, z)])
  np.testing.assert_allclose(a, ref, atol=1e-10)
  assert (a >= 0).all()
  zero = (ref == 0).sum()
  assert 0 < zero < ref.size  # both kinds of weights occur: the test can fail
  with jax.enable_x64(False):  # float32, the training dtype: within rounding
    a32 = np.asarray(nnls.nnls_weights(jnp.asarray(z, jnp.float32),
                                       jnp.asarray(rows, jnp.float32)))
  np.testing.assert_allclose(a32, ref, atol=2e-4)


@pytest.mark.parametrize("scale", [1.0, 30.0, 300.0])
def test_converges_at_any_prototype_norm_in_float32(scale):
  """Banks set from hidden states have norms far from 1: one tolerance in the units of b
  made an index re-enter and leave every pass, to max_iter, with its weight wrongly 0."""
  rng = np.random.default_rng(8)
  n, k, d = 300, 8, 64
  base = rng.normal(size=(4 * k, d))
  rows = (base[rng.integers(0, 4 * k, size=(n, k))] + 0.3 * rng.normal(size=(n, k, d)))
  rows *= scale / np.sqrt(d)
  z = rows.mean(1) + 0.5 * scale / np.sqrt(d) * rng.normal(size=(n, d))
  G = jnp.einsum("nid,njd->nij", rows, rows).astype(jnp.float32)
  b = jnp.einsum("nid,nd->ni", rows, z).astype(jnp.float32)
  _, iters = nnls.lawson_hanson(G, b)
  assert int(iters) < 3 * k + 4  # every row converged before the cap
  a = np.asarray(nnls.nnls_weights(jnp.asarray(z, jnp.float32), jnp.asarray(rows, jnp.float32)))
  ref = np.stack([scipy_nnls(r.T, t)[0] for r, t in zip(rows, z)])
  np.testing.assert_allclose(a, ref, atol=1e-4 * np.abs(ref).max())


def test_duplicate_prototypes_reach_the_optimum():
  """Two equal rows make the Gram matrix singular: the weights are then not unique, the
  optimum's value is."""
  z, rows = _problem(1, n=50, k=6)
  rows[:, 3] = rows[:, 1]
  with jax.enable_x64(True):
    a = np.asarray(nnls.nnls_weights(jnp.asarray(z), jnp.asarray(rows)))
  got = np.linalg.norm(z - np.einsum("nk,nkd->nd", a, rows), axis=-1)
  ref = np.array([scipy_nnls(r.T, t)[1] for r, t in zip(rows, z)])
  np.testing.assert_allclose(got, ref, rtol=1e-7, atol=1e-9)


@pytest.mark.long  # ~45 s: `make test-long` (make test's 12 minutes)
def test_gradients_match_finite_differences():
  z, rows = _problem(2, n=6, k=5, d=7)
  c = np.random.default_rng(3).normal(size=(6, 5))
  with jax.enable_x64(True):
    f = lambda z_, r_: jnp.sum(jnp.asarray(c) * nnls.nnls_weights(z_, r_))
    gz, gr = jax.grad(f, argnums=(0, 1))(jnp.asarray(z), jnp.asarray(rows))
    eps = 1e-6
    for which, x, g in ((0, z, gz), (1, rows, gr)):
      flat = x.reshape(-1)
      picks = np.random.default_rng(4).choice(flat.size, 25, replace=False)
      for i in picks:
        up, down = flat.copy(), flat.copy()
        up[i] += eps
        down[i] -= eps
        args_up = [z, rows]
        args_down = [z, rows]
        args_up[which], args_down[which] = up.reshape(x.shape), down.reshape(x.shape)
        fd = (float(f(*map(jnp.asarray, args_up))) - float(f(*map(jnp.asarray, args_down)))
              ) / (2 * eps)
        assert abs(fd - float(np.asarray(g).reshape(-1)[i])) < 1e-6 * max(1, abs(fd)), (which, i)
    # forward mode agrees with reverse mode (jax.hessian uses both)
    t = np.random.default_rng(5).normal(size=z.shape)
    _, jvp = jax.jvp(lambda z_: f(z_, jnp.asarray(rows)), (jnp.asarray(z),), (jnp.asarray(t),))
    np.testing.assert_allclose(float(jvp), float(jnp.sum(gz * t)), rtol=1e-9)


@pytest.mark.parametrize("impl", ["xla", "xla_sparse", "pallas_interpret"])
def test_layer_uses_the_same_selection_and_is_exact(impl):
  if impl not in IMPLEMENTATIONS:
    pytest.skip(f"{impl} is not an implementation here")
  rng = np.random.default_rng(6)
  z = jnp.asarray(rng.normal(size=(64, 16)), jnp.float32)
  protos = jnp.asarray(rng.normal(size=(40, 16)), jnp.float32)
  raw = prototype_layer(z, protos, 6, mixture="raw", implementation=impl)
  out = prototype_layer(z, protos, 6, mixture="nnls", implementation=impl,
                        residual_routing="plain")
  np.testing.assert_array_equal(np.asarray(out.idx_Nxk), np.asarray(raw.idx_Nxk))
  rows = np.asarray(protos, np.float64)[np.asarray(out.idx_Nxk)]
  ref = np.stack([scipy_nnls(r.T, t)[0] for r, t in zip(rows, np.asarray(z, np.float64))])
  np.testing.assert_allclose(np.asarray(out.act_Nxk), ref, atol=2e-4)
  np.testing.assert_allclose(np.asarray(out.residual_NxD + out.z_hat_NxD), np.asarray(z),
                             atol=1e-5)
  fit = lambda a: np.linalg.norm(np.asarray(z) - np.einsum("nk,nkd->nd", a, rows), axis=-1)
  assert (fit(np.asarray(out.act_Nxk)) <= fit(np.asarray(raw.act_Nxk)) + 1e-5).all()


@pytest.fixture(scope="module")
def nnls_run(tmp_path_factory):
  root = tmp_path_factory.mktemp("nnls_run")
  cfg = apply_overrides(preset("tiny"), SETS + [f"data.sources={_corpus(root / 'c.txt')}",
                                                "model.mixture=nnls", "train.log_to=",
                                                "data.val_fraction=0.1"])
  train(cfg, str(root / "run"))
  return prism_jax.load(str(root / "run"))


@pytest.mark.long  # ~30-45 s: `make test-long`
def test_a_run_with_the_mixture(nnls_run):
  run = nnls_run
  assert run.config.model.mixture == "nnls"
  text = "the token mesh"
  dec = run.decompose(text)
  assert len(dec.tokens) == len(run.tokenizer.encode(text)) - 1
  ids = jnp.asarray([run.tokenizer.encode(text)])
  out = run.model(ids)
  a = np.asarray(out.protos.act_Nxk, np.float64)
  rows = np.asarray(run.model.bank.protos[...], np.float64)[np.asarray(out.protos.idx_Nxk)]
  z = np.asarray(out.protos.z_hat_NxD + out.protos.residual_NxD, np.float64)
  # exact decomposition: z_hat is the weighted sum of the active rows, W z = W r + sum a W p
  np.testing.assert_allclose(np.einsum("nk,nkd->nd", a, rows),
                             np.asarray(out.protos.z_hat_NxD, np.float64), atol=1e-4)
  wte = np.asarray(run.model.backbone.wte[...], np.float64)
  logits = np.asarray(out.logits_BxTxV[0], np.float64)
  parts = (np.asarray(out.protos.residual_NxD, np.float64) @ wte.T
           + np.einsum("nk,nkv->nv", a, rows @ wte.T))
  np.testing.assert_allclose(parts[:, :logits.shape[1]], logits, atol=2e-3)
  ref = np.stack([scipy_nnls(r.T, t)[0] for r, t in zip(rows, z)])
  np.testing.assert_allclose(a, ref, atol=5e-4 * max(1.0, np.abs(ref).max()))
  att = run.attribute(text, top=3)  # builds the attribution cache on this run
  assert len(att.sequences) == 3
  cards = run.cards
  assert len(cards) == run.config.model.num_prototypes
  i = int(out.protos.idx_Nxk[0, 0])  # a prototype the text uses: a block that is not 0
  block = run.hessian_block(i, i, rows=2, loss_cfg=LossConfig())  # jax.hessian through it
  d = run.config.model.d_model
  assert block.shape == (d, d) and np.isfinite(block).all() and np.abs(block).max() > 0
  np.testing.assert_allclose(block, block.T, atol=1e-9 * np.abs(block).max())
  refilled = suppressed_logits(run.model, out, [int(out.protos.idx_Nxk[0, 0])], refill=True)
  assert refilled.shape == out.logits_BxTxV.shape and np.isfinite(np.asarray(refilled)).all()
