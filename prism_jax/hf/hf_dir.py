"""Reading and writing a Hugging Face model directory (GPT-2 or the Llama family): `config.json`, `model.safetensors`
(read and written with the `safetensors` package, no torch) and the tokenizer files
(`tokenizer.json`, or GPT-2's original `vocab.json` + `merges.txt`)."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from prism_jax.data.tokenizers import BpeTokenizer
from prism_jax.hf.gpt2_config import HFFormatError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def is_hf_dir(path: str) -> bool:
  """Whether `path` looks like a Hugging Face model directory (a config.json with a
  model_type), as opposed to a prism_jax run directory."""
  try:
    with open(os.path.join(path, CONFIG_FILE), encoding="utf-8") as f:
      return "model_type" in json.load(f)
  except (OSError, ValueError, TypeError):
    return False


def read_config(hf_dir: str) -> dict[str, Any]:
  path = os.path.join(hf_dir, CONFIG_FILE)
  if not os.path.isdir(hf_dir):
    raise HFFormatError(f"{hf_dir} is not a directory")
  if not os.path.isfile(path):
    raise HFFormatError(f"{hf_dir} has no {CONFIG_FILE}: not a Hugging Face model directory")
  try:
    with open(path, encoding="utf-8") as f:
      cfg = json.load(f)
  except ValueError as e:
    raise HFFormatError(f"{path} is not valid JSON: {e}") from e
  if not isinstance(cfg, dict) or "model_type" not in cfg:
    raise HFFormatError(f"{path} has no model_type: not a Hugging Face model config")
  return cfg


def _safetensors():
  """The safetensors package, or one clear error naming the `hf` extra."""
  try:
    import safetensors  # pylint: disable=g-import-not-at-top  (deferred: optional, the hf extra)
    import safetensors.numpy  # pylint: disable=g-import-not-at-top,unused-import  # noqa: F401  (deferred: optional, the hf extra)
  except ImportError:
    raise ModuleNotFoundError("Hugging Face directories need the hf extra: pip install "
                      "'prism_jax[hf]'") from None
  return safetensors


def read_weights(hf_dir: str) -> dict[str, np.ndarray]:
  """Every tensor of `model.safetensors` as a NumPy array."""
  st = _safetensors()
  SafetensorError, load_file = st.SafetensorError, st.numpy.load_file  # pylint: disable=invalid-name
  path = os.path.join(hf_dir, WEIGHTS_FILE)
  if not os.path.isfile(path):
    others = [n for n in ("pytorch_model.bin", "model.safetensors.index.json", "tf_model.h5")
              if os.path.exists(os.path.join(hf_dir, n))]
    hint = (f" (it has {', '.join(others)}: save it with safe_serialization=True as one "
            f"{WEIGHTS_FILE})" if others else "")
    raise HFFormatError(f"{hf_dir} has no {WEIGHTS_FILE}{hint}")
  try:
    return load_file(path)
  except (SafetensorError, OSError, ValueError) as e:
    raise HFFormatError(f"{path} is not a readable safetensors file: {e}") from e


def read_tokenizer(hf_dir: str):
  """The directory's tokenizer as a prism_jax BpeTokenizer (kind "gpt2")."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # pylint: disable=g-import-not-at-top  (deferred: tokenizers, only for the directory's tokenizer)
  tok_json = os.path.join(hf_dir, "tokenizer.json")
  vocab, merges = os.path.join(hf_dir, "vocab.json"), os.path.join(hf_dir, "merges.txt")
  try:
    if os.path.isfile(tok_json):
      tok = Tokenizer.from_file(tok_json)
    elif os.path.isfile(vocab) and os.path.isfile(merges):
      tok = Tokenizer(models.BPE.from_file(vocab, merges))
      tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
      tok.decoder = decoders.ByteLevel()
      tok.add_special_tokens(["<|endoftext|>"])
    else:
      raise HFFormatError(f"{hf_dir} has no tokenizer files (tokenizer.json, or vocab.json "
                          "+ merges.txt)")
    return BpeTokenizer(tok, "gpt2")
  except HFFormatError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    which = tok_json if os.path.isfile(tok_json) else f"{vocab} + {merges}"
    why = " ".join(str(e).split())[:200] or type(e).__name__
    raise HFFormatError(f"{which}: not a valid tokenizer file ({why})") from e


def write_dir(out: str, config: dict[str, Any], tensors: dict[str, np.ndarray], tokenizer,
              readme: str) -> None:
  """Writes config.json, model.safetensors, README.md and the tokenizer files (a BPE's;
  none for tokenizer=None) into `out`."""
  save_file = _safetensors().numpy.save_file
  with open(os.path.join(out, CONFIG_FILE), "w", encoding="utf-8") as f:
    json.dump(config, f, indent=2, sort_keys=True)
  save_file(tensors, os.path.join(out, WEIGHTS_FILE), metadata={"format": "pt"})
  with open(os.path.join(out, "README.md"), "w", encoding="utf-8") as f:
    f.write(readme)
  if tokenizer is None:
    return
  tokenizer.hf_tokenizer.save(os.path.join(out, "tokenizer.json"))
  eos = tokenizer.decode([tokenizer.eos_id], skip_special=False)
  with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    gpt2 = config["model_type"] == "gpt2"
    json.dump({"tokenizer_class": "GPT2Tokenizer" if gpt2 else "PreTrainedTokenizerFast",
               "bos_token": eos, "eos_token": eos, "unk_token": eos, "add_prefix_space": False,
               "model_max_length": config["n_positions" if gpt2 else "max_position_embeddings"]},
              f, indent=2)
