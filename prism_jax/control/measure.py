"""Evaluation of an edit: behaviour rate over seeded generations, quality on neutral text.

    rates = behaviour_scores(model, tokenizer, b, ids=G, num_samples=32)   # per generation
    q = quality(model, inputs_BxT, targets_BxT, mask_BxT, ids=G)           # neutral text

An edit is a prototype set `ids` (suppressed, optionally with `refill`) and/or a token
`ban`. Generations: every prompt of the behaviour × `num_samples` samples in one batch with one
seed, so all conditions see the same prompts and keys. Quality, teacher
forced: perplexity before and after, KL(unedited ‖ edited) per token and the share of
tokens whose argmax changes, over the valid (mask) tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from prism_jax.control.behaviours import Behaviour
from flax import nnx

from prism_jax.control.suppression import ban_hook, check_ids, edit_args, refilled_logits
from prism_jax.generate import generate
from prism_jax.losses import token_nll
from prism_jax.model.logit_edit import controlled_logits


@functools.lru_cache(maxsize=16)
def _cached_ban(ban: tuple[int, ...], vocab_size: int):
  return ban_hook(ban, vocab_size)  # one hook object per list: generate compiles once


def generations(model, tokenizer, prompts: Sequence[str], *, ids: Sequence[int] = (),
                ban: Sequence[int] = (), refill: bool = False, num_samples: int = 32,
                max_new_tokens: int = 48, temperature: float = 1.0, top_k: int | None = 40,
                seed: int = 0) -> list[str]:
  """Decoded continuations, prompt-major: num_samples per prompt."""
  if num_samples < 1:
    raise ValueError(f"num_samples must be >= 1, got {num_samples}")
  hook = _cached_ban(tuple(sorted(set(map(int, ban)))), model.cfg.vocab_size) if len(ban) else None
  edit = edit_args(model, ids, refill=refill, ban_hook_fn=hook)
  # One batch for all prompts (one compile per edit): each prompt starts a document (EOS
  # before it, as in training) and shorter ones are left-filled with more EOS.
  encoded = [tokenizer.encode(prompt) for prompt in prompts]
  width = 1 + max(map(len, encoded))
  rows = [[tokenizer.eos_id] * (width - len(e)) + e for e in encoded for _ in range(num_samples)]
  out = generate(model, rows, max_new_tokens=max_new_tokens, temperature=temperature,
                 top_k=top_k, seed=seed, eos_id=tokenizer.eos_id, **edit)
  texts = [tokenizer.decode(row[:n].tolist()) for row, n in zip(out.tokens_BxL, out.lengths_B)]
  return texts


def behaviour_scores(model, tokenizer, b: Behaviour, **kwargs) -> dict[str, np.ndarray]:
  """{"score": (G,), ["score_selection": (G,)]} per generation, and the texts."""
  texts = generations(model, tokenizer, b.prompts, **kwargs)
  out = {"score": np.array([b.score(t) for t in texts]), "texts": texts}
  if b.score_selection is not None:
    out["score_selection"] = np.array([b.score_selection(t) for t in texts])
  return out


@functools.partial(jax.jit, static_argnames=("graphdef", "refill"))
def _edit_stats(graphdef, state, in_G_K, ban_V, inputs_BxT, targets_BxT, mask_BxT, refill):
  model = nnx.merge(graphdef, state)
  out = model(inputs_BxT, mask_BxT=mask_BxT)
  base_BxTxV = edited = out.logits_BxTxV
  if refill:
    edited = refilled_logits(model, out.protos, in_G_K).reshape(base_BxTxV.shape)
  else:
    edited = controlled_logits(model, out, 1.0 - in_G_K.astype(jnp.float32))
  edited = jnp.where(ban_V, -jnp.inf, edited)  # a hard ban: probability 0
  m = mask_BxT.astype(jnp.float32)
  logp0 = jax.nn.log_softmax(base_BxTxV, -1)
  logp1 = jax.nn.log_softmax(edited, -1)
  p0 = jnp.exp(logp0)  # KL is +inf where a ban removes a token the model gave mass to
  kl_BxT = jnp.sum(jnp.where(p0 > 0, p0 * (logp0 - logp1), 0.0), -1)
  changed = (base_BxTxV.argmax(-1) != edited.argmax(-1)).astype(jnp.float32)
  return {"nll0": jnp.sum(token_nll(base_BxTxV, targets_BxT) * m),
          "nll1": jnp.sum(token_nll(edited, targets_BxT) * m),
          "kl": jnp.sum(kl_BxT * m), "changed": jnp.sum(changed * m), "tokens": jnp.sum(m)}


def quality(model, inputs_BxT, targets_BxT, mask_BxT, *, ids: Sequence[int] = (),
            ban: Sequence[int] = (), refill: bool = False, batch_size: int = 16) -> dict:
  """Neutral-text quality of an edit (module doc), summed over batches of rows."""
  graphdef, state = nnx.split(model)
  in_G_K = np.zeros(model.cfg.num_prototypes, bool)
  if len(ids):
    in_G_K[check_ids(model, ids)] = True
  ban_V = np.zeros(model.cfg.vocab_size, bool)
  if len(ban):
    ban_V[np.asarray(list(ban), np.int64)] = True
  totals: dict[str, float] = {}
  for start in range(0, len(inputs_BxT), batch_size):
    sl = slice(start, start + batch_size)
    stats = _edit_stats(graphdef, state, jnp.asarray(in_G_K), jnp.asarray(ban_V), jnp.asarray(inputs_BxT[sl]),
                        jnp.asarray(targets_BxT[sl]), jnp.asarray(mask_BxT[sl]), refill)
    for k, v in stats.items():
      totals[k] = totals.get(k, 0.0) + float(v)
  n = totals["tokens"]
  return {"ppl_before": float(np.exp(totals["nll0"] / n)),
          "ppl_after": _exp(totals["nll1"] / n),
          "kl": totals["kl"] / n, "argmax_change": totals["changed"] / n, "tokens": int(n)}


def _exp(x: float) -> float:
  with np.errstate(over="ignore"):
    return float(np.exp(x))  # inf under a hard ban of a target token: reported as is
