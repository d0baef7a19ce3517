"""Retrofit: a run that starts from a trained backbone (`train.init_from`).

The backbone's parameters come from another run directory: a dense twin, a PRISM run, or a
Hugging Face GPT-2 imported with `prism_jax.hf.import_hf`. The new run keeps its own fresh
head; its bank is then set from the pretrained model's hidden states on the run's data at
`train.proto_init_step` (0: before the first step) by the usual k-means++ init. With
`train.trainable=prototypes` the backbone stays frozen (train/optimizer.py, train/step.py),
so the full logits W z stay the pretrained model's to the bit.

Checked before anything trains: the backbone fields of model.* agree, and the run's
tokenizer maps text to the same ids as the source run's.
"""

from __future__ import annotations

import os
from typing import Any

import jax

from prism_jax import data as data_lib
from prism_jax import io_guard, paths
from prism_jax.data import tokenizers as tok_lib
from prism_jax.config import BACKBONE_FIELDS, Config, ModelConfig
from prism_jax.train import checkpoint as ckpt_lib
from prism_jax.train.state import TrainState


def check_backbone(cfg: ModelConfig, source: ModelConfig, where: str) -> None:
  diffs = [(k, getattr(source, k), getattr(cfg, k)) for k in BACKBONE_FIELDS
           if getattr(source, k) != getattr(cfg, k)]
  if diffs:
    raise ValueError(f"train.init_from={where}: its backbone differs from this run's in "
                     + ", ".join(f"model.{k} (it has {a!r}, this run {b!r})" for k, a, b in diffs)
                     + "; set them with --set model.KEY=VALUE")


def _vocab(tok) -> Any:
  hf = getattr(tok, "hf_tokenizer", None)
  return (tok.kind, tok.vocab_size) if hf is None else hf.get_vocab(with_added_tokens=True)


def check_tokenizer(tokenizer, source_tokenizer, where: str) -> None:
  """The run's tokenizer must give the source's ids (a byte/char tokenizer by kind and
  size, a BPE by its whole vocabulary)."""
  if _vocab(tokenizer) != _vocab(source_tokenizer):
    raise ValueError(f"train.init_from={where}: the run's {tokenizer.kind} tokenizer "
                     f"({tokenizer.vocab_size} ids) is not the source's {source_tokenizer.kind} "
                     f"tokenizer ({source_tokenizer.vocab_size} ids): the token ids would not "
                     "match its embedding; use the data.tokenizer the source was trained with")


def seed_tokenizer(cfg: Config, workdir: str) -> None:
  """A retrofit whose tokenizer is trained here (data.tokenizer bpe or char, the source's
  kind) packs its text with the source's tokenizer instead: its ids must be the source's (an imported Llama's
  or Qwen2's tokenizer.json, a dense twin's BPE), and a BPE trained anew would not give
  them. Written beside the packed data before packing, unless one is there already."""
  src = cfg.train.init_from
  if not src or cfg.data.tokenizer not in ("bpe", "char"):
    return
  out_dir = io_guard.find_packed_dir(workdir, cfg.data.packed_dir, must_exist=False)
  if paths.path(paths.join(out_dir, tok_lib.TOKENIZER_FILE)).is_file():
    return
  if not paths.path(os.path.join(src, "config.json")).is_file():
    return  # check_source names the problem
  source = ckpt_lib.load_config(src)
  if source.data.tokenizer != cfg.data.tokenizer:
    return  # another kind asked for: check_source refuses it by name
  data_lib.run_tokenizer(src, source.data.packed_dir).save(out_dir)


def check_source(cfg: Config, tokenizer) -> Config:
  """The source run's Config after the checks above (fast: no checkpoint is read)."""
  src = cfg.train.init_from
  if not paths.path(os.path.join(src, "config.json")).is_file():
    raise FileNotFoundError(f"train.init_from={src} is not a run directory (no config.json); "
                            "a Hugging Face directory is imported first with `prism "
                            "import-hf` (prism_jax/cli/import_hf.py)")
  source = ckpt_lib.load_config(src)
  check_backbone(cfg.model, source.model, src)
  check_tokenizer(tokenizer, data_lib.run_tokenizer(src, source.data.packed_dir), src)
  return source


def with_pretrained_backbone(state: TrainState, shardings: TrainState,
                             cfg: Config) -> TrainState:
  """`state` (step 0) with the backbone of train.init_from's newest checkpoint, placed
  as `shardings` says; the head (bank, optimiser moments) is left as it is."""
  _, params, _, _ = ckpt_lib.load_params(cfg.train.init_from)
  backbone = jax.device_get(params["backbone"])
  new = dict(state.params)
  new["backbone"] = jax.device_put(backbone, shardings.params["backbone"])
  return TrainState(state.step, new, state.opt_state)
