"""Evaluation metrics (val loss, perplexity, R̄1, R̄2, residual share, dead prototypes) of
`prism_jax.train.evaluate` on an 8-device mesh vs a float64 NumPy brute force."""

import jax
import numpy as np
from flax import nnx

from prism_jax.config import preset
from prism_jax.train import apply_overrides, create_train_state, evaluate

SETS = ["model.d_model=16", "model.n_layers=1", "model.n_heads=2", "model.num_prototypes=256",
        "model.k=3", "model.vocab_size=40", "model.max_len=8", "model.proto_init=normal",
        "data.seq_len=8", "train.batch_size=8"]


class FakeLoader:
  """Batch contract stand-in: fixed random val batches (the last one partly padded)."""

  def __init__(self, cfg, num_batches, seed=0):
    rng = np.random.default_rng(seed)
    shape = (cfg.train.batch_size, cfg.data.seq_len)
    self.batches = []
    for i in range(num_batches):
      mask = rng.random(shape) > 0.2
      if i == num_batches - 1:
        mask[-3:] = False  # padding rows
      self.batches.append({"inputs": rng.integers(0, cfg.model.vocab_size, shape, np.int32),
                           "targets": rng.integers(0, cfg.model.vocab_size, shape, np.int32),
                           "mask": mask})
    self.num_batches = num_batches

  def batch_at(self, i):
    return self.batches[i]


def _reference(model, batches, k):
  protos = np.asarray(model.bank.protos[...], np.float64)
  wte = np.asarray(model.backbone.wte[...], np.float64)
  nll, rows, cols, sq_r, sq_z = [], [], np.full(len(protos), -np.inf), 0.0, 0.0
  usage = np.zeros(len(protos), int)
  for b in batches:
    z, _ = model.backbone(b["inputs"])
    z = np.asarray(z, np.float64).reshape(-1, protos.shape[1])
    m = b["mask"].reshape(-1)
    logits = z @ wte.T  # = W (r + z_hat) in value
    logp = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1,
                                                                         keepdims=True))
    logp -= logits.max(1, keepdims=True)
    nll += list(-logp[np.arange(len(z)), b["targets"].reshape(-1)][m])
    cos = (z / np.linalg.norm(z, axis=1, keepdims=True)) @ (
        protos / np.linalg.norm(protos, axis=1, keepdims=True)).T
    rows += list(cos.max(1)[m])
    cols = np.maximum(cols, cos[m].max(0))
    top = np.argsort(-cos, axis=1, kind="stable")[:, :k]
    act = np.maximum(np.take_along_axis(cos, top, 1), 0.0)
    if model.cfg.mixture == "normalized":
      act = act / np.maximum(act.sum(1, keepdims=True), 1e-6)
    z_hat = np.einsum("nk,nkd->nd", act, protos[top])
    sq_r += np.sum(((z - z_hat) ** 2).sum(1)[m])
    sq_z += np.sum((z ** 2).sum(1)[m])
    np.add.at(usage, top[m][act[m] > 0], 1)
  ce = float(np.mean(nll))
  return {"loss": ce, "perplexity": np.exp(ce), "r1_bar": cols.mean(),
          "r2_bar": float(np.mean(rows)), "residual_share": sq_r / sq_z,
          "dead_prototypes": float(np.sum(usage == 0)), "tokens": float(len(nll))}


def test_evaluate_matches_numpy_brute_force():
  cfg = apply_overrides(preset("tiny"), SETS)
  graphdef, state, _ = create_train_state(cfg)
  loader = FakeLoader(cfg, num_batches=2)
  got = evaluate(graphdef, state.params, cfg, loader)
  model = nnx.merge(graphdef, jax.device_get(state.params))
  want = _reference(model, loader.batches, cfg.model.k)
  assert 0 < want["dead_prototypes"] < cfg.model.num_prototypes  # a non-trivial case
  for key, value in want.items():
    np.testing.assert_allclose(got[key], value, rtol=2e-4, atol=1e-5, err_msg=key)
