"""The model presets (`preset("tiny")`, ..., the GPT-2 sizes) and the GPT-2 training recipes:
steps and learning rate per size, the schedule's fractions, and the named TPU slices'
gradient accumulation. Re-exported by prism_jax.config."""

from __future__ import annotations

import dataclasses
from typing import Any

from prism_jax.config import (Config, DataConfig, LossConfig, ModelConfig, TrainConfig,
                              _check)

GPT2_VOCAB = 50257
GPT2_CONTEXT = 1024
LLAMA3_VOCAB = 128256

MODEL_PRESETS: dict[str, ModelConfig] = {
    # Trains on two CPU cores in minutes. K 2048 (issue 44's capacity sweep, choose half:
    # agreement 56.7% vs 49.3% at K 512, decisive 91.1% vs 79.5%); k 8 is at the optimum of
    # k (docs/RESULTS.md "Prototype path"). The demo trains "demo" (below), not this.
    "tiny": ModelConfig(vocab_size=512, max_len=128, d_model=128, n_layers=4, n_heads=4,
                        num_prototypes=2048, k=8),
    # `make demo`'s model: the tiny backbone with a bank set on it once trained (demo_train:
    # a dense warm-up, then the bank alone for the last steps), K 16384 of its hidden states
    # drawn uniformly, mixed by non-negative least squares on the top k 16 (issue 53's choose
    # half: docs/RESULTS.md "The demo's recipe").
    "demo": ModelConfig(vocab_size=512, max_len=128, d_model=128, n_layers=4, n_heads=4,
                        num_prototypes=16384, k=16, mixture="nnls", proto_init_pick="uniform"),
    # GPT-2 family (PRISM.md §1): K and k from the paper.
    "small": ModelConfig(vocab_size=GPT2_VOCAB, max_len=GPT2_CONTEXT, d_model=768,
                         n_layers=12, n_heads=12, num_prototypes=8192, k=16),
    "medium": ModelConfig(vocab_size=GPT2_VOCAB, max_len=GPT2_CONTEXT, d_model=1024,
                          n_layers=24, n_heads=16, num_prototypes=8192, k=16),
    "large": ModelConfig(vocab_size=GPT2_VOCAB, max_len=GPT2_CONTEXT, d_model=1280,
                         n_layers=36, n_heads=20, num_prototypes=16384, k=16),
    "xl": ModelConfig(vocab_size=GPT2_VOCAB, max_len=GPT2_CONTEXT, d_model=1600,
                      n_layers=48, n_heads=25, num_prototypes=16384, k=16),
    # Llama-family, about 1B (Llama 3.2 1B's shape: 32 query / 8 key-value heads, SwiGLU
    # 8192, Llama 3's 128,256-id vocabulary, tied head, θ 500000 with its rope scaling),
    # trained at GPT-2's context and token batch so its recipe compares with theirs.
    "llama_1b": ModelConfig(arch="llama", bias=False, vocab_size=LLAMA3_VOCAB,
                            max_len=GPT2_CONTEXT, d_model=2048, n_layers=16, n_heads=32,
                            n_kv_heads=8, mlp_dim=8192, rope_theta=500000.0,
                            rope_scaling_factor=32.0, rope_original_max_len=8192,
                            num_prototypes=16384, k=16),
}


def model_preset(name: str, **overrides: Any) -> ModelConfig:
  if name not in MODEL_PRESETS:
    raise ValueError(f"unknown preset {name!r}; choose from {sorted(MODEL_PRESETS)}")
  return dataclasses.replace(MODEL_PRESETS[name], **overrides)


# GPT-2 training recipes. Global batch 512 rows x 1024 tokens = 524,288 tokens (GPT-3's
# 0.5M for the 125M-760M models; nanoGPT's GPT-2 reproduction uses the same). `steps`: the
# token budget, about 20 tokens per PRISM parameter (Chinchilla, Hoffmann et al. 2022),
# rounded up to 100 steps (tests/test_config.py checks it against prism_jax.flops). Peak
# learning rates: GPT-3 (Brown et al. 2020, Table 2.1) at the nearest size (125M 6e-4,
# 350M 3e-4, 760M 2.5e-4, 1.3B 2e-4); cosine decay to 10% of the peak (GPT-3, App. B).
RECIPE_ROWS = 512
TOKENS_PER_PARAM = 20
RECIPES: dict[str, tuple[int, float]] = {  # name -> (steps, peak lr)
    "small": (5000, 6e-4),  # 130.7M PRISM params, 2.62B tokens
    "medium": (13900, 3e-4),  # 363.2M, 7.29B tokens
    "large": (30400, 2.5e-4),  # 795.0M, 15.94B tokens
    "xl": (60500, 2e-4),  # 1.584B, 31.72B tokens
    "llama_1b": (48500, 2e-4),  # 1.269B, 25.43B tokens (GPT-3's LR at 1.3B)
}
WARMUP_TOKENS = 375_000_000  # GPT-3's linear warm-up (App. B) ...
WARMUP_MAX_FRACTION = 0.1  # ... at most 10% of the run
# The bank is set from data once the hidden states have spread (train.proto_init_step=auto:
# at the first evaluation where their mean cosine to their mean direction is below
# train.proto_init_cos), at half the run at the latest. A bank set at a fixed early step,
# while the states still share one direction, collapses onto a few prototypes (issue 44).
PROTO_INIT_STEP = "auto"
EVAL_FRACTION = 0.02  # 50 evaluations per run, 8 val batches (4.2M tokens) each
REVIVE_FRACTION = 0.02  # unused prototypes set anew 50 times a run (train/revive.py)
CKPT_EVERY_MAX = 500  # a checkpoint every 20% of the run or 500 steps, whichever is sooner
SMOKE = "_smoke"  # "small_smoke": the GPT-2 model with a 10-step, batch-8 run (tests)


def recipe_train(name: str, steps: int | None = None) -> TrainConfig:
  """The training recipe of GPT-2 preset `name` for `steps` steps (default: its token
  budget). Warm-up, evaluation and checkpoints are placed as fractions of the run and the
  prototype init is "auto" (at half the run at the latest), so any step count gives a
  coherent recipe."""
  default_steps, lr = RECIPES[name]
  steps = default_steps if steps is None else steps
  _check(isinstance(steps, int) and steps > 0, f"train.steps must be positive, got {steps!r}")
  warmup = min(round(WARMUP_TOKENS / (RECIPE_ROWS * GPT2_CONTEXT)),
               int(WARMUP_MAX_FRACTION * steps))
  # A one-step run has no evaluation to decide at: its bank is set at step 0.
  init = PROTO_INIT_STEP if steps > 1 else 0
  return TrainConfig(steps=steps, batch_size=RECIPE_ROWS, lr=lr, warmup_steps=warmup,
                     min_lr_ratio=0.1, proto_init_step=init,
                     eval_every=max(round(EVAL_FRACTION * steps), 1), eval_batches=8,
                     revive_every=max(round(REVIVE_FRACTION * steps), 1),
                     ckpt_every=max(min(CKPT_EVERY_MAX, steps // 5), 1), keep_checkpoints=3,
                     log_every=10)


# Google names a slice by its TensorCores on v2-v4 and v5p (two a chip: the 8-chip
# v5p:2x2x2 is "v5p-16") and by its chips on v5e and v6e (v5e:4x4 is "v5e-16") (Cloud TPU
# docs, /tpu/docs/v5p and /v5e "Configurations"). The scale table and `prism model-card`
# use these names.
_CORES_IN_NAME = {"v2": 2, "v3": 2, "v4": 2, "v5p": 2}


def slice_name(topology: str) -> str:
  """Google's name of the slice of a topology such as "v5p:2x2x2" (-> "v5p-16")."""
  gen, _, dims = topology.partition(":")
  sizes = dims.split("x")
  _check(bool(gen) and all(d.isdigit() and int(d) > 0 for d in sizes),
         f"topology {topology!r} is not <generation>:<AxB[xC]> (e.g. v5e:4x4)")
  chips = 1
  for d in sizes:
    chips *= int(d)
  return f"{gen}-{chips * _CORES_IN_NAME.get(gen, 1)}"


def grad_accum_for(rows_per_chip: int, fits_per_chip: int) -> int:
  """train.grad_accum N for a step of `rows_per_chip` rows on every chip where at most
  `fits_per_chip` fit: the fewest microbatches, N dividing the rows (each microbatch
  spreads over every chip), with rows_per_chip / N <= fits_per_chip."""
  _check(rows_per_chip >= 1 and fits_per_chip >= 1,
         f"rows per chip {rows_per_chip} and rows that fit {fits_per_chip} must be >= 1")
  return next(n for n in range(1, rows_per_chip + 1)
              if rows_per_chip % n == 0 and rows_per_chip // n <= fits_per_chip)


DEMO_BANK_STEPS = 20  # the demo recipe's bank-alone steps at the end of the run


def demo_train(steps: int) -> TrainConfig:
  """The demo's recipe: a dense warm-up of `steps` - DEMO_BANK_STEPS steps, the bank set
  from data at that step (train.proto_init_step), then the bank alone on the frozen
  backbone (train.trainable=prototypes), so the full logits are the dense backbone's.
  On the choose half the bank's agreement barely moves with more bank steps (issue 53),
  while every step the backbone gives up costs CE."""
  _check(steps > 1, f"the demo recipe needs steps > 1, got {steps}")
  return TrainConfig(steps=steps, proto_init_step=max(1, steps - DEMO_BANK_STEPS),
                     trainable="prototypes", eval_at_start=False)


def preset_names() -> list[str]:
  """Every name `preset` takes: the model presets and the GPT-2 smoke runs."""
  return list(MODEL_PRESETS) + [name + SMOKE for name in RECIPES]


def preset(name: str, steps: int | None = None) -> Config:
  """A full run config: the model preset with data/train settings that suit its size.

  The GPT-2 presets tokenize with GPT-2's own BPE (installed by `make venv`; packing says
  what to install when it is missing; `--set data.tokenizer=bpe` trains one instead).

  Args:
    name: one of `preset_names()`. "tiny": the CPU preset (its own BPE, the default
      TrainConfig). "demo": the tiny backbone with `make demo`'s bank and recipe
      (`demo_train`). "small"/"medium"/"large"/"xl": the GPT-2 model with its GPT-2
      training recipe (`recipe_train`). "<gpt2 name>_smoke" (e.g. "small_smoke"): that
      model with 10 steps at batch 8 (bank set at step 5), for tests and smoke runs.
      A ValueError for any other name.
    steps: train.steps; None (default) keeps the preset's own. For a GPT-2 recipe it
      rescales the recipe (warm-up, bank init, evaluation, checkpoints placed as fractions
      of the run); for demo it moves the bank's setting with it (`demo_train`); for tiny
      and the smoke runs it sets train.steps only.

  Returns:
    A `Config` (model, loss, data with seq_len = the model's max_len, train).
  """
  smoke = name.endswith(SMOKE) and name[:-len(SMOKE)] in RECIPES
  if not smoke and name not in MODEL_PRESETS:
    raise ValueError(f"unknown preset {name!r}; choose from {preset_names()}")
  model = model_preset(name[:-len(SMOKE)] if smoke else name)
  if name in ("tiny", "demo"):
    # λ_proto_kl = 1 (issue 11's faithfulness sweep, docs/RESULTS.md "Faithfulness"): the
    # prototype path distilled towards the model's distribution; on both sweep configs it is
    # as faithful as λ_proto = 1 (the first round's default) at a lower full CE. It stays 0
    # in LossConfig: the attribution code evaluates LossConfig() without W z_hat.
    train = TrainConfig() if steps is None else TrainConfig(steps=steps)
    if name == "demo":
      train = demo_train(train.steps)
    return Config(model=model, loss=LossConfig(lambda_proto_kl=1.0),
                  data=DataConfig(seq_len=model.max_len), train=train)
  if smoke:
    train = TrainConfig(batch_size=8, steps=10 if steps is None else steps, lr=6e-4,
                        warmup_steps=2, proto_init_step=5)
  else:
    train = recipe_train(name, steps)
  # Llama 3's tokenizer is not shipped (no downloads): a BPE is trained to its vocabulary
  # size unless the run starts from an imported checkpoint's (`prism import-hf`).
  tokenizer = "bpe" if model.arch == "llama" else "gpt2"
  return Config(model=model, data=DataConfig(seq_len=model.max_len, tokenizer=tokenizer),
                train=train)
