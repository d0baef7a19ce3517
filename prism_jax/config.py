"""Frozen, validated configuration dataclasses and the model presets.

Dimension letters used across the package (nanodo style, names carry shapes):
  B batch, T sequence length, N = B*T tokens, D d_model, V vocab, K prototypes,
  k active prototypes per token, H heads, Dh head dim, F MLP width, L layers.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from pallas_kernels.topk_reconstruct.api import IMPLEMENTATIONS, Implementation

ResidualRouting = Literal["straight_through", "plain"]
Mixture = Literal["raw", "normalized"]
Distance = Literal["cosine", "sqeuclidean"]
RecKind = Literal["relative", "plain"]
MixtureScale = Literal["none", "learned"]


def _check(cond: bool, msg: str) -> None:
  if not cond:
    raise ValueError(msg)


def _check_choice(name: str, value: Any, choices: tuple[Any, ...]) -> None:
  _check(value in choices, f"{name}={value!r} is not one of {choices}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Backbone + prototype head. `kind="dense"` is the same backbone without the head."""

  kind: Literal["prism", "dense"] = "prism"
  vocab_size: int = 512
  # 0: every row of the vocabulary is a token. Otherwise the number of real token ids; the
  # rows past it pad the embedding to a friendlier size (GPT-2's 50257 -> 50304, a multiple
  # of 128) and their logits are masked so that they are never predicted.
  vocab_used: int = 0
  max_len: int = 128
  d_model: int = 128
  n_layers: int = 4
  n_heads: int = 4
  mlp_ratio: int = 4
  # Prototype head (ignored by the dense twin).
  num_prototypes: int = 256  # K
  k: int = 8  # active prototypes per token
  residual_routing: ResidualRouting = "straight_through"
  # Convex mixture by default: the raw one overshoots z about k-fold (residual share ~3-7),
  # which makes the per-prototype logit decomposition hard to read (docs/RESULTS.md).
  mixture: Mixture = "normalized"
  distance: Distance = "cosine"  # for the clustering terms R1/R2
  # Faithfulness levers (issue 11; beyond the paper, which has neither). "learned": one
  # learned scalar s = exp(mix_log_scale) (init 1) multiplies the mixture weights, so
  # z_hat = s * sum_i a_i p_i can match |z| where a convex mixture of k spread prototypes
  # falls short (the residual then carries less). Prototype-space attribution
  # (prism_jax.attribution) does not model s: keep "none" for cached attribution.
  mixture_scale: MixtureScale = "none"
  # Residual dropout: in training only, r_t is zeroed on this fraction of tokens (drawn from
  # the step's key), so there the logits are W z_hat and the prototypes must predict alone.
  residual_dropout: float = 0.0
  proto_init: Literal["data", "normal"] = "data"
  implementation: Implementation = None  # prototype-layer kernel; None = best available
  # GPT-2 has biases in every linear map and LayerNorm; False drops them all (nanoGPT's
  # bias=False). Dropout (training only, from the step's key; off at eval and generation) on
  # the embeddings, the attention probabilities and each block's two residual branches.
  bias: bool = True
  dropout: float = 0.0
  # Numerics.
  dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype; params stay fp32
  remat: bool = False
  init_std: float = 0.02

  def __post_init__(self):
    _check_choice("model.kind", self.kind, ("prism", "dense"))
    for name in ("vocab_size", "max_len", "d_model", "n_layers", "n_heads", "mlp_ratio",
                 "num_prototypes", "k"):
      value = getattr(self, name)  # a float 2.5 or str "8" would slip through int()
      _check(isinstance(value, int) and not isinstance(value, bool) and value > 0,
             f"model.{name} must be a positive int, got {value!r}")
    _check(isinstance(self.vocab_used, int) and 0 <= self.vocab_used <= self.vocab_size,
           f"model.vocab_used={self.vocab_used!r} must be an int in [0, model.vocab_size="
           f"{self.vocab_size}] (0: all rows are tokens)")
    _check(self.d_model % self.n_heads == 0,
           f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}")
    _check(self.k <= self.num_prototypes,
           f"model.k={self.k} exceeds model.num_prototypes={self.num_prototypes} (k <= K)")
    _check_choice("model.residual_routing", self.residual_routing,
                  ("straight_through", "plain"))
    _check_choice("model.mixture", self.mixture, ("raw", "normalized"))
    _check_choice("model.distance", self.distance, ("cosine", "sqeuclidean"))
    _check_choice("model.mixture_scale", self.mixture_scale, ("none", "learned"))
    _check(isinstance(self.residual_dropout, (int, float)) and 0.0 <= self.residual_dropout < 1.0,
           f"model.residual_dropout must be in [0, 1), got {self.residual_dropout!r}")
    _check_choice("model.proto_init", self.proto_init, ("data", "normal"))
    _check_choice("model.dtype", self.dtype, ("float32", "bfloat16"))
    _check(isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0,
           f"model.dropout must be in [0, 1), got {self.dropout!r}")
    _check_choice("model.implementation", self.implementation, IMPLEMENTATIONS)

  @property
  def num_token_ids(self) -> int:
    """The real token ids: vocab_size less the padding rows (model.vocab_used)."""
    return self.vocab_used or self.vocab_size

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads

  @property
  def d_mlp(self) -> int:
    return self.d_model * self.mlp_ratio


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """Weights of L = CE + λ_rec(step) REC + λ_1 R1 + λ_2 R2 [+ λ_proto CE_proto
  + λ_rlogit RLOGIT + λ_proto_kl PKL] (PRISM.md §2).

  Beyond the paper's four terms (issue 11, faithfulness): `lambda_proto` weighs an auxiliary
  cross-entropy of the prototype path alone, CE(W z_hat), so that the part of the logit that
  prototypes explain also decides the prediction; `lambda_rlogit` weighs a logit-space
  residual penalty RLOGIT = mean_t var_v((W r_t)_v) / var_v((W z_t)_v), the residual's share
  of the logits' spread over the vocabulary (REC measured where the argmax is taken: a
  residual along directions W ignores costs nothing); `lambda_proto_kl` weighs
  KL(sg(softmax W z) ‖ softmax W z_hat), the prototype path distilled towards the model's
  own distribution (its argmax included) rather than towards the targets; `rec_ramp_steps`
  > 0 ramps λ_rec linearly from 0 at step 0 to `lambda_rec` at that step (the paper's λ_rec
  is constant).
  """

  # Defaults from the tiny-preset sweep (docs/RESULTS.md): R2 (token coverage) needs the
  # strong weight; R1 is easy once prototypes start from data, so a light weight suffices.
  lambda_rec: float = 0.05
  lambda_r1: float = 0.1
  lambda_r2: float = 1.0
  rec_kind: RecKind = "relative"
  rec_ramp_steps: int = 0  # 0 = constant λ_rec
  lambda_proto: float = 0.0
  lambda_rlogit: float = 0.0
  lambda_proto_kl: float = 0.0

  # The terms that read the prototype path's logits W z_hat (one head serves them all).
  PROTO_LOGIT_TERMS = ("lambda_proto", "lambda_rlogit", "lambda_proto_kl")

  def __post_init__(self):
    for name in ("lambda_rec", "lambda_r1", "lambda_r2") + self.PROTO_LOGIT_TERMS:
      _check(float(getattr(self, name)) >= 0.0, f"loss.{name} must be >= 0")
    _check(isinstance(self.rec_ramp_steps, int) and self.rec_ramp_steps >= 0,
           f"loss.rec_ramp_steps must be an int >= 0, got {self.rec_ramp_steps!r}")
    _check_choice("loss.rec_kind", self.rec_kind, ("relative", "plain"))

  @property
  def needs_proto_logits(self) -> bool:
    """Whether total_loss needs W z_hat (the prototype path's logits)."""
    return any(getattr(self, name) > 0 for name in self.PROTO_LOGIT_TERMS)


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Where text comes from and how it is tokenised, split and packed (prism_jax.data).

  Validation: `val_sources` (files/globs read only for validation) when given, else a
  seeded `val_fraction` of the documents, drawn with `split_seed` (the shuffle's `seed`
  does not move the split). `.txt` files become documents by `txt_documents`: "file" (one
  document per file), "paragraphs" (blank-line chunks of ~2 KB) or a number of characters
  (blank-line chunks of about that size). Tokenizers: "byte", "char" (the training text's
  characters), "bpe" (trained here to model.vocab_size), "gpt2" / "neox" (pretrained, offline).
  """

  sources: tuple[str, ...] = ()  # files/globs (.txt, .jsonl, .parquet); () = embedded corpus
  val_sources: tuple[str, ...] = ()  # validation-only files/globs; () = val_fraction split
  text_field: str = "text"  # jsonl field / parquet column holding the text
  tokenizer: Literal["byte", "char", "bpe", "gpt2", "neox"] = "bpe"
  seq_len: int = 128  # tokens per packed row fed to the model (row holds seq_len + 1)
  val_fraction: float = 0.05  # split by document; ignored when val_sources are given
  txt_documents: str = "paragraphs"  # "file" | "paragraphs" | max characters, e.g. "4096"
  on_decode_error: Literal["replace", "strict"] = "replace"  # non-UTF-8 bytes
  packed_dir: str = ""  # default: <workdir>/data
  seed: int = 0  # shuffle of the training rows
  split_seed: int = 0  # which documents go to validation (val_fraction)

  def __post_init__(self):
    _check(self.seq_len > 0, "data.seq_len must be positive")
    _check(0.0 <= self.val_fraction < 1.0, "data.val_fraction must be in [0, 1)")
    _check_choice("data.tokenizer", self.tokenizer, ("byte", "char", "bpe", "gpt2", "neox"))
    _check_choice("data.on_decode_error", self.on_decode_error, ("replace", "strict"))
    _check(self.txt_documents in ("file", "paragraphs")
           or (self.txt_documents.isdigit() and int(self.txt_documents) > 0),
           f"data.txt_documents={self.txt_documents!r}: use 'file', 'paragraphs' or a "
           "positive number of characters")
    _check(not (self.val_sources and not self.sources),
           "data.val_sources needs data.sources too (the embedded corpus has no val files)")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Optimisation and bookkeeping (prism_jax.train)."""

  steps: int = 600
  batch_size: int = 16  # global batch, in rows
  lr: float = 3e-3
  warmup_steps: int = 50
  min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
  weight_decay: float = 0.1  # never applied to prototypes, norms or biases
  b1: float = 0.9
  b2: float = 0.95
  grad_clip: float = 1.0
  seed: int = 0
  proto_init_step: int = 50  # dense warm-up steps before prototypes are set from data
  # every this many steps after the init, prototypes no token of a window of the coming
  # training tokens selects are set anew from hidden states (prism_jax/train/revive.py);
  # 0 = never
  revive_every: int = 0
  # microbatches per step: their gradients are summed before the one update, which equals
  # the whole batch's (prism_jax/train/accumulate.py); batch_size / grad_accum rows at a time
  grad_accum: int = 1
  eval_every: int = 200
  eval_batches: int = 8  # val batches per eval; 0 = the whole val split
  eval_at_start: bool = True  # also evaluate the untrained model (step 0) of a new run
  ckpt_every: int = 200
  keep_checkpoints: int = 3
  log_every: int = 20
  # trackers beside metrics.jsonl (prism_jax/train/tracking.py): "tensorboard", "wandb"
  # (the wandb extra), comma-separated; "" = metrics.jsonl only
  log_to: str = "tensorboard"
  # Retrofit (prism_jax/train/init_from.py): a run directory whose backbone starts this run
  # (a dense twin, an imported Hugging Face GPT-2, a PRISM run); the bank is then set from
  # its hidden states at proto_init_step (0: at once). "" = train from scratch.
  init_from: str = ""
  # "all", or "prototypes": only the prototype head (bank, learned mixture scale) trains;
  # the backbone is frozen, so the full logits stay the pretrained model's to the bit.
  trainable: Literal["all", "prototypes"] = "all"

  def __post_init__(self):
    for name in ("steps", "batch_size", "ckpt_every", "keep_checkpoints", "log_every",
                 "eval_every"):
      _check(int(getattr(self, name)) > 0, f"train.{name} must be positive")
    _check(int(self.eval_batches) >= 0, "train.eval_batches must be >= 0 (0: the whole split)")
    _check(self.lr > 0, "train.lr must be positive")
    _check(0 <= self.warmup_steps, "train.warmup_steps must be >= 0")
    _check(int(self.revive_every) >= 0, "train.revive_every must be >= 0 (0: never)")
    _check(int(self.grad_accum) >= 1, "train.grad_accum must be >= 1")
    _check(self.batch_size % self.grad_accum == 0,
           f"train.batch_size={self.batch_size} must be divisible by train.grad_accum="
           f"{self.grad_accum}")
    _check_choice("train.trainable", self.trainable, ("all", "prototypes"))
    for name in (n.strip() for n in self.log_to.split(",") if n.strip()):
      _check_choice("train.log_to", name, ("tensorboard", "wandb"))


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device mesh axes (prism_jax.sharding). One axis may be -1: filled with what is left."""

  data: int = -1
  fsdp: int = 1
  model: int = 1

  def __post_init__(self):
    sizes = (self.data, self.fsdp, self.model)
    _check(sum(s == -1 for s in sizes) <= 1, "at most one mesh axis may be -1")
    _check(all(s == -1 or s > 0 for s in sizes), "mesh axis sizes must be positive or -1")


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything a run needs; written as JSON beside every checkpoint."""

  model: ModelConfig = ModelConfig()
  loss: LossConfig = LossConfig()
  data: DataConfig = DataConfig()
  train: TrainConfig = TrainConfig()
  mesh: MeshConfig = MeshConfig()

  def __post_init__(self):
    _check(self.data.seq_len <= self.model.max_len,
           f"data.seq_len={self.data.seq_len} exceeds model.max_len={self.model.max_len}")
    _check(self.train.trainable == "all" or self.model.kind == "prism",
           "train.trainable=prototypes needs model.kind=prism (the dense twin has no bank)")


def to_dict(cfg: Any) -> dict[str, Any]:
  return dataclasses.asdict(cfg)


def to_json(cfg: Any) -> str:
  return json.dumps(to_dict(cfg), indent=2, sort_keys=True)


GPT2_VOCAB = 50257
GPT2_CONTEXT = 1024

MODEL_PRESETS: dict[str, ModelConfig] = {
    # Trains on two CPU cores in minutes. K 2048 (issue 44's capacity sweep, choose half:
    # agreement 56.7% vs 49.3% at K 512, decisive 91.1% vs 79.5%; K 8192 / 16384 go further,
    # 64.9% / 68.5%, at 2.3x / 11x the bank's step cost, past the demo's +15% budget); k 8 is
    # at the optimum of k (docs/RESULTS.md "Prototype path").
    "tiny": ModelConfig(vocab_size=512, max_len=128, d_model=128, n_layers=4, n_heads=4,
                        num_prototypes=2048, k=8),
    # GPT-2 family (PRISM.md §1): K and k from the paper.
    "small": ModelConfig(vocab_size=GPT2_VOCAB, max_len=GPT2_CONTEXT, d_model=768,
                         n_layers=12, n_heads=12, num_prototypes=8192, k=16),
    "medium": ModelConfig(vocab_size=GPT2_VOCAB, max_len=GPT2_CONTEXT, d_model=1024,
                          n_layers=24, n_heads=16, num_prototypes=8192, k=16),
    "large": ModelConfig(vocab_size=GPT2_VOCAB, max_len=GPT2_CONTEXT, d_model=1280,
                         n_layers=36, n_heads=20, num_prototypes=16384, k=16),
    "xl": ModelConfig(vocab_size=GPT2_VOCAB, max_len=GPT2_CONTEXT, d_model=1600,
                      n_layers=48, n_heads=25, num_prototypes=16384, k=16),
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
}
WARMUP_TOKENS = 375_000_000  # GPT-3's linear warm-up (App. B) ...
WARMUP_MAX_FRACTION = 0.1  # ... at most 10% of the run
PROTO_INIT_FRACTION = 0.05  # the bank is set from data after 5% of the run (dense warm-up)
EVAL_FRACTION = 0.02  # 50 evaluations per run, 8 val batches (4.2M tokens) each
REVIVE_FRACTION = 0.02  # unused prototypes set anew 50 times a run (train/revive.py)
CKPT_EVERY_MAX = 500  # a checkpoint every 20% of the run or 500 steps, whichever is sooner
SMOKE = "_smoke"  # "small_smoke": the GPT-2 model with a 10-step, batch-8 run (tests)


def recipe_train(name: str, steps: int | None = None) -> TrainConfig:
  """The training recipe of GPT-2 preset `name` for `steps` steps (default: its token
  budget). Warm-up, the prototype init, evaluation and checkpoints are placed as fractions
  of the run, so any step count gives a coherent recipe."""
  default_steps, lr = RECIPES[name]
  steps = default_steps if steps is None else steps
  _check(isinstance(steps, int) and steps > 0, f"train.steps must be positive, got {steps!r}")
  warmup = min(round(WARMUP_TOKENS / (RECIPE_ROWS * GPT2_CONTEXT)),
               int(WARMUP_MAX_FRACTION * steps))
  init = min(max(round(PROTO_INIT_FRACTION * steps), 1), steps - 1)
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


def preset_names() -> list[str]:
  """Every name `preset` takes: the model presets and the GPT-2 smoke runs."""
  return list(MODEL_PRESETS) + [name + SMOKE for name in RECIPES]


def preset(name: str, steps: int | None = None) -> Config:
  """A full run config: the model preset with data/train settings that suit its size.

  The GPT-2 presets tokenize with GPT-2's own BPE (installed by `make venv`; packing says
  what to install when it is missing; `--set data.tokenizer=bpe` trains one instead).

  Args:
    name: one of `preset_names()`. "tiny": the CPU preset (its own BPE, the default
      TrainConfig). "small"/"medium"/"large"/"xl": the GPT-2 model with its GPT-2
      training recipe (`recipe_train`). "<gpt2 name>_smoke" (e.g. "small_smoke"): that
      model with 10 steps at batch 8 (bank set at step 5), for tests and smoke runs.
      A ValueError for any other name.
    steps: train.steps; None (default) keeps the preset's own. For a GPT-2 recipe it
      rescales the recipe (warm-up, bank init, evaluation, checkpoints placed as fractions
      of the run); for tiny and the smoke runs it sets train.steps only.

  Returns:
    A `Config` (model, loss, data with seq_len = the model's max_len, train).
  """
  smoke = name.endswith(SMOKE) and name[:-len(SMOKE)] in RECIPES
  if not smoke and name not in MODEL_PRESETS:
    raise ValueError(f"unknown preset {name!r}; choose from {preset_names()}")
  model = model_preset(name[:-len(SMOKE)] if smoke else name)
  if name == "tiny":
    # λ_proto_kl = 1 (issue 11's faithfulness sweep, docs/RESULTS.md "Faithfulness"): the
    # prototype path distilled towards the model's distribution; on both sweep configs it is
    # as faithful as λ_proto = 1 (the first round's default) at a lower full CE. It stays 0
    # in LossConfig: the attribution code evaluates LossConfig() without W z_hat.
    train = TrainConfig() if steps is None else TrainConfig(steps=steps)
    return Config(model=model, loss=LossConfig(lambda_proto_kl=1.0),
                  data=DataConfig(seq_len=model.max_len), train=train)
  if smoke:
    train = TrainConfig(batch_size=8, steps=10 if steps is None else steps, lr=6e-4,
                        warmup_steps=2, proto_init_step=5)
  else:
    train = recipe_train(name, steps)
  return Config(model=model, data=DataConfig(seq_len=model.max_len, tokenizer="gpt2"),
                train=train)


def bank_init_problem(cfg: Config) -> str | None:
  """Why a run of `cfg` would never set its prototype bank from data, or None.

  A PRISM run with model.proto_init="data" trains dense until train.proto_init_step; at or
  past train.steps the bank stays random and the run is not the PRISM it claims to be."""
  tc = cfg.train
  if (cfg.model.kind == "prism" and cfg.model.proto_init == "data"
      and tc.proto_init_step >= tc.steps):
    return (f"train.proto_init_step={tc.proto_init_step} >= train.steps={tc.steps}: the "
            "prototype bank would never be set from data; lower train.proto_init_step or "
            "raise train.steps (a GPT-2 recipe places it by its steps: preset(name, steps) "
            "or --set train.steps=N), or set model.proto_init=normal for random prototypes")
  return None
