"""EK-FAC: probe capture vs the real model's autodiff; factors, eigenvalue correction, damping
and scores vs a float64 NumPy implementation of the same math (kronfluence conventions)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from prism_jax.attribution.hessians import ekfac
from prism_jax.attribution.hessians import ekfac_capture
from prism_jax.config import ModelConfig
from prism_jax.model.lm import build_model
from prism_jax.model.tap import Tap

CFG = ModelConfig(vocab_size=32, max_len=8, d_model=8, n_layers=1, n_heads=2, mlp_ratio=2,
                  num_prototypes=12, k=3)


def _random_model(seed, kind="prism"):
  model = build_model(dataclasses.replace(CFG, kind=kind), seed)
  state = nnx.state(model, nnx.Param)
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(seed + 100), len(leaves))
  # Fresh non-trivial values everywhere (LN scales/biases and linear biases too).
  leaves = [l + 0.3 * jax.random.normal(k_, l.shape, l.dtype) for l, k_ in zip(leaves, keys)]
  nnx.update(model, jax.tree.unflatten(treedef, leaves))
  return model


def _batch(seed, batch=5, seq=8, two_docs=True):
  rng = np.random.default_rng(seed)
  tok = rng.integers(0, CFG.vocab_size, (batch, seq + 1)).astype(np.int32)
  mask = rng.random((batch, seq)) > 0.15
  ex = np.repeat(np.arange(batch)[:, None] + 10 * seed, seq, 1).astype(np.int32)
  if two_docs:  # row 0 holds the end of doc A and the start of doc B; B continues in row 1
    ex[0, seq // 2:] = ex[1, 0]
  return dict(inputs=tok[:, :-1], targets=tok[:, 1:], mask=mask, example_id=ex,
              offset=np.zeros_like(ex), row_id=np.arange(batch, dtype=np.int32))


def test_forward_and_capture_match_real_model():
  model = _random_model(0)
  b = _batch(1)
  out = model(jnp.asarray(b["inputs"]))
  names = ekfac.layer_names(model)
  tap = Tap(ekfac_capture._probes(CFG, names, *b["inputs"].shape, jnp.float32))
  logits = model(jnp.asarray(b["inputs"]), tap=tap).logits_BxTxV  # zero probes
  np.testing.assert_allclose(logits, out.logits_BxTxV, rtol=1e-5, atol=1e-5)
  assert sorted(tap.inputs) == sorted(names)

  # Σ_t δ aᵀ per row == nnx.grad of the real model's summed CE of that row.
  cap = ekfac.capture(model, names, b)
  grads = ekfac.per_sequence_grads(cap)

  def row_loss(m, row):
    lg = m(jnp.asarray(b["inputs"][row:row + 1])).logits_BxTxV
    return ekfac_capture._summed_ce(lg, jnp.asarray(b["targets"][row:row + 1]),
                                    jnp.asarray(b["mask"][row:row + 1], jnp.float32))

  d = CFG.d_model
  for row in (3,):
    g = nnx.jit(nnx.grad(row_loss), static_argnums=1)(model, row)
    blk = g.backbone.blocks[0]
    ref_fc = np.concatenate([np.asarray(blk.mlp.fc_kernel[...]),
                             np.asarray(blk.mlp.fc_bias[...])[None]], 0).T
    ref_qkv = np.concatenate([np.asarray(blk.attn.qkv_kernel[...]).reshape(d, -1),
                              np.asarray(blk.attn.qkv_bias[...]).reshape(1, -1)], 0).T
    np.testing.assert_allclose(grads["block0.mlp_fc"][0, row], ref_fc, rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(grads["block0.qkv"][0, row], ref_qkv, rtol=2e-4, atol=2e-5)


def _numpy_ekfac_scores(cap_fit, masks, cap_q, cap_t, seg_w, damping=None, reals=None):
  """Float64 NumPy EK-FAC from captured (a, δ): factors, Λ, damping, precondition, score.
  A sums over the loss tokens (`masks`), S over the non-padding positions (`reals`,
  kronfluence's convention; None: the loss tokens too, the old convention)."""
  names = list(cap_fit[0].acts)
  reals = masks if reals is None else reals
  total = 0.0
  for n in names:
    cov_a, cov_s, ntok, nseq = 0.0, 0.0, 0, 0
    for cap, m, r in zip(cap_fit, masks, reals):
      a = np.asarray(cap.acts[n], np.float64)[m]
      dl = np.asarray(cap.deltas[n][0], np.float64)[r]
      cov_a = cov_a + a.T @ a
      cov_s = cov_s + dl.T @ dl
      ntok += int(m.sum())
    _, qa = np.linalg.eigh(cov_a / ntok)
    _, qs = np.linalg.eigh(cov_s / ntok)
    lam = 0.0
    for cap in cap_fit:
      a = np.asarray(cap.acts[n], np.float64)
      dl = np.asarray(cap.deltas[n][0], np.float64)
      for b in range(a.shape[0]):
        g = dl[b].T @ a[b]
        lam = lam + (qs.T @ g @ qa) ** 2
        nseq += 1
    lam = lam / nseq
    lam_d = lam + (0.1 * lam.mean() if damping is None else damping)
    aq, dq = np.asarray(cap_q.acts[n]), np.asarray(cap_q.deltas[n][0])
    at, dt = np.asarray(cap_t.acts[n]), np.asarray(cap_t.deltas[n])
    pre = [qs @ ((qs.T @ (dq[q].T @ aq[q]) @ qa) / lam_d) @ qa.T for q in range(aq.shape[0])]
    gt = [[dt[s, b].T @ at[b] for b in range(at.shape[0])] for s in range(dt.shape[0])]
    total = total + np.array([[[np.sum(pq * gt[s][b]) for b in range(at.shape[0])]
                               for s in range(dt.shape[0])] for pq in pre])
  return total  # (Q, S, B)


def _per_document(ref_QxSxB, w, seg_ids):
  """Aggregates the reference per document (segments sharing an example id are summed)."""
  ref_ids = np.unique(seg_ids[seg_ids >= 0])
  ref_doc = np.stack([sum(ref_QxSxB[:, s, b] for s in range(w.shape[0])
                          for b in range(w.shape[1]) if seg_ids[s, b] == e)
                      for e in ref_ids], 1)
  return ref_ids, ref_doc


@pytest.mark.parametrize("damping", [None, 0.05])
def test_ekfac_scores_match_float64_numpy(damping):
  with jax.enable_x64(True):
    model = _random_model(2)
    cfg = ekfac.EkfacConfig(damping=damping, empirical_fisher=True)
    fit = [_batch(3, batch=4), _batch(4, batch=4)]
    train = _batch(6, batch=4)
    query = train  # rows 2 and 3 hold whole documents: their self-influence must be > 0
    factors = ekfac.fit_factors(model, fit, cfg, dtype=jnp.float64)
    scores, ids = ekfac.ekfac_scores(model, factors, query, [train], cfg=cfg,
                                     query_batch_size=2, dtype=jnp.float64)

    p = ekfac.split_model(model, jnp.float64)
    names = ekfac.layer_names(model)
    assert "bank" in names and len(names) == 4 * CFG.n_layers + 1
    caps = [ekfac.capture(p, names, b) for b in fit]
    cap_q = ekfac.capture(p, names, query)
    w, seg_ids = ekfac.segment_weights(train, by_example=True)
    cap_t = ekfac.capture(p, names, train, None, w)
    ref = _numpy_ekfac_scores(caps, [b["mask"] for b in fit], cap_q, cap_t, w, damping,
                              reals=[b["example_id"] >= 0 for b in fit])
  ref_ids, ref_doc = _per_document(ref, w, seg_ids)
  np.testing.assert_array_equal(ids, ref_ids)
  assert w.shape[0] == 2 and len(ids) == train["inputs"].shape[0]  # row 0 holds two docs
  err = np.max(np.abs(scores - ref_doc)) / np.max(np.abs(ref_doc))
  assert err <= 1e-6, err
  # Kronfluence sign (no minus): a row's influence on itself, g^T H^-1 g, is positive.
  for row in (2, 3):
    assert scores[row, list(ids).index(train["example_id"][row, 0])] > 0


def test_dense_model_and_bad_query_batch():
  model = _random_model(7, kind="dense")
  assert "bank" not in ekfac.layer_names(model)
  b = _batch(8)
  factors = ekfac.fit_factors(model, [b], ekfac.EkfacConfig(seed=1))
  # No bank: layer-group streaming still equals the whole-model program.
  got, _ = ekfac.ekfac_scores(model, factors, b, [b], train_batch_size=2)
  ref, _ = ekfac.ekfac_scores(model, factors, b, [b], layerwise=False)
  np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.max(np.abs(ref)))
  with pytest.raises(ValueError, match="query_batch_size"):
    ekfac.ekfac_scores(model, factors, b, [b], query_batch_size=0)
  with pytest.raises(ValueError, match="no valid training tokens"):
    ekfac.fit_factors(model, [dict(b, mask=np.zeros_like(b["mask"]))])


@pytest.mark.long  # ~20 s: `make test-long`
def test_streamed_chunked_scores_equal_whole_batch_scores():
  """Layer-group streaming with 1-query chunks and 2-row chunks (the 3-row batch's last one
  padded) == one whole-model program."""
  with jax.enable_x64(True):
    model = _random_model(9)
    cfg = ekfac.EkfacConfig(seed=3)
    train = [_batch(10, batch=3), _batch(11, batch=2)]
    factors = ekfac.fit_factors(model, train, cfg, dtype=jnp.float64)
    query = _batch(12, batch=3, two_docs=False)
    for by_example in (True, False):
      ref, ref_ids = ekfac.ekfac_scores(model, factors, query, train, cfg=cfg,
                                        layerwise=False, by_example=by_example,
                                        dtype=jnp.float64)
      for qbs, tbs in ((1, 2),):  # tbs=2 pads the 3-row batch's last chunk
        got, ids = ekfac.ekfac_scores(model, factors, query, lambda: iter(train), cfg=cfg,
                                      query_batch_size=qbs, train_batch_size=tbs,
                                      by_example=by_example, dtype=jnp.float64)
        np.testing.assert_array_equal(ids, ref_ids)
        assert np.max(np.abs(got - ref)) <= 1e-10 * np.max(np.abs(ref)), (by_example, qbs)
  with pytest.raises(ValueError, match="train_batch_size"):
    ekfac.ekfac_scores(model, factors, query, train, train_batch_size=0)


def _packed_batch(seed, batch=4, seq=8, num_pad=3):
  """Rows cut from one packed token stream (data/packing.py, batch contract): documents
  of random lengths start inside rows (target offset 0: outside the loss, its input the
  previous document's EOS), and the last `num_pad` positions are padding (ids -1)."""
  rng = np.random.default_rng(seed)
  n = batch * seq
  lengths = rng.integers(3, 7, n)
  ex = np.repeat(np.arange(n), lengths)[:n - num_pad] + 100 * seed
  off = np.concatenate([np.arange(l) for l in lengths])[:n - num_pad]
  ex = np.concatenate([ex, np.full(num_pad, -1)]).reshape(batch, seq).astype(np.int32)
  off = np.concatenate([off, np.full(num_pad, -1)]).reshape(batch, seq).astype(np.int32)
  tok = rng.integers(0, CFG.vocab_size, (batch, seq + 1)).astype(np.int32)
  return dict(inputs=tok[:, :-1], targets=tok[:, 1:], mask=off > 0, example_id=ex,
              offset=off, row_id=np.arange(batch, dtype=np.int32))


def test_delta_covariance_covers_non_padding_positions_outside_the_loss():
  """S_l sums δδᵀ over every non-padding position (kronfluence's convention): a document
  start inside a packed row is outside the loss but carries δ from later tokens' losses.
  Scores equal the float64 reference of that convention; the old one (δ masked by the
  loss) differs by far more than the tolerance on these batches."""
  with jax.enable_x64(True):
    model = _random_model(13)
    cfg = ekfac.EkfacConfig(empirical_fisher=True)
    fit = [_packed_batch(14), _packed_batch(15)]
    train, query = _packed_batch(16), _packed_batch(17, num_pad=0)
    factors = ekfac.fit_factors(model, fit, cfg, dtype=jnp.float64)
    scores, ids = ekfac.ekfac_scores(model, factors, query, [train], cfg=cfg,
                                     query_batch_size=2, train_batch_size=2,
                                     dtype=jnp.float64)
    p = ekfac.split_model(model, jnp.float64)
    names = ekfac.layer_names(model)
    caps = [ekfac.capture(p, names, b) for b in fit]
    cap_q = ekfac.capture(p, names, query)
    w, seg_ids = ekfac.segment_weights(train, by_example=True)
    cap_t = ekfac.capture(p, names, train, None, w)
    masks, reals = [b["mask"] for b in fit], [b["example_id"] >= 0 for b in fit]
    new = _numpy_ekfac_scores(caps, masks, cap_q, cap_t, w, reals=reals)
    old = _numpy_ekfac_scores(caps, masks, cap_q, cap_t, w)
  # The batches hold what makes the conventions differ: non-padding no-loss positions
  # with nonzero δ (on qkv: later tokens attend to their keys and values); padding
  # positions (at the end) get no δ at all.
  outside = reals[0] & ~masks[0]
  assert outside.sum() >= 4
  delta = np.abs(np.asarray(caps[0].deltas["block0.qkv"][0])).sum(-1)
  assert np.all(delta[outside] > 0) and np.all(delta[~reals[0]] == 0)
  ref_ids, ref_new = _per_document(new, w, seg_ids)
  _, ref_old = _per_document(old, w, seg_ids)
  np.testing.assert_array_equal(ids, ref_ids)
  scale = np.max(np.abs(ref_new))
  assert np.max(np.abs(scores - ref_new)) / scale <= 1e-6
  gap = np.max(np.abs(ref_old - ref_new)) / scale
  print(f"δ conventions differ by {gap:.2e} of the largest score")  # pytest -s shows it
  assert gap >= 1e-2, gap


def test_fit_factors_needs_example_ids():
  """Without example ids padding cannot be told from positions outside the loss."""
  model = _random_model(18, kind="dense")
  b = {k: v for k, v in _batch(19).items() if k != "example_id"}
  with pytest.raises(ValueError, match="fit_factors needs the batch's example_id"):
    ekfac.fit_factors(model, [b])


@pytest.mark.long  # ~15 s: `make test-long`
def test_parameter_group_scores_partition_the_whole_score():
  """Σ_l is a sum over layers: on a 2-block model, the bank's, the last block's and the
  early block's scores (each restricted by `layers`, layerwise and whole-program) add up
  to the score over every layer; part of a block is refused."""
  two = dataclasses.replace(CFG, n_layers=2)
  with jax.enable_x64(True):
    model = build_model(two, 4)
    train = [_batch(20, batch=3), _batch(21, batch=2)]
    factors = ekfac.fit_factors(model, train, ekfac.EkfacConfig(seed=1), dtype=jnp.float64)
    query = _batch(22, batch=2, two_docs=False)
    score = lambda layers, layerwise=True: ekfac.ekfac_scores(
        model, factors, query, train, layers=layers, layerwise=layerwise,
        dtype=jnp.float64)[0]
    whole = score(None)
    groups = (["bank"], [f"block1.{n}" for n in ekfac.BLOCK_LAYERS],
              [f"block0.{n}" for n in ekfac.BLOCK_LAYERS])
    parts = [score(g) for g in groups]
    assert all(np.abs(p).max() > 1e-6 * np.abs(whole).max() for p in parts)
    np.testing.assert_allclose(sum(parts), whole, rtol=1e-10, atol=1e-12 * np.abs(whole).max())
    np.testing.assert_allclose(score(groups[1], layerwise=False), parts[1], rtol=1e-10)
    with pytest.raises(ValueError, match="whole blocks"):
      score(["block0.qkv"])


def test_cached_group_scores_equal_streamed_ones_without_projection(tmp_path):
  """ekfac_cached with R = 0 (the rows' gradients kept whole) is ekfac[GROUP] exactly: the
  rows' gradients cached once, the query preconditioned, one product (float64)."""
  from prism_jax.attribution.scoring import ekfac_cached  # pylint: disable=g-import-not-at-top
  two = dataclasses.replace(CFG, n_layers=2)
  train = [_batch(30, batch=4, two_docs=False), _batch(31, batch=4, two_docs=False)]
  train[1]["row_id"] = train[1]["row_id"] + 4
  with jax.enable_x64(True):
    model = build_model(two, 6)
    factors = ekfac.fit_factors(model, train, ekfac.EkfacConfig(seed=2), dtype=jnp.float64)
    query = _batch(32, batch=2, two_docs=False)
    layers = ["bank"] + [f"block0.{n}" for n in ekfac.BLOCK_LAYERS]
    want, want_ids = ekfac.ekfac_scores(model, factors, query, train, layers=layers,
                                        by_example=False, dtype=jnp.float64)
    cfg = ekfac_cached.CachedEkfacConfig(tuple(layers), proj_dim=0)
    ids, got = ekfac_cached.cached_ekfac_scores(model, factors, query, train, cfg,
                                                dtype=jnp.float64)
  np.testing.assert_array_equal(ids, want_ids)
  np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12 * np.abs(want).max())

