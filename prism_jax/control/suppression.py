"""Suppression of a prototype set G (PRISM.md §6), in teacher-forced scoring and generation.

    pset = ProtoSet.from_selection(model, selection)     # ids, scores, the model's fingerprint
    pset.save(path); ProtoSet.load(path, model)          # refused for another model
    logits_BxTxV = suppressed_logits(model, out, pset.ids)          # out = model(tokens)
    generate_suppressed(model, prompt, pset.ids, seed=0, ...)

Default (the spec's): ℓ'_t = ℓ_t − Σ_{i∈G∩S_t} a_{t,i} W p_i through the shared edit
(`model/logit_edit.controlled_logits`, r_t kept from the unedited pass); the k − |G∩S_t|
freed slots stay empty. `refill=True` instead fills them with the next most similar
prototypes outside G: ẑ'_t is the layer's mixture over the top-k of cos(z_t, p_i), i ∉ G,
and ℓ'_t = W (ẑ'_t + r_t), r_t still the unedited pass's.
A token ban (the baseline) is `ban_hook(token_ids)`: those logits set to the dtype's min.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from prism_jax import io_guard, paths
from prism_jax.generate import GenerationOutput, generate
from prism_jax.model.lm import LMOutput, PrismLM
from prism_jax.control import steering
from prism_jax.control.steering import suppression_gains
from prism_jax.model.logit_edit import controlled_logits
from prism_jax.model import nnls
from prism_jax.model.prototypes import PrototypeOutput, similarity, topk_mixture

SETS_DIR = "suppression_sets"  # beside a run: <workdir>/suppression_sets/<name>.json
FORMAT = steering.SUPPRESSION_FORMAT  # "prism_jax.suppression_set/1"


def model_fingerprint(model: PrismLM) -> dict:
  """What identifies a trained bank: K, D, V and a digest of the prototypes' bytes."""
  protos = np.asarray(model.bank.protos[...], np.float32)
  return {"num_prototypes": int(model.cfg.num_prototypes), "d_model": int(model.cfg.d_model),
          "vocab_size": int(model.cfg.vocab_size),
          "bank_sha256": hashlib.sha256(protos.tobytes()).hexdigest()}


def check_ids(model: PrismLM, ids: Sequence[int], *, allow_empty: bool = False) -> np.ndarray:
  """`ids` as sorted unique int64, or ValueError: not a PrismLM, unknown ids (checked by
  control/steering.check_ids), empty set."""
  if not isinstance(model, PrismLM):
    raise ValueError("suppression needs a PrismLM: the dense model has no prototypes")
  ids_G = steering.check_ids(ids, model.cfg.num_prototypes)
  if not ids_G.size and not allow_empty:
    raise ValueError("empty prototype selection: nothing to suppress (did the selection "
                     "match no prototype?)")
  return np.unique(ids_G)


@dataclasses.dataclass(frozen=True)
class ProtoSet:
  """A suppression set: prototype ids with their selection scores, tied to one bank."""

  ids: tuple[int, ...]
  scores: tuple[float, ...]
  method: str
  query: str
  fingerprint: dict

  @classmethod
  def create(cls, model: PrismLM, ids: Sequence[int], scores: Sequence[float] | None = None,
             method: str = "manual", query: str = "") -> "ProtoSet":
    ids = list(ids) if not isinstance(ids, np.ndarray) else ids
    check_ids(model, ids)  # integers in range: no int() below truncates a 1.5
    ids_list = [int(i) for i in np.asarray(ids).reshape(-1)]
    scores = [1.0] * len(ids_list) if scores is None else [float(s) for s in scores]
    if len(scores) != len(ids_list):
      raise ValueError(f"{len(ids_list)} ids but {len(scores)} scores")
    if len(set(ids_list)) != len(ids_list):
      raise ValueError(f"duplicate prototype ids in {ids_list}")
    return cls(tuple(ids_list), tuple(scores), method, query, model_fingerprint(model))

  @property
  def share(self) -> float:
    return len(self.ids) / self.fingerprint["num_prototypes"]

  def save(self, path: str, name: str | None = None) -> str:
    """Writes the set as JSON at `path`; a directory (e.g. a run's) gets
    <path>/suppression_sets/<name or method>.json, claimed like every output directory."""
    if paths.path(path).is_dir() and not path.endswith(".json"):
      out_dir = io_guard.claim_output_dir(paths.join(path, SETS_DIR), "suppression sets")
      path = paths.join(out_dir, f"{name or self.method}.json")
    paths.write_text_atomic(path, json.dumps({"format": FORMAT, **dataclasses.asdict(self)},
                                             indent=2))  # local or gs://
    return path

  @classmethod
  def load(cls, path: str, model: PrismLM) -> "ProtoSet":
    """Reads a saved set; refuses one saved for another model (different bank)."""
    raw = json.loads(paths.path(path).read_text())
    if raw.get("format") != FORMAT:
      raise ValueError(f"{path} is not a suppression set (format {raw.get('format')!r})")
    pset = cls(tuple(raw["ids"]), tuple(raw["scores"]), raw["method"], raw["query"],
               raw["fingerprint"])
    steering.check_fingerprint(pset.fingerprint, model_fingerprint(model),
                               f"suppression set {path}")
    check_ids(model, pset.ids)
    return pset


def suppressed_logits(model: PrismLM, out: LMOutput, ids: Sequence[int], *,
                      refill: bool = False) -> jax.Array:
  """`out.logits_BxTxV` with G = `ids` suppressed (module doc); `out` = model(tokens)."""
  ids_G = check_ids(model, ids, allow_empty=True)
  if not refill:
    return controlled_logits(model, out, suppression_gains(model.cfg.num_prototypes, ids_G))
  batch, seq, _ = out.logits_BxTxV.shape
  in_G_K = np.zeros(model.cfg.num_prototypes, bool)
  in_G_K[ids_G] = True
  return refilled_logits(model, out.protos, jnp.asarray(in_G_K)).reshape(batch, seq, -1)


def refilled_logits(model: PrismLM, protos: PrototypeOutput, in_G_K: jax.Array) -> jax.Array:
  """(N, V) logits W (ẑ' + r) with ẑ' the mixture over the top-k prototypes outside G
  (`in_G_K` marks G; traceable, so it runs inside a jitted sampler or scorer)."""
  if model.cfg.mixture_scale != "none":
    raise ValueError("refill supports model.mixture_scale='none' only")
  protos_KxD = model.bank.protos[...]
  z_NxD = protos.z_hat_NxD + protos.residual_NxD  # = z in value
  cos_NxK = similarity(z_NxD.astype(jnp.float32), protos_KxD.astype(jnp.float32)).cos_NxK
  cos_NxK = jnp.where(in_G_K[None, :], -jnp.inf, cos_NxK)
  if model.cfg.mixture == "nnls":  # the least-squares weights on the refilled active set
    idx_Nxk = jax.lax.top_k(cos_NxK, model.cfg.k)[1].astype(jnp.int32)
    z_hat_NxD = nnls.nnls_mixture(z_NxD.astype(jnp.float32), protos_KxD, idx_Nxk)[1]
  else:
    z_hat_NxD = topk_mixture(cos_NxK, protos_KxD, model.cfg.k, model.cfg.mixture).z_hat_NxD
  return model.backbone.lm_head((z_hat_NxD + protos.residual_NxD)[None])[0]


def ban_hook(token_ids: Sequence[int], vocab_size: int):
  """A `generate` logit_hook (and scorer edit) that bans `token_ids`."""
  ban_V = np.zeros(vocab_size, bool)
  ids = np.asarray(list(token_ids), np.int64)
  if ids.size == 0:
    raise ValueError("empty token ban list")
  if ids.min() < 0 or ids.max() >= vocab_size:
    raise ValueError(f"token ids must be in [0, {vocab_size}), got {ids.tolist()[:8]}")
  ban_V[ids] = True
  ban_V = jnp.asarray(ban_V)

  def hook(logits, protos=None):
    del protos
    return jnp.where(ban_V, jnp.finfo(logits.dtype).min, logits)
  return hook


def edit_args(model: PrismLM, ids: Sequence[int] = (), *, refill: bool = False,
              ban_hook_fn=None) -> dict:
  """`generate` keyword arguments that suppress G = `ids` (and apply a ban hook after):
  proto_gain_K for the plain edit; a logit_hook that recomputes the logits for refill
  (the trace then decomposes the unedited logits)."""
  if not len(ids):
    return {"logit_hook": ban_hook_fn}
  ids_G = check_ids(model, ids)
  if not refill:
    return {"proto_gain_K": suppression_gains(model.cfg.num_prototypes, ids_G),
            "logit_hook": ban_hook_fn}
  in_G_K = np.zeros(model.cfg.num_prototypes, bool)
  in_G_K[ids_G] = True
  in_G_K = jnp.asarray(in_G_K)

  def refill_hook(logits_BxV, protos):
    logits_BxV = refilled_logits(model, protos, in_G_K).astype(logits_BxV.dtype)
    return logits_BxV if ban_hook_fn is None else ban_hook_fn(logits_BxV)
  return {"logit_hook": refill_hook}


def generate_suppressed(model, prompt, ids: Sequence[int] = (), *, refill: bool = False,
                        ban: Sequence[int] = (), **kwargs) -> GenerationOutput:
  """`generate` with G = `ids` suppressed (and/or the tokens `ban` banned)."""
  hook = ban_hook(ban, model.cfg.vocab_size) if len(ban) else None
  return generate(model, prompt, **edit_args(model, ids, refill=refill, ban_hook_fn=hook),
                  **kwargs)
