"""Hugging Face GPT-2 `config.json` <-> ModelConfig.

The backbone computes what GPT-2 computes: learned positions, pre-LN blocks, tanh GELU
("gelu_new"), LayerNorm eps 1e-5, attention scaled by 1/sqrt(Dh), MLP width 4·D, biases
everywhere, the LM head tied to the token embedding. A field whose value asks for anything
else is refused by name (HFFormatError), never silently dropped. The vocabulary is padded to
a multiple of VOCAB_MULTIPLE (GPT-2's 50257 -> 50304); model.vocab_used keeps the real count,
so the padding rows are never predicted. Dropout probabilities are training settings, not
part of the function: an import computes without dropout.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from prism_jax.config import BACKBONE_FIELDS, ModelConfig

VOCAB_MULTIPLE = 128
LN_EPS = 1e-5
# Values the backbone implements; any other value of these fields is refused.
SUPPORTED = {
    "activation_function": ("gelu_new", "gelu_pytorch_tanh"),  # the same tanh GELU
    "layer_norm_epsilon": (LN_EPS,),
    "scale_attn_weights": (True,),
    "scale_attn_by_inverse_layer_idx": (False,),
    "reorder_and_upcast_attn": (False,),
    "add_cross_attention": (False,),
    "tie_word_embeddings": (True,),
    "is_encoder_decoder": (False,),
}
ARCHITECTURES = ("GPT2LMHeadModel", "GPT2Model")
REQUIRED = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")


class HFFormatError(ValueError):
  """A directory or file that is not a GPT-2 checkpoint this backbone can compute."""


def padded_vocab(vocab: int) -> int:
  return int(math.ceil(vocab / VOCAB_MULTIPLE) * VOCAB_MULTIPLE)


def model_config(hf: dict[str, Any], kind: str = "dense", **overrides: Any) -> ModelConfig:
  """The ModelConfig computing the checkpoint's function (`overrides`: prototype-head fields
  for kind="prism", e.g. num_prototypes, k)."""
  if hf.get("model_type") != "gpt2":
    raise HFFormatError(f"model_type={hf.get('model_type')!r}: not a GPT-2 checkpoint "
                        "(only model_type 'gpt2' is supported)")
  archs = [a for a in hf.get("architectures") or [] if a not in ARCHITECTURES]
  if archs:
    raise HFFormatError(f"architectures={archs}: only {', '.join(ARCHITECTURES)} are supported")
  missing = [k for k in REQUIRED if not isinstance(hf.get(k), int)]
  if missing:
    raise HFFormatError(f"config.json lacks the integer field(s) {', '.join(missing)}")
  for field, allowed in SUPPORTED.items():
    if field in hf and hf[field] not in allowed:
      raise HFFormatError(f"config field {field}={hf[field]!r} is not supported (this "
                          f"backbone implements {field} in {list(allowed)})")
  d = hf["n_embd"]
  if hf.get("n_inner") not in (None, 4 * d):
    raise HFFormatError(f"config field n_inner={hf['n_inner']!r} is not supported (the MLP "
                        f"width is 4*n_embd={4 * d})")
  if d % hf["n_head"]:
    raise HFFormatError(f"n_embd={d} is not divisible by n_head={hf['n_head']}")
  vocab = hf["vocab_size"]
  padded = padded_vocab(vocab)
  fields = dict(kind=kind, vocab_size=padded, vocab_used=vocab if padded != vocab else 0,
                max_len=hf["n_positions"], d_model=d, n_layers=hf["n_layer"],
                n_heads=hf["n_head"], mlp_ratio=4, bias=True, dropout=0.0,
                init_std=float(hf.get("initializer_range", 0.02)))
  fields.update(overrides)
  return ModelConfig(**fields)


def hf_config(cfg: ModelConfig, eos_id: int | None = None) -> dict[str, Any]:
  """The `config.json` of GPT2LMHeadModel computing `cfg`'s backbone (+ the tied head)."""
  if not cfg.bias:
    raise HFFormatError("model.bias=False has no GPT-2 equivalent (GPT-2 has every bias)")
  if cfg.mlp_ratio != 4:
    raise HFFormatError(f"model.mlp_ratio={cfg.mlp_ratio}: GPT-2's MLP is 4*d wide "
                        "(config n_inner would need a model whose n_inner = mlp_ratio*d)")
  out = {
      "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
      "vocab_size": cfg.num_token_ids, "n_positions": cfg.max_len, "n_embd": cfg.d_model,
      "n_layer": cfg.n_layers, "n_head": cfg.n_heads, "n_inner": None,
      "activation_function": "gelu_new", "layer_norm_epsilon": LN_EPS,
      "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
      "initializer_range": cfg.init_std, "scale_attn_weights": True,
      "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
      "tie_word_embeddings": True, "use_cache": True, "torch_dtype": "float32",
  }
  if eos_id is not None:
    out.update(bos_token_id=int(eos_id), eos_token_id=int(eos_id))
  return out


def backbone_fields(cfg: ModelConfig) -> dict[str, Any]:
  """The ModelConfig fields that shape the backbone's parameters and function."""
  return {k: v for k, v in dataclasses.asdict(cfg).items() if k in BACKBONE_FIELDS}
