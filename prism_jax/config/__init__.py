"""Frozen, validated configuration dataclasses; the model presets and GPT-2 recipes are in
prism_jax/config/presets.py (re-exported here).

Dimension letters used across the package (nanodo style, names carry shapes):
  B batch, T sequence length, N = B*T tokens, D d_model, V vocab, K prototypes,
  k active prototypes per token, H heads, Dh head dim, F MLP width, L layers.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any, Literal

from pallas_kernels.topk_reconstruct.api import IMPLEMENTATIONS, Implementation

ResidualRouting = Literal["straight_through", "plain"]
Mixture = Literal["raw", "normalized", "nnls"]
Distance = Literal["cosine", "sqeuclidean"]
RecKind = Literal["relative", "plain"]
MixtureScale = Literal["none", "learned"]
Arch = Literal["gpt2", "llama"]
# Names of backbones a user registered (prism_jax.model.register_backbone): model.arch may
# name one of them beside the two built in. Filled only by that call.
REGISTERED_ARCHS: set[str] = set()


def _check(cond: bool, msg: str) -> None:
  if not cond:
    raise ValueError(msg)


def _check_choice(name: str, value: Any, choices: tuple[Any, ...]) -> None:
  _check(value in choices, f"{name}={value!r} is not one of {choices}")


# The ModelConfig fields that shape the backbone's parameters and function (what a retrofit
# must share with its source, what an export carries); the rest is the prototype head's.
BACKBONE_FIELDS = ("arch", "vocab_size", "vocab_used", "max_len", "d_model", "n_layers",
                   "n_heads", "mlp_ratio", "mlp_dim", "n_kv_heads", "qkv_bias", "rope_theta",
                   "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                   "rope_original_max_len", "norm_eps", "tie_embeddings", "bias")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Backbone + prototype head. `kind="dense"` is the same backbone without the head."""

  kind: Literal["prism", "dense"] = "prism"
  # The backbone's family (one Backbone, its parts chosen by arch; model/transformer.py).
  # "gpt2": LayerNorm, learned positions, GELU MLP, fused multi-head q|k|v, tied head.
  # "llama": RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention (n_kv_heads),
  # tied or untied head, optional q/k/v biases (Qwen2): Llama 3, Qwen2, Mistral, SmolLM2.
  arch: str = "gpt2"  # Arch, or a name given to prism_jax.model.register_backbone
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
  # 0: the MLP is mlp_ratio * d_model wide; else its width (Llama-family checkpoints' own
  # intermediate_size, e.g. 8192 at d 2048 or 1536 at d 576).
  mlp_dim: int = 0
  # arch=llama only. Key/value heads (grouped-query attention; 0: n_heads, i.e. full
  # multi-head); q/k/v biases (Qwen2); the rotary base; RMSNorm's epsilon (GPT-2's
  # LayerNorm keeps 1e-5); whether the LM head is the token embedding.
  n_kv_heads: int = 0
  qkv_bias: bool = False
  rope_theta: float = 10000.0
  # Llama 3's rotary frequency scaling (rope_type "llama3"): factor 0 = none; otherwise
  # the wavelengths past original_max_len / low_freq_factor are divided by the factor and
  # those between the two thresholds smoothly interpolated.
  rope_scaling_factor: float = 0.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_len: int = 8192
  norm_eps: float = 1e-5
  tie_embeddings: bool = True
  # Prototype head (ignored by the dense twin).
  num_prototypes: int = 256  # K
  k: int = 8  # active prototypes per token
  residual_routing: ResidualRouting = "straight_through"
  # Convex mixture by default: the raw one overshoots z about k-fold (residual share ~3-7),
  # which makes the per-prototype logit decomposition hard to read (docs/RESULTS.md).
  # "nnls": the weights are the non-negative least-squares fit of z on the k active
  # prototypes (prism_jax/model/nnls.py; issue 53), the same top-k by cosine.
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
  # proto_init=data: which of the candidate hidden states (2K of them) become prototypes.
  # "kmeans++": spread by k-means++ seeding on cosine distance (a sequential pass over the
  # candidates per prototype: tens of seconds on a CPU at K 8192); "uniform": K of them at
  # random (PRISM.md §1), instant.
  proto_init_pick: Literal["kmeans++", "uniform"] = "kmeans++"
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
    self._check_arch()
    _check(self.k <= self.num_prototypes,
           f"model.k={self.k} exceeds model.num_prototypes={self.num_prototypes} (k <= K)")
    _check_choice("model.residual_routing", self.residual_routing,
                  ("straight_through", "plain"))
    _check_choice("model.mixture", self.mixture, typing.get_args(Mixture))
    _check_choice("model.distance", self.distance, ("cosine", "sqeuclidean"))
    _check_choice("model.mixture_scale", self.mixture_scale, ("none", "learned"))
    _check(isinstance(self.residual_dropout, (int, float)) and 0.0 <= self.residual_dropout < 1.0,
           f"model.residual_dropout must be in [0, 1), got {self.residual_dropout!r}")
    _check_choice("model.proto_init", self.proto_init, ("data", "normal"))
    _check_choice("model.proto_init_pick", self.proto_init_pick, ("kmeans++", "uniform"))
    _check_choice("model.dtype", self.dtype, ("float32", "bfloat16"))
    _check(isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0,
           f"model.dropout must be in [0, 1), got {self.dropout!r}")
    _check_choice("model.implementation", self.implementation, IMPLEMENTATIONS)

  def _check_arch(self) -> None:
    _check(self.arch in typing.get_args(Arch) or self.arch in REGISTERED_ARCHS,
           f"model.arch={self.arch!r} is not one of {typing.get_args(Arch)} nor a registered "
           "backbone (prism_jax.model.register_backbone, in the module that defines it: "
           "import that module first)")
    for name in ("mlp_dim", "n_kv_heads", "rope_original_max_len"):
      value = getattr(self, name)
      _check(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
             f"model.{name} must be an int >= 0, got {value!r}")
    _check(self.n_heads % self.kv_heads == 0,
           f"model.n_heads={self.n_heads} is not a multiple of model.n_kv_heads="
           f"{self.n_kv_heads} (each key/value head serves a group of query heads)")
    _check(float(self.rope_theta) > 0 and float(self.norm_eps) > 0
           and float(self.rope_scaling_factor) >= 0,
           "model.rope_theta and model.norm_eps must be > 0, model.rope_scaling_factor >= 0")
    if self.arch == "gpt2":
      asks = {"n_kv_heads": self.kv_heads != self.n_heads, "qkv_bias": self.qkv_bias,
              "tie_embeddings": not self.tie_embeddings,
              "rope_scaling_factor": self.rope_scaling_factor != 0}
      for name, asked in asks.items():
        _check(not asked, f"model.{name}={getattr(self, name)!r} needs model.arch=llama "
               "(GPT-2 has full multi-head attention, no separate q/k/v biases, a tied head "
               "and learned positions)")
    elif self.arch == "llama":
      _check(not self.bias, "model.bias=True is GPT-2's (a bias in every linear map and "
             "LayerNorm); a Llama-family backbone has none: set model.bias=false "
             "(Qwen2's q/k/v biases: model.qkv_bias=true)")
      _check(self.head_dim % 2 == 0,
             f"rotary positions need an even head dim, got {self.head_dim}")

  @property
  def kv_heads(self) -> int:
    """Key/value heads: n_kv_heads, or n_heads (full multi-head attention)."""
    return self.n_kv_heads or self.n_heads

  @property
  def num_token_ids(self) -> int:
    """The real token ids: vocab_size less the padding rows (model.vocab_used)."""
    return self.vocab_used or self.vocab_size

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads

  @property
  def d_mlp(self) -> int:
    return self.mlp_dim or self.d_model * self.mlp_ratio


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
  # Dense warm-up steps before prototypes are set from data; or "auto": the bank is set at
  # the first eval step (train.eval_every) where the hidden states' mean cosine to their
  # mean direction falls below proto_init_cos (a bank set from states that share one
  # direction collapses: issue 44), and at proto_init_latest anyway (train/recipe.py).
  proto_init_step: int | Literal["auto"] = 50
  proto_init_cos: float = 0.6  # "auto"'s threshold
  proto_init_latest: int = 0  # "auto"'s latest step; 0 = half of train.steps
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
  # "all", or "prototypes": once the bank is set, only the prototype head (bank, learned
  # mixture scale) trains and the backbone is frozen, so the full logits stay those of the
  # backbone the bank was set on, to the bit. The dense warm-up before the bank is set
  # (proto_init_step > 0) trains the backbone: a retrofit in one run (the tiny preset).
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
    _check(self.proto_init_step == "auto" or (isinstance(self.proto_init_step, int)
                                               and self.proto_init_step >= 0),
           f"train.proto_init_step must be a step >= 0 or 'auto', got {self.proto_init_step!r}")
    _check(0 < self.proto_init_cos <= 1,
           f"train.proto_init_cos must be in (0, 1], got {self.proto_init_cos}")
    _check(int(self.proto_init_latest) >= 0, "train.proto_init_latest must be >= 0 (0: half "
           "of train.steps)")
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


def latest_proto_init(tc: TrainConfig) -> int:
  """The step where train.proto_init_step="auto" sets the bank whatever the statistic."""
  return int(tc.proto_init_latest) or max(tc.steps // 2, 1)


def bank_init_problem(cfg: Config) -> str | None:
  """Why a run of `cfg` would never set its prototype bank from data, or None.

  A PRISM run with model.proto_init="data" trains dense until train.proto_init_step; at or
  past train.steps the bank stays random and the run is not the PRISM it claims to be."""
  tc = cfg.train
  if (cfg.model.kind == "prism" and cfg.model.proto_init == "data" and tc.proto_init_step == "auto"
      and latest_proto_init(tc) >= tc.steps):
    return (f"train.proto_init_latest={tc.proto_init_latest} >= train.steps={tc.steps}: with "
            "train.proto_init_step=auto the bank might never be set from data; lower it (0: "
            "half of train.steps)")
  if (cfg.model.kind == "prism" and cfg.model.proto_init == "data"
      and tc.proto_init_step != "auto" and tc.proto_init_step >= tc.steps):
    return (f"train.proto_init_step={tc.proto_init_step} >= train.steps={tc.steps}: the "
            "prototype bank would never be set from data; lower train.proto_init_step or "
            "raise train.steps (a GPT-2 recipe places it by its steps: preset(name, steps) "
            "or --set train.steps=N), or set model.proto_init=normal for random prototypes")
  return None


# The presets live beside the dataclasses (prism_jax/config/presets.py); imported last, as
# they are built from the classes above.
from prism_jax.config.presets import (  # noqa: E402  pylint: disable=wrong-import-position
    CKPT_EVERY_MAX, EVAL_FRACTION, GPT2_CONTEXT, GPT2_VOCAB, MODEL_PRESETS,
    PROTO_INIT_STEP, RECIPE_ROWS, RECIPES, REVIVE_FRACTION, SMOKE, TOKENS_PER_PARAM,
    WARMUP_MAX_FRACTION, WARMUP_TOKENS, grad_accum_for, model_preset, preset, preset_names,
    recipe_train, slice_name)
# Building a config (overrides, files) and finishing it for a run, on the classes above.
from prism_jax.config.overrides import (  # noqa: E402  pylint: disable=wrong-import-position
    apply_overrides, config_diff, config_from_dict, flatten, parse_override, valid_keys)
from prism_jax.config.files import (  # noqa: E402  pylint: disable=wrong-import-position
    build_config, is_config_file, load_config_file, resolve_config)
from prism_jax.config.finish import finish  # noqa: E402  pylint: disable=wrong-import-position
