"""KV-cache sampling for PrismLM and DenseLM, with per-token prototype traces and control.

    out = generate(model, prompt_BxP, max_new_tokens=32, temperature=0.8, top_k=40, seed=0)
    out.tokens_BxL           generated ids (L = max_new_tokens; EOS-filled after a stop)
    out.trace.contrib_BxLxk  PRISM: a_{t,i} <W_y, p_i> for the sampled token y

The prompt is prefilled into the cache (positions 0..P-1), then one token is decoded per
step. The whole loop is one jitted `lax.while_loop` (`loop="device"`, the default: no host
round trip per token, stops early once every row hit EOS); `loop="host"` drives the same
jitted step from Python with a host sync per token (benchmarks/bench_generate.py compares
them). Either compiles once per model, batch size, prompt length, max_new_tokens and
static choice (greedy or not, top_k, top_p on/off, cache, gains, hook); temperature, top_p,
eos_id, seed and gains are traced, so changing them reuses the program.
`use_cache=False` is the uncached reference: every step recomputes the whole fixed-size
buffer (causal, so the not yet written tail cannot leak into the position being read).

Prompts are a batch of equal length; a ragged batch is rejected (positions double as
cache slots, so left padding would shift them): generate ragged prompts in separate calls.
For PRISM every generated token records its k active prototypes, their activations, the
contributions to the sampled token's logit and the residual slice; they sum to
`logit_BxL` (PRISM.md §1).

Control (PRISM.md §6): `proto_gain_K` scales each prototype's share of the logits,
    ℓ' = ℓ − Σ_{i∈S_t} (1 − g_i) a_{t,i} W p_i,
keeping r_t from the unedited pass (`prism_jax.model.logit_edit.controlled_logits`, the
edit a teacher-forced scorer uses too); `control.steering.suppression_gains(K, ids)` gives
g = 0 on a set G (suppression); g_i = 1 + w_i is the gain controller ℓ' = ℓ + Σ_i w_i a W p_i.
Contributions are reported after the gains, so they still sum with the residual to the
logit that was sampled from. Each token's trust (prism_jax/model/trust.py) is that of the
step's edited logits: whether argmax W z_hat (gains applied) is the model's top-1 and the
prototypes' share of the top-1's lead over the runner-up.
`logit_hook(logits_BxV, protos) -> logits_BxV` is applied last (e.g. banning tokens); the
trace decomposes the logit before the hook.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from prism_jax.model.lm import DenseLM, LMOutput, PrismLM, decompose
from prism_jax.model.logit_edit import controlled_logits, edited_trust
from prism_jax.model.prototypes import PrototypeOutput
from prism_jax.model.token_ids import check_token_ids

LogitHook = Callable[[jax.Array, PrototypeOutput | None], jax.Array]

# What user-facing generation samples with unless asked for greedy (the demo, `prism
# generate` / `report` / `attribute`, the report's Python API): greedy decoding of a small
# model loops (" statements" eight times), a seeded sample reads. `generate` itself stays
# greedy by default: a low-level call states what it wants.
SAMPLING = {"temperature": 0.8, "top_k": 40, "seed": 0}


def sampling_label(temperature: float, top_k: int | None, seed: int) -> str:
  """"greedy" or "temperature 0.8, top-k 40, seed 0": how a text was generated."""
  if temperature == 0:
    return "greedy"
  return f"temperature {temperature:g}, top-k {top_k or 'off'}, seed {seed}"


class TokenTrace(NamedTuple):
  """Per generated token of a PrismLM: its active prototypes and the logit decomposition."""

  idx_BxLxk: np.ndarray  # active prototype ids, by decreasing similarity
  act_BxLxk: np.ndarray  # activations a_{t,i} (before any gain)
  contrib_BxLxk: np.ndarray  # g_i a_{t,i} <W_y, p_i> for the sampled token y
  residual_BxL: np.ndarray  # <W_y, r_t>
  proto_top1_BxL: np.ndarray  # int32, argmax W z_hat at the step (gains applied)
  agrees_BxL: np.ndarray  # bool, argmax W z_hat = argmax W z: the prototypes pick the top-1
  proto_share_BxL: np.ndarray  # the prototypes' share of the top-1's lead (model/trust.py)


class GenerationOutput(NamedTuple):
  tokens_BxL: np.ndarray  # int32; after a row's EOS the row is filled with EOS
  lengths_B: np.ndarray  # generated tokens per row, EOS included
  logit_BxL: np.ndarray  # logit of each sampled token (after gains, before logit_hook)
  trace: TokenTrace | None  # None for DenseLM; zeros after a row stopped


@dataclasses.dataclass(frozen=True)
class _Spec:
  """Everything static about one generate call (hashable: part of the jit cache key)."""

  max_new_tokens: int
  sample: bool  # False: greedy argmax
  top_k: int | None
  use_top_p: bool
  use_cache: bool
  use_gains: bool
  logit_hook: LogitHook | None


def top_k_filter(logits_BxV: jax.Array, top_k: int | jax.Array) -> jax.Array:
  """Sets logits below the k-th largest of their row to the dtype's min (ties at the cut all
  kept). `top_k` is a Python int (lax.top_k) or a traced integer scalar, clipped to [1, V]
  (a sort: one program serves every k, as the explorer's does)."""
  if isinstance(top_k, (int, np.integer)):
    kth_B = jax.lax.top_k(logits_BxV, int(top_k))[0].min(-1, keepdims=True)  # not [..., -1:]
  else:
    k = jnp.clip(top_k, 1, logits_BxV.shape[-1])
    kth_B = jnp.take(jnp.sort(logits_BxV, axis=-1)[..., ::-1], k - 1, axis=-1)[..., None]
  return jnp.where(logits_BxV < kth_B, jnp.finfo(logits_BxV.dtype).min, logits_BxV)


def filter_logits(logits_BxV: jax.Array, top_k: int | jax.Array | None,
                  top_p: float | jax.Array) -> jax.Array:
  """Sets logits outside the top-k / nucleus (top-p) to -inf. Ties at a cut are all kept.

  The nucleus is the smallest set of most likely tokens whose probability reaches top_p.
  `top_k` may be traced (`top_k_filter`).
  """
  neg_inf = jnp.finfo(logits_BxV.dtype).min
  if top_k is not None:
    logits_BxV = top_k_filter(logits_BxV, top_k)
  if not isinstance(top_p, (int, float)) or top_p < 1.0:
    sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
    probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
    mass_before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
    keep_BxV = mass_before_BxV < top_p  # the first token is always kept
    cut_B = jnp.min(jnp.where(keep_BxV, sorted_BxV, jnp.inf), axis=-1, keepdims=True)
    logits_BxV = jnp.where(logits_BxV < cut_B, neg_inf, logits_BxV)
  return logits_BxV


def sample_tokens(logits_BxV: jax.Array, key: jax.Array, temperature: float | jax.Array,
                  top_k: int | jax.Array | None = None, top_p: float | jax.Array = 1.0
                  ) -> jax.Array:
  """(B,) int32 tokens drawn from softmax(filter_logits(logits / temperature)) with `key`
  (temperature > 0; greedy is argmax). Traced knobs reuse one program."""
  logits_BxV = filter_logits(logits_BxV / temperature, top_k, top_p)
  return jax.random.categorical(key, logits_BxV, axis=-1).astype(jnp.int32)


def _sample(logits_BxV, key, knobs, spec: _Spec):
  if not spec.sample:
    return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
  return sample_tokens(logits_BxV, key, knobs["temperature"], spec.top_k,
                       knobs["top_p"] if spec.use_top_p else 1.0)


class Explained(NamedTuple):
  """Tokens' (edited) logits explained (`explain_tokens`), one row per token."""

  idx_Nxk: jax.Array  # active prototype ids
  act_Nxk: jax.Array  # activations a_{t,i}, before gains
  contrib_Nxk: jax.Array  # g_i a_{t,i} <W_y, p_i> for the token y
  residual_N: jax.Array  # <W_y, r_t>
  logit_unedited_N: jax.Array  # the token's logit without the gains
  proto_top1_N: jax.Array  # argmax W z_hat (gains applied)
  agrees_N: jax.Array  # the prototype path picks the (edited) logits' top-1
  proto_share_N: jax.Array  # the prototypes' share of the top-1's lead (model/trust.py)
  top1_N: jax.Array  # argmax of the (edited) logits: the model's prediction


def explain_tokens(model: PrismLM, protos: PrototypeOutput, logits_NxV: jax.Array,
                   tokens_N: jax.Array, gains_K: jax.Array | None = None) -> Explained:
  """The slices of each token's logit and the trust of `logits_NxV` (the edited logits when
  `gains_K` is given, `controlled_logits` with those gains): the sampler's trace and the
  explorer's explanations. The slices sum with the residual to the edited logit."""
  dec = decompose(model, protos, tokens_N)
  contrib_Nxk = dec.contrib_Nxk if gains_K is None else dec.contrib_Nxk * gains_K[dec.idx_Nxk]
  # W z_hat with the gains: the prototype path of the logits that were sampled from
  trust = edited_trust(model, protos, logits_NxV, gains_K)
  return Explained(dec.idx_Nxk, protos.act_Nxk, contrib_Nxk, dec.residual_N, dec.logit_N,
                   trust.proto_top1_N, trust.agrees_N, trust.proto_share_N, trust.top1_N)


def _rows(protos: PrototypeOutput, rows_B: jax.Array) -> PrototypeOutput:
  """The per-token fields of `protos` at flat token rows (column statistics kept)."""
  take = lambda x: x[rows_B]
  return protos._replace(idx_Nxk=take(protos.idx_Nxk), act_Nxk=take(protos.act_Nxk),
                         sim_Nxk=take(protos.sim_Nxk), z_hat_NxD=take(protos.z_hat_NxD),
                         residual_NxD=take(protos.residual_NxD),
                         row_max_cos_N=take(protos.row_max_cos_N),
                         row_min_dist_N=take(protos.row_min_dist_N))


def _forward_at(model, tokens_BxT, positions_BxT, caches, at):
  """Logits (B, V) and prototypes (B rows) at sequence index `at` of this chunk."""
  out = model(tokens_BxT, positions_BxT, caches=caches)
  batch, seq = tokens_BxT.shape
  logits_BxV = jax.lax.dynamic_index_in_dim(out.logits_BxTxV, at, axis=1, keepdims=False)
  protos = None
  if out.protos is not None:
    protos = _rows(out.protos, jnp.arange(batch) * seq + at)
  return logits_BxV, protos, out.caches


def _pick(model, logits_BxV, protos, key, knobs, spec: _Spec):
  """Applies gains and hook, samples, and decomposes the sampled token's logit."""
  if spec.use_gains:
    unedited = LMOutput(logits_BxV[:, None], None, protos)  # the decoded rows, T = 1
    logits_BxV = controlled_logits(model, unedited, knobs["gains_K"])[:, 0]
  hooked_BxV = logits_BxV if spec.logit_hook is None else spec.logit_hook(logits_BxV, protos)
  tok_B = _sample(hooked_BxV, key, knobs, spec)
  logit_B = jnp.take_along_axis(logits_BxV, tok_B[:, None], axis=-1)[:, 0]
  if protos is None:
    return tok_B, logit_B, None
  ex = explain_tokens(model, protos, logits_BxV, tok_B,
                      knobs["gains_K"] if spec.use_gains else None)
  return tok_B, logit_B, (ex.idx_Nxk, ex.act_Nxk, ex.contrib_Nxk, ex.residual_N,
                          ex.proto_top1_N, ex.agrees_N, ex.proto_share_N)


def _write(carry, tok_B, logit_B, row, caches, knobs, prompt_len: int):
  """Stores step t's token, logit and trace; rows that already stopped keep EOS and zeros."""
  t, done_B = carry["t"], carry["done_B"]
  eos = knobs["eos_id"]  # -1: none
  tok_B = jnp.where(done_B, jnp.maximum(eos, 0), tok_B)
  put = lambda buf, x: buf.at[:, t].set(
      jnp.where(done_B.reshape((-1,) + (1,) * (x.ndim - 1)), jnp.zeros_like(x), x))
  new = dict(carry, t=t + 1, caches=caches, lengths_B=carry["lengths_B"] + (~done_B),
             logit_BxL=put(carry["logit_BxL"], logit_B))
  new["buf_BxS"] = jax.lax.dynamic_update_slice_in_dim(carry["buf_BxS"], tok_B[:, None],
                                                       prompt_len + t, axis=1)
  if row is not None:
    new["trace"] = tuple(put(buf, x) for buf, x in zip(carry["trace"], row))
  new["done_B"] = done_B | (tok_B == eos)
  return new


def _full_positions(batch: int, seq: int) -> jax.Array:
  return jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))


def _step(model, carry, key, knobs, spec: _Spec, prompt_len: int):
  """Generates token t (t = carry["t"] >= 1 cached; any t uncached)."""
  t, buf_BxS = carry["t"], carry["buf_BxS"]
  batch, seq = buf_BxS.shape
  last = prompt_len + t - 1  # buffer index of the newest token: its logits give token t
  if spec.use_cache:
    tok_Bx1 = jax.lax.dynamic_slice_in_dim(buf_BxS, last, 1, axis=1)
    pos_Bx1 = jnp.full((batch, 1), last, jnp.int32)
    logits_BxV, protos, caches = _forward_at(model, tok_Bx1, pos_Bx1, carry["caches"], 0)
  else:
    logits_BxV, protos, caches = _forward_at(model, buf_BxS, _full_positions(batch, seq),
                                             None, last)
  tok_B, logit_B, row = _pick(model, logits_BxV, protos, jax.random.fold_in(key, t),
                              knobs, spec)
  return _write(carry, tok_B, logit_B, row, caches, knobs, prompt_len)


def _prefill(model, prompt_BxP, key, knobs, spec: _Spec):
  """Initial buffers, then token 0 (cached: the prompt goes through the cache in one go)."""
  batch, prompt_len = prompt_BxP.shape
  steps, k = spec.max_new_tokens, model.cfg.k
  # The generated part starts as EOS: a loop that stops early (all rows done) leaves it so.
  fill = jnp.maximum(knobs["eos_id"], 0)
  buf_BxS = jnp.full((batch, prompt_len + steps), fill, jnp.int32).at[:, :prompt_len].set(
      prompt_BxP)
  carry = dict(t=jnp.int32(0), buf_BxS=buf_BxS, caches=None,
               done_B=jnp.zeros(batch, bool), lengths_B=jnp.zeros(batch, jnp.int32),
               logit_BxL=jnp.zeros((batch, steps), jnp.float32), trace=None)
  if isinstance(model, PrismLM):
    carry["trace"] = (jnp.zeros((batch, steps, k), jnp.int32),
                      jnp.zeros((batch, steps, k), jnp.float32),
                      jnp.zeros((batch, steps, k), jnp.float32),
                      jnp.zeros((batch, steps), jnp.float32),
                      jnp.zeros((batch, steps), jnp.int32),
                      jnp.zeros((batch, steps), bool),
                      jnp.zeros((batch, steps), jnp.float32))
  if not spec.use_cache:
    return _step(model, carry, key, knobs, spec, prompt_len)
  logits_BxV, protos, caches = _forward_at(
      model, prompt_BxP, _full_positions(batch, prompt_len), model.init_cache(batch),
      prompt_len - 1)
  tok_B, logit_B, row = _pick(model, logits_BxV, protos, jax.random.fold_in(key, 0),
                              knobs, spec)
  return _write(carry, tok_B, logit_B, row, caches, knobs, prompt_len)


def _unfinished(carry, spec: _Spec):
  return (carry["t"] < spec.max_new_tokens) & ~jnp.all(carry["done_B"])


@jax.jit(static_argnames=("graphdef", "spec"))
def _generate_device(graphdef, state, prompt_BxP, key, knobs, spec: _Spec):
  model = nnx.merge(graphdef, state)
  carry = _prefill(model, prompt_BxP, key, knobs, spec)
  body = lambda c: _step(model, c, key, knobs, spec, prompt_BxP.shape[1])
  return jax.lax.while_loop(lambda c: _unfinished(c, spec), body, carry)


@jax.jit(static_argnames=("graphdef", "spec"))
def _prefill_host(graphdef, state, prompt_BxP, key, knobs, spec: _Spec):
  return _prefill(nnx.merge(graphdef, state), prompt_BxP, key, knobs, spec)


@jax.jit(static_argnames=("graphdef", "spec", "prompt_len"), donate_argnames=("carry",))
def _step_host(graphdef, state, carry, key, knobs, spec: _Spec, prompt_len: int):
  return _step(nnx.merge(graphdef, state), carry, key, knobs, spec, prompt_len)


def _as_prompt(prompt, vocab_size: int) -> jax.Array:
  if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], (list, tuple)):
    lengths = sorted({len(p) for p in prompt})
    if len(lengths) > 1:
      raise ValueError(f"prompts in a batch must have equal length, got lengths {lengths}; "
                       "generate ragged prompts in separate calls")
  arr = np.asarray(prompt)
  if arr.ndim == 1:
    arr = arr[None]
  if arr.ndim != 2 or arr.shape[1] == 0 or arr.shape[0] == 0:
    raise ValueError(f"prompt must be a non-empty (B, P) batch of token ids, got shape "
                     f"{arr.shape}")
  arr = check_token_ids(arr, vocab_size, "prompt token ids")
  return jnp.asarray(arr, jnp.int32)


def generate(model: PrismLM | DenseLM, prompt, *, max_new_tokens: int = 32,
             temperature: float = 0.0, top_k: int | None = None, top_p: float = 1.0,
             eos_id: int | None = None, seed: int | jax.Array = 0, use_cache: bool = True,
             proto_gain_K: jax.Array | None = None, logit_hook: LogitHook | None = None,
             loop: Literal["device", "host"] = "device") -> GenerationOutput:
  """Samples `max_new_tokens` after `prompt` ((B, P) ids or a list of equal-length lists).

  temperature 0 is greedy (argmax); otherwise logits / temperature are filtered by `top_k`
  and `top_p` and sampled with a key derived from `seed` (an int or a PRNG key) and the
  step index, so a fixed seed reproduces the same tokens. Stops a row at `eos_id`.
  """
  cfg = model.cfg
  prompt_BxP = _as_prompt(prompt, cfg.vocab_size)
  if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
  total = prompt_BxP.shape[1] + max_new_tokens
  if total > cfg.max_len:
    raise ValueError(f"prompt length {prompt_BxP.shape[1]} + max_new_tokens "
                     f"{max_new_tokens} = {total} exceeds model.max_len={cfg.max_len}")
  if not temperature >= 0.0:
    raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
  if top_k is not None and not 1 <= top_k <= cfg.vocab_size:
    raise ValueError(f"top_k must be in [1, vocab_size={cfg.vocab_size}], got {top_k}")
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p must be in (0, 1], got {top_p}")
  if eos_id is not None and not 0 <= eos_id < cfg.vocab_size:
    raise ValueError(f"eos_id={eos_id} is outside the vocabulary [0, {cfg.vocab_size})")
  if loop not in ("device", "host"):
    raise ValueError(f"loop={loop!r}; use 'device' or 'host'")
  if proto_gain_K is not None:
    if not isinstance(model, PrismLM):
      raise ValueError("proto_gain_K needs a PrismLM: the dense model has no prototypes")
    proto_gain_K = jnp.asarray(proto_gain_K, jnp.float32)
    if proto_gain_K.shape != (cfg.num_prototypes,):
      raise ValueError(f"proto_gain_K must have shape (K,)=({cfg.num_prototypes},), got "
                       f"{proto_gain_K.shape}")
  key = jax.random.key(int(seed)) if isinstance(seed, (int, np.integer)) else seed
  # Static choices pick the program; the knobs are traced, so changing them reuses it.
  spec = _Spec(max_new_tokens, temperature > 0.0, top_k, top_p < 1.0, use_cache,
               proto_gain_K is not None, logit_hook)
  knobs = dict(temperature=jnp.float32(temperature), top_p=jnp.float32(top_p),
               eos_id=jnp.int32(-1 if eos_id is None else eos_id),
               gains_K=jnp.ones((1,), jnp.float32) if proto_gain_K is None else proto_gain_K)
  graphdef, state = nnx.split(model)
  if loop == "device":
    carry = _generate_device(graphdef, state, prompt_BxP, key, knobs, spec)
  else:
    carry = _prefill_host(graphdef, state, prompt_BxP, key, knobs, spec)
    while bool(_unfinished(carry, spec)):
      carry = _step_host(graphdef, state, carry, key, knobs, spec, prompt_BxP.shape[1])
  prompt_len = prompt_BxP.shape[1]
  trace = None
  if carry["trace"] is not None:
    trace = TokenTrace(*(np.asarray(x) for x in carry["trace"]))
  return GenerationOutput(np.asarray(carry["buf_BxS"][:, prompt_len:]),
                          np.asarray(carry["lengths_B"]), np.asarray(carry["logit_BxL"]),
                          trace)
