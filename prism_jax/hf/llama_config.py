"""Llama-family `config.json` (model_type llama, qwen2, mistral) <-> ModelConfig (arch llama).

The backbone computes what LlamaForCausalLM computes: RMSNorm, rotary positions (θ, and
Llama 3's frequency scaling), SwiGLU with silu, grouped-query attention scaled by 1/√Dh,
tied or untied head; Qwen2 adds q/k/v biases. A field asking for anything else (another
rope type, biases on o_proj or the MLP, a head dim other than D/H, sliding-window
attention narrower than the model's length, another activation) is refused by name
(HFFormatError), never dropped. Both the current (`rope_parameters`) and the older
(`rope_theta` + `rope_scaling`) rope fields are read. model.max_len is the checkpoint's
max_position_embeddings capped at MAX_LEN (Llama 3's 131072 would size every KV cache);
pass max_len= to choose. Dropout probabilities are training settings, not the function.
"""

from __future__ import annotations

from typing import Any

from prism_jax.config import ModelConfig
from prism_jax.hf.gpt2_config import HFFormatError, padded_vocab

MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "mistral": "MistralForCausalLM"}
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "max_position_embeddings")
MAX_LEN = 4096
ROPE_TYPES = ("default", "llama3")


def _rope(hf: dict[str, Any]) -> dict[str, Any]:
  """ModelConfig's rope fields from either generation of config.json's rope fields."""
  params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
  theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
  kind = params.get("rope_type", params.get("type", "default"))
  if kind not in ROPE_TYPES:
    raise HFFormatError(f"rope_type={kind!r} is not supported (this backbone implements "
                        f"{', '.join(ROPE_TYPES)})")
  if params.get("partial_rotary_factor", 1.0) != 1.0:
    raise HFFormatError(f"partial_rotary_factor={params['partial_rotary_factor']!r} is not "
                        "supported (the whole head dim rotates)")
  out = {"rope_theta": theta}
  if kind == "llama3":
    out.update(rope_scaling_factor=float(params["factor"]),
               rope_low_freq_factor=float(params["low_freq_factor"]),
               rope_high_freq_factor=float(params["high_freq_factor"]),
               rope_original_max_len=int(params["original_max_position_embeddings"]))
  return out


def _refuse_unsupported(hf: dict[str, Any], model_type: str, max_len: int) -> None:
  checks = [
      ("hidden_act", hf.get("hidden_act", "silu") == "silu", "silu"),
      ("mlp_bias", not hf.get("mlp_bias", False), "false"),
      ("attention_bias", model_type == "qwen2" or not hf.get("attention_bias", False),
       "false (biases on q, k, v and o; Qwen2's q/k/v biases are supported)"),
      ("use_sliding_window", not hf.get("use_sliding_window", False), "false"),
      ("sliding_window", model_type == "qwen2" or hf.get("sliding_window") is None
       or hf["sliding_window"] >= max_len,
       f"null or >= the model's length {max_len} (sliding-window attention is not "
       "implemented; with max_len <= the window it is full attention)"),
      ("layer_types", set(hf.get("layer_types") or ["full_attention"]) == {"full_attention"},
       "full_attention for every layer"),
  ]
  for field, ok, want in checks:
    if not ok:
      raise HFFormatError(f"config field {field}={hf.get(field)!r} is not supported "
                          f"(this backbone implements {want})")
  d, heads = hf["hidden_size"], hf["num_attention_heads"]
  if d % heads or hf.get("head_dim") not in (None, d // heads):
    raise HFFormatError(f"head_dim={hf.get('head_dim')!r} with hidden_size={d}, "
                        f"num_attention_heads={heads}: the head dim must be "
                        "hidden_size / num_attention_heads")


def model_config(hf: dict[str, Any], kind: str = "dense", **overrides: Any) -> ModelConfig:
  """The ModelConfig computing the checkpoint's function (`overrides`: prototype-head
  fields for kind="prism", or max_len)."""
  model_type = hf.get("model_type")
  if model_type not in MODEL_TYPES:
    raise HFFormatError(f"model_type={model_type!r} is not a supported Llama-family model "
                        f"({', '.join(MODEL_TYPES)})")
  archs = [a for a in hf.get("architectures") or [] if a != MODEL_TYPES[model_type]]
  if archs:
    raise HFFormatError(f"architectures={archs}: only {MODEL_TYPES[model_type]} is "
                        f"supported for model_type {model_type!r}")
  missing = [k for k in REQUIRED if not isinstance(hf.get(k), int)]
  if missing:
    raise HFFormatError(f"config.json lacks the integer field(s) {', '.join(missing)}")
  max_len = int(overrides.pop("max_len", min(hf["max_position_embeddings"], MAX_LEN)))
  _refuse_unsupported(hf, model_type, max_len)
  vocab = hf["vocab_size"]
  padded = padded_vocab(vocab)
  fields = dict(kind=kind, arch="llama", vocab_size=padded,
                vocab_used=vocab if padded != vocab else 0, max_len=max_len,
                d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
                n_heads=hf["num_attention_heads"],
                n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
                mlp_dim=hf["intermediate_size"], qkv_bias=model_type == "qwen2",
                norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)), bias=False,
                dropout=0.0, init_std=float(hf.get("initializer_range", 0.02)), **_rope(hf))
  fields.update(overrides)
  return ModelConfig(**fields)


def hf_config(cfg: ModelConfig, eos_id: int | None = None) -> dict[str, Any]:
  """The `config.json` of the checkpoint computing `cfg`'s backbone: Qwen2ForCausalLM when
  it has q/k/v biases, else LlamaForCausalLM."""
  model_type = "qwen2" if cfg.qkv_bias else "llama"
  rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
  if cfg.rope_scaling_factor:
    rope.update(rope_type="llama3", factor=float(cfg.rope_scaling_factor),
                low_freq_factor=float(cfg.rope_low_freq_factor),
                high_freq_factor=float(cfg.rope_high_freq_factor),
                original_max_position_embeddings=int(cfg.rope_original_max_len))
  out = {
      "architectures": [MODEL_TYPES[model_type]], "model_type": model_type,
      "vocab_size": cfg.num_token_ids, "hidden_size": cfg.d_model,
      "intermediate_size": cfg.d_mlp, "num_hidden_layers": cfg.n_layers,
      "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads,
      "head_dim": cfg.head_dim, "hidden_act": "silu",
      "max_position_embeddings": cfg.max_len, "rms_norm_eps": float(cfg.norm_eps),
      "rope_parameters": rope, "tie_word_embeddings": bool(cfg.tie_embeddings),
      "attention_dropout": cfg.dropout, "initializer_range": cfg.init_std,
      "use_cache": True, "torch_dtype": "float32",
  }
  if model_type == "llama":
    out.update(attention_bias=False, mlp_bias=False)
  else:
    out.update(use_sliding_window=False, sliding_window=None)
  if eos_id is not None:
    out.update(bos_token_id=int(eos_id), eos_token_id=int(eos_id))
  return out
