"""prism_jax/model/trust.py: per-token trust against float64 NumPy, exact ties included.

Logits are fresh random draws rounded to a coarse grid (so exact ties at the top occur in
both the full and the prototype-path logits); the reference orders ties by the lower token
id, as documented.
"""

import secrets

import numpy as np
import pytest

from prism_jax.model.trust import carriers_N, prediction_trust, token_trust, trust_label


def _reference(full, proto):
  full, proto = np.asarray(full, np.float64), np.asarray(proto, np.float64)
  n, v = full.shape
  order = np.lexsort((np.broadcast_to(np.arange(v), (n, v)), -full), axis=-1)  # value desc, id asc
  top1, runner = order[:, 0], order[:, 1]
  proto_top1 = np.array([min(np.flatnonzero(row == row.max())) for row in proto])
  rows = np.arange(n)
  margin = full[rows, top1] - full[rows, runner]
  with np.errstate(invalid="ignore", divide="ignore"):
    share = np.where(margin > 0, (proto[rows, top1] - proto[rows, runner]) / margin, np.nan)
  return top1, runner, proto_top1, proto_top1 == top1, margin, share


@pytest.mark.parametrize("grid", [0.25, 1e-3])
def test_token_trust_matches_float64_numpy_with_ties(grid):
  seed = secrets.randbits(32)
  rng = np.random.default_rng(seed)
  n, v = 400, 37
  full = np.round(rng.normal(0, 2, (n, v)) / grid) * grid
  proto = np.round(rng.normal(0, 2, (n, v)) / grid) * grid
  full[:20, 5] = full[:20, 11] = full[:20].max(-1) + 1.0  # exact ties at the top
  proto[20:40, 3] = proto[20:40, 30] = proto[20:40].max(-1) + 1.0
  proto[40:80] = full[40:80]  # the prototypes carry everything: agrees, share 1
  full, proto = full.astype(np.float32), proto.astype(np.float32)
  got = token_trust(full, proto)
  want = _reference(full, proto)
  msg = f"seed {seed}"
  for name, g, w in zip(("top1", "runner_up", "proto_top1", "agrees"), got[:4], want[:4]):
    np.testing.assert_array_equal(np.asarray(g), w, err_msg=f"{name} {msg}")
  np.testing.assert_allclose(np.asarray(got.margin_N), want[4], rtol=1e-6, atol=1e-6,
                             err_msg=msg)
  np.testing.assert_allclose(np.asarray(got.proto_share_N), want[5], rtol=1e-4, atol=1e-5,
                             err_msg=msg)
  assert np.isnan(np.asarray(got.proto_share_N)[:20]).all()  # a tie has no lead to share
  assert (np.asarray(got.top1_N)[:20] == 5).all() and (np.asarray(got.runner_up_N)[:20] == 11).all()
  same = np.asarray(got.proto_share_N)[40:80]  # the prototypes carry everything: share 1
  lead = np.asarray(got.margin_N)[40:80] > 0  # (unless the top two logits tie: nan)
  np.testing.assert_allclose(same[lead], 1.0, rtol=1e-6)
  assert np.isnan(same[~lead]).all()
  assert np.asarray(got.agrees_N)[40:80].all()
  assert 0 < np.asarray(got.agrees_N).mean() < 1  # both marks occur


def test_carriers_against_brute_force():
  seed = secrets.randbits(32)
  rng = np.random.default_rng(seed)
  contrib = rng.normal(0, 1, (300, 8)) * (rng.random((300, 8)) < 0.7)
  contrib[0] = 0.0
  got = carriers_N(contrib, 0.9)
  for t, row in enumerate(contrib):
    total = np.abs(row).sum()
    want = 0 if total == 0 else next(
        m for m in range(1, 9) if np.sort(np.abs(row))[::-1][:m].sum() >= 0.9 * total - 1e-12)
    assert got[t] == want, f"seed {seed} token {t}"


def test_prediction_trust_reads_the_forward_at_the_position_before():
  from prism_jax.config import model_preset  # pylint: disable=import-outside-toplevel
  from prism_jax.model.lm import build_model  # pylint: disable=import-outside-toplevel
  from prism_jax.model.trust import output_trust  # pylint: disable=import-outside-toplevel
  cfg = model_preset("tiny", vocab_size=50, max_len=16, d_model=32, n_layers=1, n_heads=2,
                     num_prototypes=12, k=3, init_std=0.3)
  model = build_model(cfg, seed=secrets.randbits(16))
  tokens = np.random.default_rng(secrets.randbits(32)).integers(0, 50, 10)
  whole = output_trust(model, model(tokens[None, :9]))
  got = prediction_trust(model, tokens, [1, 4, 9])
  np.testing.assert_array_equal(got.top1_N, np.asarray(whole.top1_N)[[0, 3, 8]])
  np.testing.assert_array_equal(got.agrees_N, np.asarray(whole.agrees_N)[[0, 3, 8]])
  with pytest.raises(ValueError, match="positions must lie in"):
    prediction_trust(model, tokens, [0])


def test_trust_label():
  assert trust_label(False, 0.3) == "residual"
  assert trust_label(True, 0.874) == "proto 87%"
  assert trust_label(True, float("nan")) == "proto"
