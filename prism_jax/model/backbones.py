"""Which module computes the hidden states z: the library's Backbone (model.arch gpt2 or
llama) or one a user registered, so the PRISM head sits on any Flax NNX model.

A backbone is an `nnx.Module` built as `cls(cfg: ModelConfig, *, rngs: nnx.Rngs)` with

  __call__(tokens_BxT, positions_BxT=None, caches=None, tap=None, dropout_key=None)
      -> (z_BxTxD, caches)       z: the hidden state the head reads, float32, D = d_model
  unembedding() -> W (V x D)     the LM head's matrix: logits = z W^T
  lm_head(h_BxTxD) -> logits     (HiddenStateBackbone gives it from unembedding())
  init_cache(batch, dtype)       a KV cache for generation, or None: generation then runs
                                 the whole prefix each step (HiddenStateBackbone's default)

`register_backbone("name", cls)` makes `ModelConfig(arch="name")` build it, so everything
that builds a model from a config works on it: training with its four losses, the bank's
data init and revival, checkpoints and `prism_jax.load`, decomposition, the attribution
cache and cards (experiments/notebooks/head_on_your_model.ipynb). Registration is the
caller's, in the module that defines the class: a process that loads such a run imports
that module first. EK-FAC (which reads the library's blocks) and the analytic FLOP count
of the backbone are the library backbone's only.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from flax import nnx

from prism_jax import config as config_lib
from prism_jax.model.ops import tied_logits
from prism_jax.model.transformer import Backbone

_REGISTRY: dict[str, Callable[..., nnx.Module]] = {}
BUILT_IN = ("gpt2", "llama")


class HiddenStateBackbone(nnx.Module):
  """A base for a user's backbone: `lm_head` from `unembedding()` (at least float32, the
  vocabulary's padding rows masked as the library's head does) and no KV cache."""

  cfg: config_lib.ModelConfig

  def unembedding(self) -> jax.Array:
    raise NotImplementedError("a backbone returns its LM head's matrix W (V x D)")

  def lm_head(self, h_BxTxD: jax.Array) -> jax.Array:
    return tied_logits(h_BxTxD, self.unembedding(), self.cfg.dtype, self.cfg.num_token_ids)

  def init_cache(self, batch: int, dtype: Any = None) -> None:
    del batch, dtype
    return None


def register_backbone(name: str, cls: Callable[..., nnx.Module]) -> None:
  """Lets `ModelConfig(arch=name)` build `cls(cfg, rngs=...)` as the backbone."""
  if name in BUILT_IN:
    raise ValueError(f"model.arch={name!r} is built in; register under another name")
  if not name.isidentifier():
    raise ValueError(f"backbone name {name!r} must be an identifier")
  _REGISTRY[name] = cls
  config_lib.REGISTERED_ARCHS.add(name)


def backbone_class(arch: str) -> Callable[..., nnx.Module]:
  """The class that builds model.arch's backbone."""
  if arch in BUILT_IN:
    return Backbone
  if arch not in _REGISTRY:
    raise ValueError(f"model.arch={arch!r} is not registered: import the module that calls "
                     "prism_jax.model.register_backbone for it")
  return _REGISTRY[arch]
