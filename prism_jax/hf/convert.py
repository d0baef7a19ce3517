"""`import_hf`: a Hugging Face directory (GPT-2, Llama, Qwen2, Mistral) -> a prism_jax run
directory that `load_for_inference` and every command load; `export_hf`: a run -> a
directory that `transformers.AutoModelForCausalLM.from_pretrained` loads (the dense twin,
or a PRISM run's backbone: the prototype head is not part of those architectures). The
family is config.json's model_type on the way in and model.arch on the way out.

An imported run holds `config.json`, a step-0 checkpoint (the weights; zero optimiser
moments), `data/tokenizer.json` (the checkpoint's tokenizer) and `imported_from.json`. A
PRISM import's bank is random, not yet set: train it with `train.init_from` (retrofit).
Everything is read and checked before anything is written, so bad input leaves the target
untouched; the target must be new or empty.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import numpy as np
from flax import nnx

from prism_jax import paths, run_lock
from prism_jax.config import Config, DataConfig, ModelConfig
from prism_jax.data import pretrained
from prism_jax.hf import gpt2_config, gpt2_weights, hf_dir, llama_config, llama_weights
from prism_jax.hf.gpt2_config import HFFormatError
from prism_jax.model.lm import build_model
from prism_jax.train import checkpoint as ckpt_lib
from prism_jax import loading as inference
from prism_jax.train.optimizer import make_optimizer
from prism_jax.train.state import TrainState

IMPORT_NOTE = "imported_from.json"
KINDS = ("dense", "prism")
# model.arch -> (config.json mapping, tensor mapping)
FAMILIES = {"gpt2": (gpt2_config, gpt2_weights), "llama": (llama_config, llama_weights)}


def family_of(hf_cfg: dict[str, Any]) -> str:
  """model.arch of a config.json: gpt2 for model_type gpt2, llama for the Llama family."""
  model_type = hf_cfg.get("model_type")
  if model_type == "gpt2":
    return "gpt2"
  if model_type in llama_config.MODEL_TYPES:
    return "llama"
  raise HFFormatError(f"model_type={model_type!r} is not supported (gpt2, "
                      f"{', '.join(llama_config.MODEL_TYPES)})")


def _check_empty(path: str, what: str) -> str:
  path = os.path.abspath(path)
  if os.path.exists(path) and (not os.path.isdir(path)
                               or set(os.listdir(path)) - {run_lock.LOCK_FILE}):
    raise HFFormatError(f"{what} {path} exists and is not empty; choose a new or empty "
                        "directory")
  return path


def read_hf(hf_dir_path: str, kind: str = "dense", **head: Any):
  """(ModelConfig, backbone params (NumPy), tokenizer) of a Hugging Face directory, checked."""
  if kind not in KINDS:
    raise HFFormatError(f"kind={kind!r}: choose one of {KINDS}")
  hf_cfg = hf_dir.read_config(hf_dir_path)
  config_lib, weights_lib = FAMILIES[family_of(hf_cfg)]
  mcfg = config_lib.model_config(hf_cfg, kind, **head)
  backbone = weights_lib.backbone_params(hf_dir.read_weights(hf_dir_path), mcfg)
  tok = hf_dir.read_tokenizer(hf_dir_path)
  if tok.vocab_size > mcfg.num_token_ids:
    raise HFFormatError(f"the tokenizer has {tok.vocab_size} ids but config.json's "
                        f"vocab_size is {mcfg.num_token_ids}")
  return mcfg, backbone, tok


def model_params(mcfg: ModelConfig, backbone: dict[str, Any], seed: int = 0) -> dict[str, Any]:
  """The full params dict of `mcfg`'s model: `backbone` + a fresh head (PRISM: a random
  bank, the learned mixture scale at 1)."""
  params = nnx.to_pure_dict(nnx.state(build_model(mcfg, seed), nnx.Param))
  _check_same_tree(params["backbone"], backbone)
  params["backbone"] = jax.tree.map(np.asarray, backbone)
  return params


def _check_same_tree(want: Any, got: Any) -> None:
  shapes = lambda t: jax.tree_util.tree_map_with_path(lambda p, x: np.shape(x), t)
  if shapes(want) != shapes(got):
    raise HFFormatError("the converted backbone does not match the model's parameters")


def write_run(workdir: str, cfg: Config, params: dict[str, Any], tokenizer,
              note: dict[str, Any]) -> None:
  """A run directory at step 0 holding `params` (what load_for_inference reads)."""
  tx = make_optimizer(cfg.train)
  params = jax.tree.map(jax.numpy.asarray, params)
  state = TrainState(jax.numpy.zeros((), jax.numpy.int32), params, tx.init(params))
  os.makedirs(workdir, exist_ok=True)
  with run_lock.hold(workdir, "prism import-hf"):
    ckpt_lib.write_config(workdir, cfg)
    tokenizer.save(os.path.join(workdir, "data"))
    ckpt = ckpt_lib.Checkpointer(workdir, keep=1)
    try:
      ckpt.save(0, state, {}, cfg)
      ckpt.wait()
    finally:
      ckpt.close()
    paths.write_text_atomic(os.path.join(workdir, IMPORT_NOTE), json.dumps(note, indent=2))


def import_hf(hf_dir_path: str, workdir: str, kind: str = "dense", **head: Any) -> Config:
  """Imports a Hugging Face directory into a new run directory; returns the run's Config.
  `head`: ModelConfig fields of the prototype head (kind="prism"), e.g. num_prototypes=512
  (and max_len= for a Llama-family model: its length, capped by default)."""
  workdir = _check_empty(workdir, "--workdir")
  mcfg, backbone, tok = read_hf(hf_dir_path, kind, **head)
  data = DataConfig(tokenizer="gpt2" if mcfg.num_token_ids == 50257 else "bpe",
                    seq_len=min(mcfg.max_len, 1024))
  cfg = Config(model=mcfg, data=data)
  weights = os.path.join(hf_dir_path, hf_dir.WEIGHTS_FILE)
  note = {"hf_dir": os.path.abspath(hf_dir_path), "kind": kind,
          "model.safetensors sha256": pretrained.sha256_file(weights),
          "bank": "random, not yet set (train with train.init_from)" if kind == "prism" else None}
  write_run(workdir, cfg, model_params(mcfg, backbone), tok, note)
  return cfg


README = """# {name}

Exported by prism_jax (`prism export-hf`) from the run `{workdir}` (step {step}, model.kind
{kind}). Load it with `transformers.AutoModelForCausalLM.from_pretrained(DIR)` ({arch}) and
`AutoTokenizer.from_pretrained(DIR)`.
{prism_note}"""
PRISM_NOTE = """
This is the PRISM run's backbone with its LM head: its logits W z are the PRISM model's
full logits (PRISM's decomposition W r + sum_i a_i W p_i equals W z exactly). The prototype
head (the bank of {num_prototypes} prototypes, k {k}) is not part of this architecture and
is not exported; load the run with prism_jax for it.
"""

NO_TOKENIZER_NOTE = """
The run's tokenizer is prism_jax's {kind!r} tokenizer, which has no Hugging Face tokenizer
files: none are written (token ids are the run's own).
"""


def export_hf(workdir: str, out: str, step: int | None = None) -> str:
  """Writes `out` (new or empty) from the run's newest (or given) checkpoint; returns it."""
  out = _check_empty(out, "--out")
  _, params, cfg, step = inference.load_params(workdir, step=step)
  # The architecture is the checkpoint's (its digest checked), never config.json's alone:
  # an edited config.json beside unchanged weights would publish a wrong model.
  diffs = ckpt_lib.model_differences(workdir, cfg)
  if diffs:
    raise HFFormatError(
        f"{ckpt_lib.describe_differences(workdir, step, diffs)}: refusing to export; restore "
        "config.json (the checkpoint's config is the one its weights were trained with)")
  mcfg = cfg.model
  config_lib, weights_lib = FAMILIES[mcfg.arch]
  hf_cfg = config_lib.hf_config(mcfg)  # refuses a backbone the family cannot express
  tok = inference.load_tokenizer(workdir, cfg)
  tensors = weights_lib.hf_tensors(jax.device_get(params["backbone"]), mcfg)
  hf_cfg.update(bos_token_id=int(tok.eos_id), eos_token_id=int(tok.eos_id))
  note = (PRISM_NOTE.format(num_prototypes=mcfg.num_prototypes, k=mcfg.k)
          if mcfg.kind == "prism" else "")
  if not hasattr(tok, "hf_tokenizer"):
    tok = None
    note += NO_TOKENIZER_NOTE.format(kind=inference.load_tokenizer(workdir, cfg).kind)
  readme = README.format(name=os.path.basename(out), workdir=os.path.abspath(workdir),
                         step=step, kind=mcfg.kind, arch=hf_cfg["architectures"][0],
                         prism_note=note)
  os.makedirs(out, exist_ok=True)
  hf_dir.write_dir(out, hf_cfg, tensors, tok, readme)
  return out


def head_fields(cfg: ModelConfig) -> dict[str, Any]:
  """The prototype-head fields of a ModelConfig (kept when a backbone is swapped)."""
  skip = set(gpt2_config.backbone_fields(cfg)) | {"kind"}
  return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in skip}
