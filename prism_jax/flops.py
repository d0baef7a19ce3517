"""Analytic parameter counts, FLOPs per token, device peaks and MFU.

Parameters (D d_model, F = mlp_ratio·D, L layers, V vocab, P max_len, K prototypes):

  per layer   = 2 LayerNorms (4D) + qkv (3D² + 3D) + attn out (D² + D)
                + MLP (D·F + F + F·D + D)                  = 4D² + 2DF + 9D + F
                (model.bias=False: no biases, LayerNorm scales only = 4D² + 2DF + 2D)
  dense       = V·D (tied wte / LM head) + P·D (wpe) + L·per_layer + 2D (ln_f; D unbiased)
  prototypes  = K·D;   prism = dense + K·D;   overhead % = 100·K·D / dense

model.arch=llama (G = n_kv_heads·Dh, the key/value width; F = the MLP width):

  per layer   = 2 RMSNorm scales (2D) + q (D²) + k|v (2DG) + o (D²) + SwiGLU (3DF)
                [+ q/k/v biases D + 2G with model.qkv_bias]   = 2D² + 2DG + 3DF + 2D
  dense       = V·D (embedding) [+ V·D untied LM head] + L·per_layer + D (final norm)

FLOPs per token of a forward pass at sequence length T (one multiply-add = 2 FLOPs; the
usual "2 x matmul params" count, as in Kaplan et al. 2020 / PaLM's MFU appendix):

  backbone    = L · [2·(4D² + 2DF)          dense matmuls of qkv, attn out, MLP
                                            (llama: 2·(2D² + 2DG + 3DF))
                     + 2·2·T·D]             attention scores QKᵀ and probs·V (full T, no
                                            causal halving, the PaLM convention)
                + 2·D·V                     LM head
  proto head  = 2·D·K                       similarity z·Pᵀ (the N×K matrix, once)
                + 3·D + 2·K                 ‖z‖ and the cosine scaling of the K dots
                + K                         top-k selection (one comparison per candidate)
                + 2·k·D                     reconstruction ẑ = Σ a_i p_i
                + 2·D                       residual r = z − ẑ and head input r + ẑ
                + 2·D·V                     only when the loss needs W ẑ
                                            (loss.needs_proto_logits: λ_proto, λ_proto_kl,
                                            λ_rlogit; issue 11): the prototype path's head
  forward     = backbone (+ proto head for PRISM);   train = 3 × forward

The similarity's backward is counted as 2 × its forward (the dense N×K×D matmuls of the
objective as written), though the kernels and "xla_sparse" take it through the N·k active
pairs and the extrema only; the count is the paper's objective, not a lower bound.

Embedding lookups, LayerNorms, softmax, biases and the once-per-batch ‖p_i‖ are left out:
they are O(D) or amortised per token and below 0.1% at every preset.
"""

from __future__ import annotations

from typing import Any

import jax

from prism_jax.config import LossConfig, ModelConfig

# Dense (non-sparse) bf16 peak FLOP/s per jax device (a TPU v4+ chip or one GPU).
PEAK_BF16_FLOPS: dict[str, float] = {
    "TPU v4": 275e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v6e": 918e12,
    "H100": 989e12,  # SXM; the PCIe card is listed separately
    "H100 PCIe": 756e12,
    "H200": 989e12,
    "A100": 312e12,
}

# jax `device_kind` spellings (lower-cased substrings) -> table key; first match wins.
_KIND_PATTERNS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("tpu v5 lite",), "TPU v5e"),
    (("tpu v5e",), "TPU v5e"),
    (("tpu v6 lite",), "TPU v6e"),
    (("tpu v6e",), "TPU v6e"),
    (("tpu v5p",), "TPU v5p"),
    (("h100", "pcie"), "H100 PCIe"),
    (("h100",), "H100"),
    (("h200",), "H200"),
    (("a100",), "A100"),
)


def device_peak_flops(device: Any) -> float | None:
  """Dense bf16 peak FLOP/s of a jax Device (or its `device_kind` string); None if unknown.

  Unknown kinds (CPU, older or unlisted accelerators) give None so MFU is never invented.
  """
  kind = device if isinstance(device, str) else getattr(device, "device_kind", "")
  kind = " ".join(str(kind).lower().split())
  for needles, key in _KIND_PATTERNS:
    if all(n in kind for n in needles):
      return PEAK_BF16_FLOPS[key]
  if kind in ("tpu v5", "tpu v5p"):  # v5p chips report plain "TPU v5"
    return PEAK_BF16_FLOPS["TPU v5p"]
  if kind == "tpu v4":
    return PEAK_BF16_FLOPS["TPU v4"]
  return None


def param_counts(cfg: ModelConfig) -> dict[str, float]:
  """Analytic parameter counts of `DenseLM` / `PrismLM` for `cfg` (see module docstring);
  the library's backbones only (a registered one: count its nnx.state instead)."""
  if cfg.arch not in ("gpt2", "llama"):
    raise ValueError(f"model.arch={cfg.arch!r} is a registered backbone: its parameters are "
                     "counted from the model (nnx.state), not analytically")
  d, f, layers = cfg.d_model, cfg.d_mlp, cfg.n_layers
  if cfg.arch == "llama":
    g = cfg.kv_heads * cfg.head_dim
    per_layer = 2 * d * d + 2 * d * g + 3 * d * f + 2 * d + (d + 2 * g if cfg.qkv_bias else 0)
    embeddings = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)
    dense = embeddings + layers * per_layer + d
  else:
    biases = 7 * d + f if cfg.bias else 0  # 2 LayerNorm biases, qkv, attn out, MLP fc, proj
    per_layer = 4 * d * d + 2 * d * f + 2 * d + biases
    embeddings = cfg.vocab_size * d + cfg.max_len * d
    dense = embeddings + layers * per_layer + (2 * d if cfg.bias else d)
  prototypes = cfg.num_prototypes * d
  return {
      "dense": dense,
      "non_embedding": dense - embeddings,
      "prototypes": prototypes,
      "prism": dense + prototypes,
      "overhead_pct": 100.0 * prototypes / dense,
  }


def flops_per_token(cfg: ModelConfig, seq_len: int,
                    loss: LossConfig | None = None) -> dict[str, float]:
  """Forward / training FLOPs per token at sequence length `seq_len` (module docstring).

  Keys: backbone_fwd (layers + LM head), of which attention_fwd and lm_head_fwd;
  proto_fwd (0 for dense) with its parts proto_similarity, proto_norms, proto_topk,
  proto_reconstruction, proto_residual, proto_lm_head (W ẑ: when `loss.needs_proto_logits`,
  else 0; None counts no aux head); fwd = backbone_fwd + proto_fwd; train = 3 * fwd.
  """
  if seq_len <= 0:
    raise ValueError(f"seq_len must be positive, got {seq_len}")
  d, f, layers, v = cfg.d_model, cfg.d_mlp, cfg.n_layers, cfg.vocab_size
  num_protos, k = cfg.num_prototypes, cfg.k
  attention = layers * 2 * 2 * seq_len * d
  if cfg.arch == "llama":
    g = cfg.kv_heads * cfg.head_dim
    matmul = layers * 2 * (2 * d * d + 2 * d * g + 3 * d * f)
  elif cfg.arch == "gpt2":
    matmul = layers * 2 * (4 * d * d + 2 * d * f)
  else:  # a user's registered backbone: its layers are unknown here, only the heads count
    matmul = attention = 0
  lm_head = 2 * d * v
  backbone = matmul + attention + lm_head
  parts = {
      "proto_similarity": 2 * d * num_protos,
      "proto_norms": 3 * d + 2 * num_protos,
      "proto_topk": num_protos,
      "proto_reconstruction": 2 * k * d,
      "proto_residual": 2 * d,
      "proto_lm_head": lm_head if loss is not None and loss.needs_proto_logits else 0,
  }
  if cfg.kind == "dense":
    parts = {name: 0 for name in parts}
  proto = sum(parts.values())
  fwd = backbone + proto
  return {"backbone_fwd": backbone, "attention_fwd": attention, "lm_head_fwd": lm_head,
          **parts, "proto_fwd": proto, "fwd": fwd, "train": 3 * fwd}


def mfu(tokens_per_s: float, train_flops_per_token: float, num_devices: int | None = None,
        peak_flops_per_device: float | None = None) -> float | None:
  """Model FLOPs utilisation: achieved training FLOP/s over the devices' dense bf16 peak.

  `tokens_per_s` is the global throughput. Defaults: all `jax.devices()` and their peak from
  `device_peak_flops`; returns None when the peak is unknown (e.g. CPU).
  """
  if num_devices is None:
    num_devices = jax.device_count()
  if peak_flops_per_device is None:
    peak_flops_per_device = device_peak_flops(jax.devices()[0])
  if not peak_flops_per_device:
    return None
  return tokens_per_s * train_flops_per_token / (num_devices * peak_flops_per_device)
