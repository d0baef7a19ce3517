"""Llama-family safetensors tensors (LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM)
<-> the backbone's parameter dict (NumPy, float32).

torch's Linear stores (out, in) matrices, so every kernel is transposed into the `x @ w`
layout: q_proj (H·Dh, D) -> q_kernel (D, H, Dh); k_proj and v_proj (Hkv·Dh, D) -> the two
halves of kv_kernel (D, 2, Hkv, Dh); o_proj (D, H·Dh) -> out_kernel (H, Dh, D); gate_proj,
up_proj (F, D) -> gate_kernel, fc_kernel (D, F); down_proj (D, F) -> proj_kernel (F, D).
q/k/v biases (Qwen2) follow their kernels. The token embedding and an untied lm_head gain
zero rows past the real vocabulary (model.vocab_used); those rows are never predicted.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from prism_jax.config import ModelConfig
from prism_jax.hf.gpt2_config import HFFormatError

PREFIX = "model."
# Buffers some uploads carry that are not weights.
BUFFERS = (".rotary_emb.inv_freq",)


def _table(cfg: ModelConfig) -> dict[str, tuple]:
  """HF name -> (path in the params dict, slot in that array or None, HF shape)."""
  d, f, h, g, dh, v = (cfg.d_model, cfg.d_mlp, cfg.n_heads, cfg.kv_heads, cfg.head_dim,
                       cfg.num_token_ids)
  out = {PREFIX + "embed_tokens.weight": (("wte",), None, (v, d)),
         PREFIX + "norm.weight": (("ln_f", "scale"), None, (d,))}
  if not cfg.tie_embeddings:
    out["lm_head.weight"] = (("unembed",), None, (v, d))
  for i in range(cfg.n_layers):
    blk, hf = ("blocks", i), f"{PREFIX}layers.{i}."
    out.update({
        hf + "input_layernorm.weight": (blk + ("ln1", "scale"), None, (d,)),
        hf + "post_attention_layernorm.weight": (blk + ("ln2", "scale"), None, (d,)),
        hf + "self_attn.q_proj.weight": (blk + ("attn", "q_kernel"), None, (h * dh, d)),
        hf + "self_attn.k_proj.weight": (blk + ("attn", "kv_kernel"), 0, (g * dh, d)),
        hf + "self_attn.v_proj.weight": (blk + ("attn", "kv_kernel"), 1, (g * dh, d)),
        hf + "self_attn.o_proj.weight": (blk + ("attn", "out_kernel"), None, (d, h * dh)),
        hf + "mlp.gate_proj.weight": (blk + ("mlp", "gate_kernel"), None, (f, d)),
        hf + "mlp.up_proj.weight": (blk + ("mlp", "fc_kernel"), None, (f, d)),
        hf + "mlp.down_proj.weight": (blk + ("mlp", "proj_kernel"), None, (d, f)),
    })
    if cfg.qkv_bias:
      out.update({
          hf + "self_attn.q_proj.bias": (blk + ("attn", "q_bias"), None, (h * dh,)),
          hf + "self_attn.k_proj.bias": (blk + ("attn", "kv_bias"), 0, (g * dh,)),
          hf + "self_attn.v_proj.bias": (blk + ("attn", "kv_bias"), 1, (g * dh,)),
      })
  return out


def _ours(name: str, x: np.ndarray, cfg: ModelConfig) -> np.ndarray:
  """One HF tensor in this backbone's layout (a kv slot: its (D, Hkv, Dh) or (Hkv, Dh))."""
  h, g, dh, d = cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.d_model
  if name.endswith(("embed_tokens.weight", "lm_head.weight")):
    pad = np.zeros((cfg.vocab_size - cfg.num_token_ids, d), x.dtype)
    return np.concatenate([x, pad])
  if x.ndim == 1:  # norm scales; q/k/v biases split into heads
    if name.endswith("q_proj.bias"):
      return x.reshape(h, dh)
    return x.reshape(g, dh) if name.endswith(("k_proj.bias", "v_proj.bias")) else x
  if name.endswith("q_proj.weight"):
    return x.T.reshape(d, h, dh)
  if name.endswith(("k_proj.weight", "v_proj.weight")):
    return x.T.reshape(d, g, dh)
  if name.endswith("o_proj.weight"):
    return x.T.reshape(h, dh, d)
  return x.T  # gate, up, down


def _checked(tensors: dict[str, np.ndarray], table: dict[str, tuple],
             cfg: ModelConfig) -> dict[str, np.ndarray]:
  plain = {n: x for n, x in tensors.items() if not n.endswith(BUFFERS)}
  if cfg.tie_embeddings and "lm_head.weight" in plain:
    if not np.array_equal(plain["lm_head.weight"], plain[PREFIX + "embed_tokens.weight"]):
      raise HFFormatError("lm_head.weight differs from model.embed_tokens.weight but "
                          "config.json says tie_word_embeddings=true")
    plain.pop("lm_head.weight")
  missing = [n for n in table if n not in plain]
  if missing:
    raise HFFormatError(f"missing weight {missing[0]}" + (
        f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
  extra = sorted(n for n in plain if n not in table)
  if extra:
    raise HFFormatError(f"unexpected weight {extra[0]}: not part of this architecture with "
                        f"the config's {cfg.n_layers} layers, biases and head")
  for name, (_, _, shape) in table.items():
    if tuple(plain[name].shape) != shape:
      raise HFFormatError(f"weight {name} has shape {tuple(plain[name].shape)}, expected "
                          f"{shape} from config.json")
    if not np.issubdtype(plain[name].dtype, np.floating):
      raise HFFormatError(f"weight {name} has dtype {plain[name].dtype}, expected a float")
  return plain


def backbone_params(tensors: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, Any]:
  """The backbone's params dict (nested, float32) from a checkpoint's tensors."""
  table = _table(cfg)
  plain = _checked(tensors, table, cfg)
  params: dict[str, Any] = {}
  slots: dict[tuple, list] = {}
  for name, (path, slot, _) in table.items():
    x = _ours(name, np.asarray(plain[name]).astype(np.float32), cfg)
    if slot is not None:
      slots.setdefault(path, [None, None])[slot] = x
      if any(s is None for s in slots[path]):
        continue
      x = np.stack(slots[path], axis=1 if x.ndim == 3 else 0)
    node = params
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = x
  return params


def hf_tensors(backbone: dict[str, Any], cfg: ModelConfig) -> dict[str, np.ndarray]:
  """The checkpoint's safetensors dict (float32, contiguous) from the backbone's params;
  the vocabulary's padding rows are dropped."""
  out = {}
  for name, (path, slot, shape) in _table(cfg).items():
    x = backbone
    for key in path:
      x = x[key]
    x = np.asarray(x, np.float32)
    if slot is not None:
      x = x[:, slot] if x.ndim == 4 else x[slot]
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
      x = x[:cfg.num_token_ids]
    elif name.endswith(".bias"):
      x = x.reshape(-1)
    elif x.ndim >= 2:  # back to torch's (out, in)
      x = x.reshape(-1, x.shape[-1]).T if name.endswith("o_proj.weight") else (
          x.reshape(x.shape[0], -1).T)
    out[name] = np.ascontiguousarray(x.reshape(shape))
  return out
