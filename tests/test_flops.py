"""Analytic parameter/FLOP counts against real NNX models and hand-derived GPT-2 numbers."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from prism_jax import flops
from prism_jax.config import ModelConfig, model_preset
from prism_jax.model import build_model


def count_nnx_params(model) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize("overrides", [
    dict(), dict(d_model=24, n_heads=3, mlp_ratio=2, n_layers=3, num_prototypes=29),
    dict(vocab_size=101, max_len=9, n_layers=1, num_prototypes=7, k=7),
    dict(arch="llama", bias=False, n_heads=4, n_kv_heads=2, mlp_dim=40),
    dict(arch="llama", bias=False, n_heads=4, n_kv_heads=1, qkv_bias=True,
         tie_embeddings=False, mlp_dim=21)])
def test_param_counts_match_real_models(overrides):
  base = dict(vocab_size=67, max_len=12, d_model=16, n_layers=2, n_heads=2,
              num_prototypes=13, k=3)
  cfg = ModelConfig(**{**base, **overrides})
  counts = flops.param_counts(cfg)
  prism = count_nnx_params(nnx.eval_shape(lambda: build_model(cfg)))
  dense = count_nnx_params(nnx.eval_shape(lambda: build_model(
      dataclasses.replace(cfg, kind="dense"))))
  assert counts["dense"] == dense and counts["prism"] == prism
  assert counts["prototypes"] == prism - dense == cfg.num_prototypes * cfg.d_model
  assert counts["overhead_pct"] == pytest.approx(100 * (prism - dense) / dense)


def test_gpt2_small_and_xl_counts():
  small = flops.param_counts(model_preset("small"))
  assert small["dense"] == 124_439_808  # GPT-2 124M with tied head
  assert small["non_embedding"] == 85_056_000  # Kaplan's N for GPT-2 small (incl. ln_f)
  xl = flops.param_counts(model_preset("xl"))
  assert xl["dense"] == 1_557_611_200  # GPT-2 1.5B (1558M)
  assert round(xl["overhead_pct"], 1) == 1.7


def test_flops_per_token_formula():
  cfg = model_preset("small")
  t = 1024
  f = flops.flops_per_token(cfg, t)
  d, v, layers = 768, 50257, 12
  assert f["attention_fwd"] == layers * 4 * t * d
  assert f["lm_head_fwd"] == 2 * d * v
  assert f["backbone_fwd"] == 2 * 12 * layers * d * d + layers * 4 * t * d + 2 * d * v
  assert f["proto_similarity"] == 2 * d * 8192
  assert f["proto_reconstruction"] == 2 * 16 * d
  assert f["proto_fwd"] == (2 * d * 8192 + 3 * d + 2 * 8192 + 8192 + 2 * 16 * d + 2 * d)
  assert f["fwd"] == f["backbone_fwd"] + f["proto_fwd"] and f["train"] == 3 * f["fwd"]
  # The matmul part is 2 x (non-embedding weight matrices + tied head): the "6N" rule.
  weights = 12 * layers * d * d + d * v
  assert f["backbone_fwd"] - f["attention_fwd"] == 2 * weights
  dense = flops.flops_per_token(dataclasses.replace(cfg, kind="dense"), t)
  assert dense["proto_fwd"] == 0 and dense["fwd"] == dense["backbone_fwd"] == f["backbone_fwd"]
  with pytest.raises(ValueError, match="seq_len must be positive"):
    flops.flops_per_token(cfg, 0)


@pytest.mark.parametrize("kind,peak", [
    ("TPU v4", 275e12), ("TPU v5 lite", 197e12), ("TPU v5e", 197e12), ("TPU v5", 459e12),
    ("TPU v5p", 459e12), ("TPU v6 lite", 918e12), ("TPU v6e", 918e12),
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H200", 989e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("cpu", None), ("TPU v3", None), ("", None)])
def test_device_peak_flops(kind, peak):
  assert flops.device_peak_flops(kind) == peak


def test_mfu():
  assert flops.device_peak_flops(jax.devices()[0]) is None  # CPU: no invented peak
  assert flops.mfu(1000.0, 1e9) is None
  assert flops.mfu(2e5, 6e9, num_devices=4, peak_flops_per_device=1e15) == pytest.approx(0.3)
