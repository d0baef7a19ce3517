"""Faithfulness metrics against a float64 NumPy pass over all batches of a real PrismLM."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from prism_jax.config import ModelConfig
from prism_jax.faithfulness import (faithfulness_finalize, faithfulness_init,
                                    faithfulness_merge, faithfulness_update, format_line)
from prism_jax.model import build_model, init_prototypes_from_hidden

CFG = ModelConfig(vocab_size=53, max_len=12, d_model=24, n_layers=1, n_heads=2,
                  num_prototypes=29, k=3, implementation="xla")
B, T = 3, 12


@nnx.jit
def _forward(model, toks, mask):
  out = model(toks, mask_BxT=mask)
  return out.logits_BxTxV, model.proto_path_logits(out.protos, *toks.shape), out.z_BxTxD


def batches(seed, num_batches=3):
  rng = np.random.default_rng(seed)
  out = []
  for i in range(num_batches):
    mask = rng.random((B, T)) < 0.75
    if i == num_batches - 1:
      mask[:] = False  # an all-padding batch changes nothing
    out.append((rng.integers(0, CFG.vocab_size, (B, T)), rng.integers(0, CFG.vocab_size, (B, T)),
                mask))
  return out


def np_reference(model, data):
  """Float64: z from the backbone, z_hat from a brute-force top-k, logits W z, W z_hat, W r."""
  p = np.asarray(model.bank.protos[...], np.float64)
  w = np.asarray(model.backbone.wte[...], np.float64)
  acc = {k: [] for k in ("nll_full", "nll_proto", "agree", "ok_full", "ok_proto", "ok_resid",
                         "c_full", "c_proto", "decisive", "agree_decisive")}
  for toks, targets, mask in data:
    z, _ = model.backbone(jnp.asarray(toks, jnp.int32))
    z = np.asarray(z, np.float64).reshape(-1, p.shape[1])
    m, y = mask.reshape(-1), targets.reshape(-1)
    cos = (z @ p.T) / np.outer(np.linalg.norm(z, axis=1), np.linalg.norm(p, axis=1))
    idx = np.argsort(-cos, axis=1, kind="stable")[:, :model.cfg.k]
    act = np.maximum(np.take_along_axis(cos, idx, 1), 0.0)
    assert model.cfg.mixture == "normalized"
    act /= np.maximum(act.sum(1, keepdims=True), 1e-6)
    z_hat = np.einsum("nk,nkd->nd", act, p[idx])
    full, proto, resid = z @ w.T, z_hat @ w.T, (z - z_hat) @ w.T
    rows = np.arange(len(y))
    for name, logits in (("full", full), ("proto", proto)):
      lse = logits.max(1) + np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1))
      acc[f"nll_{name}"] += list((lse - logits[rows, y])[m])
      acc[f"c_{name}"] += list((logits[rows, y] - logits.mean(1))[m])
    acc["agree"] += list((proto.argmax(1) == full.argmax(1))[m])
    dec = np_decisive(full)
    acc["decisive"] += list(dec[m])
    acc["agree_decisive"] += list((proto.argmax(1) == full.argmax(1))[m & dec])
    for name, logits in (("full", full), ("proto", proto), ("resid", resid)):
      acc[f"ok_{name}"] += list((logits.argmax(1) == y)[m])
  mean = {k: float(np.mean(v)) for k, v in acc.items()}
  share = np.sum(acc["c_proto"]) / np.sum(acc["c_full"])
  return {"full_ce": mean["nll_full"], "proto_ce": mean["nll_proto"],
          "proto_ce_ratio": mean["nll_proto"] / mean["nll_full"], "agreement": mean["agree"],
          "centred_logit": mean["c_full"], "centred_proto_share": share,
          "centred_resid_share": 1.0 - share, "acc_full": mean["ok_full"],
          "acc_proto": mean["ok_proto"], "acc_resid": mean["ok_resid"],
          "decisive_share": mean["decisive"],
          "agreement_decisive": (mean["agree_decisive"] if acc["agree_decisive"]
                                 else float("nan"))}


def np_decisive(logits):
  """Float64: top-1 leads top-2 by >= 1 and its softmax probability is >= 0.5."""
  top = np.sort(logits, axis=1)[:, ::-1]
  p1 = 1.0 / np.exp(logits - top[:, :1]).sum(1)
  return (top[:, 0] - top[:, 1] >= 1.0) & (p1 >= 0.5)


@pytest.mark.parametrize("seed", [0, 1])
def test_streamed_metrics_match_float64_reference(seed):
  model = build_model(CFG, seed=seed)
  data = batches(seed + 10)
  init_prototypes_from_hidden(model, jnp.asarray(data[0][0], jnp.int32), seed=seed)
  update = jax.jit(faithfulness_update)
  state = faithfulness_init()
  for toks, targets, mask in data:
    full, proto, _ = _forward(model, jnp.asarray(toks, jnp.int32), jnp.asarray(mask))
    state = update(state, full.reshape(B * T, -1), proto.reshape(B * T, -1),
                   jnp.asarray(targets.reshape(-1), jnp.int32), jnp.asarray(mask.reshape(-1)))
  got = faithfulness_finalize(state)
  want = np_reference(model, data)
  assert set(got) == set(want)
  assert 0 < want["agreement"] < 1 and want["proto_ce_ratio"] != 1  # a non-trivial case
  for key, value in want.items():
    np.testing.assert_allclose(got[key], value, rtol=2e-5, atol=1e-6, err_msg=key)
  assert "agreement" in format_line(got)


def test_evaluate_logs_the_metrics_on_a_mesh():
  """prism_jax.train.evaluate (8-device mesh, padded batches) reports the same numbers."""
  from prism_jax.config import preset  # pylint: disable=g-import-not-at-top
  from prism_jax.train import apply_overrides, create_train_state, evaluate  # pylint: disable=g-import-not-at-top
  cfg = apply_overrides(preset("tiny"), [
      "model.d_model=16", "model.n_layers=1", "model.n_heads=2", "model.num_prototypes=24",
      "model.k=3", "model.vocab_size=40", "model.max_len=8", "model.proto_init=normal",
      "data.seq_len=8", "train.batch_size=8"])
  rng = np.random.default_rng(7)
  data = [(rng.integers(0, 40, (8, 8)), rng.integers(0, 40, (8, 8)), rng.random((8, 8)) > 0.2)
          for _ in range(2)]

  class Loader:
    num_batches = len(data)

    def batch_at(self, i):
      toks, targets, mask = data[i]
      return {"inputs": toks.astype(np.int32), "targets": targets.astype(np.int32),
              "mask": mask}

  graphdef, state, _ = create_train_state(cfg)
  got = evaluate(graphdef, state.params, cfg, Loader())
  want = np_reference(nnx.merge(graphdef, jax.device_get(state.params)), data)
  for key, value in want.items():
    np.testing.assert_allclose(got[key], value, rtol=2e-4, atol=1e-5, err_msg=key)


def test_merge_equals_one_pass_and_no_tokens_gives_nan():
  rng = np.random.default_rng(3)
  full = jnp.asarray(rng.normal(size=(20, 7)), jnp.float32)
  proto = jnp.asarray(rng.normal(size=(20, 7)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 7, 20), jnp.int32)
  mask = jnp.asarray(rng.random(20) < 0.8)
  one = faithfulness_update(faithfulness_init(), full, proto, y, mask)
  halves = faithfulness_merge(
      faithfulness_update(faithfulness_init(), full[:9], proto[:9], y[:9], mask[:9]),
      faithfulness_update(faithfulness_init(), full[9:], proto[9:], y[9:], mask[9:]))
  for a, b in zip(one, halves):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
  empty = faithfulness_update(faithfulness_init(), full, proto, y, jnp.zeros(20, bool))
  assert all(np.isnan(v) for v in faithfulness_finalize(empty).values())


def test_bad_shapes_are_named():
  x = jnp.zeros((4, 5))
  with pytest.raises(ValueError, match="logits and proto logits must both be"):
    faithfulness_update(faithfulness_init(), x, jnp.zeros((4, 6)), jnp.zeros(4, jnp.int32))
  with pytest.raises(ValueError, match=r"targets must have shape \(N,\)=\(4,\)"):
    faithfulness_update(faithfulness_init(), x, x, jnp.zeros(3, jnp.int32))
  with pytest.raises(ValueError, match=r"mask must have shape \(N,\)=\(4,\)"):
    faithfulness_update(faithfulness_init(), x, x, jnp.zeros(4, jnp.int32), jnp.ones(5, bool))


@pytest.mark.parametrize("pad", [0, 11])
def test_decisive_agreement_and_padding_rows(pad):
  """Fresh random logits spread enough that some tokens are decisive and some are not;
  with `pad` padding columns at PAD_LOGIT (model.vocab_used), every metric is that of the
  unpadded logits: the padding is never an argmax and stays out of the centred mean."""
  from prism_jax.model.ops import PAD_LOGIT  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(pad + 3)
  n, v = 400, 37
  full = rng.normal(size=(n, v)) * rng.uniform(0.2, 4.0, size=(n, 1))
  proto = full + rng.normal(size=(n, v)) * 1.5
  targets, mask = rng.integers(0, v, n), rng.random(n) < 0.8
  want_dec = np_decisive(full)
  assert 0.1 < want_dec[mask].mean() < 0.9  # a non-trivial case
  agree = proto.argmax(1) == full.argmax(1)
  padded = [np.concatenate([x, np.full((n, pad), PAD_LOGIT)], 1) for x in (full, proto)]
  state = faithfulness_update(faithfulness_init(), *(jnp.asarray(x, jnp.float32) for x in padded),
                              jnp.asarray(targets, jnp.int32), jnp.asarray(mask))
  got = faithfulness_finalize(state)
  np.testing.assert_allclose(got["decisive_share"], want_dec[mask].mean(), rtol=1e-6)
  np.testing.assert_allclose(got["agreement_decisive"], agree[mask & want_dec].mean(),
                             rtol=1e-6)
  np.testing.assert_allclose(got["agreement"], agree[mask].mean(), rtol=1e-6)
  rows = np.arange(n)
  centred = (full[rows, targets] - full.mean(1))[mask].mean()
  np.testing.assert_allclose(got["centred_logit"], centred, rtol=1e-4, atol=1e-5)
  assert "decisive tokens" in format_line(got)
