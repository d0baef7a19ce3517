"""A PRISM run in the layout models are shared in on the Hugging Face Hub, and back.

`export_hub(workdir, out)` writes a directory ready to upload as a Hub model repository:

  config.json              the backbone's transformers config (GPT2LMHeadModel or
                           LlamaForCausalLM / Qwen2ForCausalLM), plus "prism_jax": the run's
                           whole Config (transformers keeps unknown keys as attributes)
  model.safetensors        the backbone in transformers' layout: `from_pretrained` loads
                           the dense model (its logits W z are the PRISM model's)
  prism_head.safetensors   the bank ("bank.protos", K x D) and any head parameter
  prism_tokenizer.json     the run's tokenizer as prism_jax saves it (any kind); a BPE's
                           tokenizer.json and tokenizer_config.json beside it for transformers
  cards/                   the prototype cards, when the run has them
  README.md                the model card: YAML metadata (library_name: prism_jax, base_model
                           of a retrofit, tags), then the shape, val and faithfulness figures

`load_hub(path)` reads such a directory (or a Hugging Face cache snapshot of one) back into
(model, Config, tokenizer), bit for bit; `resolve("hf://org/name")` is that repository's
snapshot, fetched through huggingface_hub (from the local cache when HF_HUB_OFFLINE=1).
Anything missing or wrong is one HFFormatError naming it.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import jax
import numpy as np
from flax import nnx

from prism_jax import loading, paths
from prism_jax.config import config_from_dict, to_dict
from prism_jax.data import tokenizers as tok_lib
from prism_jax.hf import convert, hf_dir, hub_card
from prism_jax.hf.gpt2_config import HFFormatError
from prism_jax.model.lm import build_model

HEAD_FILE = "prism_head.safetensors"
TOKENIZER_FILE = "prism_tokenizer.json"
CONFIG_KEY = "prism_jax"
REQUIRED = (hf_dir.CONFIG_FILE, hf_dir.WEIGHTS_FILE, TOKENIZER_FILE)
SCHEME = "hf://"


def is_hub_dir(path: str) -> bool:
  """Whether `path` is a directory export_hub wrote (its config.json names prism_jax)."""
  try:
    with open(os.path.join(path, hf_dir.CONFIG_FILE), encoding="utf-8") as f:
      return CONFIG_KEY in json.load(f)
  except (OSError, ValueError, TypeError):
    return False


def _flat(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
  out = {}
  for key, value in tree.items():
    name = f"{prefix}{key}"
    if isinstance(value, dict):
      out.update(_flat(value, name + "."))
    else:
      out[name] = np.array(value, np.float32, order="C")  # (ascontiguousarray makes 0-d 1-d)
  return out


def _nest(flat: dict[str, np.ndarray]) -> dict:
  tree: dict = {}
  for name, value in flat.items():
    node = tree
    *parents, leaf = name.split(".")
    for key in parents:
      node = node.setdefault(key, {})
    node[leaf] = value
  return tree


def export_hub(workdir: str, out: str, step: int | None = None) -> str:
  """Writes `out` (new or empty) from the run's newest (or given) checkpoint; returns it."""
  out = convert._check_empty(out, "--out")  # pylint: disable=protected-access
  hf_out = os.path.join(out, ".transformers")
  convert.export_hf(workdir, hf_out, step)  # the backbone, its checks and tokenizer files
  for name in os.listdir(hf_out):
    if name != "README.md":
      shutil.move(os.path.join(hf_out, name), os.path.join(out, name))
  shutil.rmtree(hf_out)
  _, params, cfg, step = loading.load_params(workdir, step=step)
  head = {k: v for k, v in jax.device_get(params).items() if k != "backbone"}
  if head:
    _safetensors_save(_flat(head), os.path.join(out, HEAD_FILE))
  with open(os.path.join(out, hf_dir.CONFIG_FILE), encoding="utf-8") as f:
    hf_cfg = json.load(f)
  hf_cfg[CONFIG_KEY] = to_dict(cfg)
  with open(os.path.join(out, hf_dir.CONFIG_FILE), "w", encoding="utf-8") as f:
    json.dump(hf_cfg, f, indent=2, sort_keys=True)
  tokenizer = loading.load_tokenizer(workdir, cfg)
  shutil.copy(tokenizer.save(os.path.join(out, ".tok")), os.path.join(out, TOKENIZER_FILE))
  shutil.rmtree(os.path.join(out, ".tok"))
  cards = paths.join(workdir, "cards")
  if paths.path(cards).is_dir():
    shutil.copytree(cards, os.path.join(out, "cards"))
  paths.write_text_atomic(os.path.join(out, "README.md"),
                          hub_card.model_card(workdir, cfg, step, hf_cfg["architectures"][0]))
  return out


def _safetensors_save(tensors: dict[str, np.ndarray], path: str) -> None:
  hf_dir._safetensors().numpy.save_file(tensors, path, metadata={"format": "np"})  # pylint: disable=protected-access


def _read_head(path: str) -> dict:
  st = hf_dir._safetensors()  # pylint: disable=protected-access
  try:
    return _nest(st.numpy.load_file(os.path.join(path, HEAD_FILE)))
  except (st.SafetensorError, OSError, ValueError) as e:
    raise HFFormatError(f"{os.path.join(path, HEAD_FILE)} is not a readable safetensors "
                        f"file: {e}") from e


def load_hub(path: str) -> tuple[Any, Any, Any]:
  """(model, Config, tokenizer) of a directory export_hub wrote, checked file by file."""
  missing = [n for n in REQUIRED if not os.path.isfile(os.path.join(path, n))]
  if missing:
    raise HFFormatError(f"{path} is not a prism_jax Hub directory: it lacks "
                        f"{', '.join(missing)}")
  hf_cfg = hf_dir.read_config(path)
  if CONFIG_KEY not in hf_cfg:
    raise HFFormatError(f"{path}/config.json has no {CONFIG_KEY!r} entry: a plain "
                        "transformers model; import it with `prism import-hf`")
  try:
    cfg = config_from_dict(hf_cfg[CONFIG_KEY])
  except (ValueError, TypeError) as e:
    raise HFFormatError(f"{path}/config.json's {CONFIG_KEY!r} entry: {e}") from e
  _, weights_lib = convert.FAMILIES[cfg.model.arch]
  backbone = weights_lib.backbone_params(hf_dir.read_weights(path), cfg.model)
  params = nnx.to_pure_dict(nnx.state(build_model(cfg.model), nnx.Param))
  head_path = os.path.join(path, HEAD_FILE)
  head = _read_head(path) if os.path.isfile(head_path) else {}
  want_head = {k: v for k, v in params.items() if k != "backbone"}
  if want_head and not head:
    raise HFFormatError(f"{path} lacks {HEAD_FILE}: the prototype bank of this "
                        f"{cfg.model.kind} model")
  loaded = {"backbone": backbone, **head}
  convert._check_same_tree(params, loaded)  # pylint: disable=protected-access
  model = build_model(cfg.model)
  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state, jax.tree.map(jax.numpy.asarray, loaded))
  nnx.update(model, state)
  return model, cfg, tok_lib.load_tokenizer(os.path.join(path, TOKENIZER_FILE))


def resolve(path: str) -> str:
  """A local path as given; "hf://org/name[@revision]": its snapshot directory (downloaded
  through huggingface_hub, or read from its cache when HF_HUB_OFFLINE=1)."""
  if not path.startswith(SCHEME):
    return path
  repo, _, revision = path[len(SCHEME):].partition("@")
  try:
    import huggingface_hub  # pylint: disable=g-import-not-at-top  (deferred: optional, the hf extra)
  except ImportError:
    raise ModuleNotFoundError("hf:// paths need huggingface_hub: pip install "
                              "'prism_jax[hf]'") from None
  try:
    return huggingface_hub.snapshot_download(repo, revision=revision or None)
  except Exception as e:  # pylint: disable=broad-except
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    why = ("it is not in the local Hugging Face cache and HF_HUB_OFFLINE is set" if offline
           else f"{type(e).__name__}: {' '.join(str(e).split())[:200]}")
    raise HFFormatError(f"{path}: cannot open {repo}: {why}") from None
