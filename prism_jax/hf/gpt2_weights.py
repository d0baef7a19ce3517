"""GPT-2 safetensors tensors <-> the backbone's parameter dict (NumPy, float32).

Hugging Face's Conv1D stores (in, out) matrices, the layout `x @ w` uses, so kernels need no
transpose; the fused `c_attn` (D, 3D) is (D, 3, H, Dh) here (q | k | v, each split into heads)
and `attn.c_proj` (D, D) is (H, Dh, D). The token embedding is the tied LM head; its rows past
the real vocabulary (model.vocab_used) are zero and never predicted. Names may carry the
`transformer.` prefix (GPT2LMHeadModel) or not (GPT2Model, the original upload); the causal
mask buffers of old uploads (`attn.bias`, `attn.masked_bias`) are not weights.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from prism_jax.config import ModelConfig
from prism_jax.hf.gpt2_config import HFFormatError

PREFIX = "transformer."
BUFFERS = (".attn.bias", ".attn.masked_bias")


def _names(cfg: ModelConfig) -> dict[str, tuple]:
  """HF name (without prefix) -> (path in the params dict, HF shape)."""
  d, f = cfg.d_model, cfg.d_mlp
  out = {"wte.weight": (("wte",), (cfg.num_token_ids, d)),
         "wpe.weight": (("wpe",), (cfg.max_len, d)),
         "ln_f.weight": (("ln_f", "scale"), (d,)), "ln_f.bias": (("ln_f", "bias"), (d,))}
  for i in range(cfg.n_layers):
    blk = ("blocks", i)
    out.update({
        f"h.{i}.ln_1.weight": (blk + ("ln1", "scale"), (d,)),
        f"h.{i}.ln_1.bias": (blk + ("ln1", "bias"), (d,)),
        f"h.{i}.attn.c_attn.weight": (blk + ("attn", "qkv_kernel"), (d, 3 * d)),
        f"h.{i}.attn.c_attn.bias": (blk + ("attn", "qkv_bias"), (3 * d,)),
        f"h.{i}.attn.c_proj.weight": (blk + ("attn", "out_kernel"), (d, d)),
        f"h.{i}.attn.c_proj.bias": (blk + ("attn", "out_bias"), (d,)),
        f"h.{i}.ln_2.weight": (blk + ("ln2", "scale"), (d,)),
        f"h.{i}.ln_2.bias": (blk + ("ln2", "bias"), (d,)),
        f"h.{i}.mlp.c_fc.weight": (blk + ("mlp", "fc_kernel"), (d, f)),
        f"h.{i}.mlp.c_fc.bias": (blk + ("mlp", "fc_bias"), (f,)),
        f"h.{i}.mlp.c_proj.weight": (blk + ("mlp", "proj_kernel"), (f, d)),
        f"h.{i}.mlp.c_proj.bias": (blk + ("mlp", "proj_bias"), (d,)),
    })
  return out


def _ours(name: str, x_hf: np.ndarray, cfg: ModelConfig) -> np.ndarray:
  """One HF tensor in this backbone's layout."""
  h, dh = cfg.n_heads, cfg.head_dim
  if name.endswith("c_attn.weight"):
    return x_hf.reshape(cfg.d_model, 3, h, dh)
  if name.endswith("c_attn.bias"):
    return x_hf.reshape(3, h, dh)
  if name.endswith("attn.c_proj.weight"):
    return x_hf.reshape(h, dh, cfg.d_model)
  if name == "wte.weight" and cfg.vocab_size > cfg.num_token_ids:
    pad = np.zeros((cfg.vocab_size - cfg.num_token_ids, cfg.d_model), x_hf.dtype)
    return np.concatenate([x_hf, pad])
  return x_hf


def backbone_params(tensors: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, Any]:
  """The backbone's params dict (nested, float32) from a GPT-2 checkpoint's tensors."""
  plain = {}
  for name, x in tensors.items():
    plain[name[len(PREFIX):] if name.startswith(PREFIX) else name] = x
  head = plain.pop("lm_head.weight", None)
  names = _names(cfg)
  missing = [n for n in names if n not in plain]
  if missing:
    raise HFFormatError(f"missing weight {missing[0]}" + (
        f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
  extra = sorted(n for n in plain if n not in names and not n.endswith(BUFFERS))
  if extra:
    raise HFFormatError(f"unexpected weight {extra[0]}: not part of GPT-2 with "
                        f"n_layer={cfg.n_layers}")
  for name, (_, shape) in names.items():
    if tuple(plain[name].shape) != shape:
      raise HFFormatError(f"weight {name} has shape {tuple(plain[name].shape)}, expected "
                          f"{shape} from config.json")
  if head is not None and not np.array_equal(np.asarray(head), np.asarray(plain["wte.weight"])):
    raise HFFormatError("lm_head.weight differs from wte.weight: an untied LM head is not "
                        "supported (GPT-2 ties them)")
  params: dict[str, Any] = {}
  for name, (path, _) in names.items():
    node = params
    for key in path[:-1]:
      node = node.setdefault(key, {})
    x = np.asarray(plain[name])
    if not np.issubdtype(x.dtype, np.floating):
      raise HFFormatError(f"weight {name} has dtype {x.dtype}, expected a float")
    node[path[-1]] = _ours(name, x.astype(np.float32), cfg)
  return params


def hf_tensors(backbone: dict[str, Any], cfg: ModelConfig) -> dict[str, np.ndarray]:
  """GPT2LMHeadModel's safetensors dict (`transformer.` names, float32, contiguous) from
  the backbone's params; the padding rows of the embedding are dropped."""
  out = {}
  for name, (path, shape) in _names(cfg).items():
    x = backbone
    for key in path:
      x = x[key]
    x = np.asarray(x, np.float32)
    if name == "wte.weight":
      x = x[:cfg.num_token_ids]
    out[PREFIX + name] = np.ascontiguousarray(x.reshape(shape))
  return out
