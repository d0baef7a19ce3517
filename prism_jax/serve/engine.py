"""The explorer's model side: one loaded run, a few compiled programs, one worker thread.

Every request's model work goes through `Engine.submit`, a single-thread executor: requests
queue onto the one model in arrival order and a stream's tokens interleave fairly with other
requests (one token per turn). Programs are compiled per length bucket (BUCKETS up to the
model's context), never per prompt: a prompt of n tokens runs in the smallest bucket ≥ n,
right-padded (the model is causal, so the padding cannot reach the positions read).

`next_token` samples and explains through `prism_jax.generate`'s own functions
(`sample_tokens`: temperature, the top-k filter, `jax.random.categorical` with key
fold_in(key(seed), step); `explain_tokens`: the slices and the trust); temperature, top-k,
greedy and the gains are traced values, so one program serves every setting. Gains are always
applied (ones when unsteered): ℓ' = ℓ − Σ_{i∈S_t} (1 − g_i) a_{t,i} W p_i (PRISM.md §6).
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from prism_jax.control.steering import gains_vector
from prism_jax.generate import explain_tokens, sample_tokens
from prism_jax.model.lm import LMOutput
from prism_jax.model.logit_edit import controlled_logits

MIN_BUCKET = 32


def buckets(max_len: int) -> tuple[int, ...]:
  """Padded lengths programs are compiled for: 32, 64, … (doubling), and the context."""
  out, b = [], MIN_BUCKET
  while b < max_len:
    out.append(b)
    b *= 2
  return tuple(out) + (max_len,)


class Step(NamedTuple):
  """One generated token and its explanation (gains applied to contributions)."""

  token: int
  logit: float  # of the sampled token, edited logits
  protos: list[int]
  acts: list[float]  # before gains
  contribs: list[float]  # g_i a_i <W_y, p_i>
  residual: float
  prediction: int  # argmax of the edited logits
  agrees: bool  # argmax W z_hat (gains applied) = prediction
  proto_share: float


def _explained(model, out: LMOutput, edited_NxV, targets_N, gains_K):
  """Per position of a (1, S) forward: generate.explain_tokens' slices and trust, and the
  target's edited logit as their sum."""
  ex = explain_tokens(model, out.protos, edited_NxV, targets_N, gains_K)
  return dict(idx=ex.idx_Nxk, act=ex.act_Nxk, contrib=ex.contrib_Nxk, residual=ex.residual_N,
              logit=ex.residual_N + ex.contrib_Nxk.sum(-1), logit_unedited=ex.logit_unedited_N,
              prediction=ex.top1_N, agrees=ex.agrees_N, share=ex.proto_share_N)


@jax.jit(static_argnames=("graphdef",))
def _next_token(graphdef, state, buf_1xS, last, step, knobs):
  model = nnx.merge(graphdef, state)
  out = model(buf_1xS)
  edited_NxV = controlled_logits(model, out, knobs["gains_K"])[0]
  logits_1xV = edited_NxV[last][None]
  key = jax.random.fold_in(jax.random.key(knobs["seed"]), step)
  sampled = sample_tokens(logits_1xV, key, jnp.maximum(knobs["temperature"], 1e-6),
                          knobs["top_k"])[0]
  tok = jnp.where(knobs["greedy"], jnp.argmax(logits_1xV[0]).astype(jnp.int32), sampled)
  targets = jnp.roll(buf_1xS[0], -1).at[last].set(tok)
  ex = _explained(model, out, edited_NxV, targets, knobs["gains_K"])
  return tok, jax.tree.map(lambda x: x[last], ex)


@jax.jit(static_argnames=("graphdef",))
def _explain_all(graphdef, state, buf_1xS, gains_K):
  model = nnx.merge(graphdef, state)
  out = model(buf_1xS)
  targets = jnp.roll(buf_1xS[0], -1)  # position j explains token j + 1
  return _explained(model, out, controlled_logits(model, out, gains_K)[0], targets, gains_K)


@jax.jit(static_argnames=("graphdef",))
def _usage_counts(graphdef, state, rows_BxT, valid_B):
  """(K,) top-k selections per prototype over the valid rows (padding rows count 0)."""
  model = nnx.merge(graphdef, state)
  idx_BxTk = model(rows_BxT).protos.idx_Nxk.reshape(rows_BxT.shape[0], -1)
  weight = jnp.broadcast_to(valid_B[:, None], idx_BxTk.shape).astype(jnp.int32)
  return jnp.zeros(model.cfg.num_prototypes, jnp.int32).at[idx_BxTk.reshape(-1)].add(
      weight.reshape(-1))


class Engine:
  """The run's model behind one worker thread, with compile accounting."""

  def __init__(self, run):
    self.run, self.cfg = run, run.config.model
    self.graphdef, self.state = nnx.split(run.model)
    self.buckets = buckets(self.cfg.max_len)
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prism-model")
    self._lock = threading.Lock()
    self.submitted = 0  # model jobs asked for: what a refused request must leave unchanged
    protos = np.asarray(run.model.bank.protos[...], np.float64)
    self.unit_protos = protos / np.maximum(np.linalg.norm(protos, axis=1, keepdims=True), 1e-12)

  def submit(self, fn, *args):
    """Runs fn(*args) on the model thread; returns a concurrent future."""
    self.submitted += 1
    return self._pool.submit(fn, *args)

  def close(self):
    self._pool.shutdown(wait=False, cancel_futures=True)

  @staticmethod
  def compiles() -> int:
    """Programs compiled so far by the explorer's jitted functions (all buckets)."""
    return sum(f._cache_size() for f in (_next_token, _explain_all))  # pylint: disable=protected-access

  def bucket(self, n: int) -> int:
    for b in self.buckets:
      if b >= n:
        return b
    raise ValueError(f"{n} tokens exceed the model's context ({self.cfg.max_len})")

  def _padded(self, ids) -> jax.Array:
    buf = np.zeros((1, self.bucket(len(ids))), np.int32)
    buf[0, :len(ids)] = ids
    return jnp.asarray(buf)

  def gains(self, gains: dict[int, float] | None) -> jax.Array:
    """The (K,) gains of a checked {prototype id: gain} (control/steering.gains_vector)."""
    return jnp.asarray(gains_vector(self.cfg.num_prototypes, gains or {}))

  def next_token(self, ids, step: int, *, temperature: float, top_k: int, seed: int,
                 greedy: bool, gains_K) -> Step:
    """Token number `step` of a generation continuing `ids` (prompt + tokens so far)."""
    knobs = dict(temperature=jnp.float32(temperature), top_k=jnp.int32(top_k),
                 seed=jnp.uint32(seed), greedy=jnp.bool_(greedy), gains_K=gains_K)
    tok, ex = _next_token(self.graphdef, self.state, self._padded(ids), jnp.int32(len(ids) - 1),
                          jnp.int32(step), knobs)
    ex = jax.device_get(ex)
    return Step(int(tok), float(ex["logit"]), ex["idx"].tolist(), ex["act"].tolist(),
                ex["contrib"].tolist(), float(ex["residual"]), int(ex["prediction"]),
                bool(ex["agrees"]), float(ex["share"]))

  def explain(self, ids, gains_K) -> dict[str, np.ndarray]:
    """Every token after the first: slices of its (edited) logit, unedited logit, trust."""
    ex = jax.device_get(_explain_all(self.graphdef, self.state, self._padded(ids), gains_K))
    n = len(ids) - 1
    return {k: np.asarray(v)[:n] for k, v in ex.items()}

  def nearest(self, proto_id: int, num: int = 8) -> list[tuple[int, float]]:
    cos = self.unit_protos @ self.unit_protos[proto_id]
    cos[proto_id] = -np.inf
    order = np.argsort(-cos, kind="stable")[:num]
    return [(int(i), float(cos[i])) for i in order]

  def usage(self, rows_NxT: np.ndarray, batch: int = 16) -> np.ndarray:
    """(K,) share of the rows' tokens where each prototype is among the k active."""
    counts = np.zeros(self.cfg.num_prototypes, np.int64)
    rows = np.asarray(rows_NxT, np.int32)
    for s in range(0, len(rows), batch):
      chunk = rows[s:s + batch]
      valid = np.arange(batch) < len(chunk)  # one program: the last chunk padded, not counted
      chunk = np.concatenate([chunk, np.zeros((batch - len(chunk), rows.shape[1]), np.int32)])
      counts += np.asarray(_usage_counts(self.graphdef, self.state, jnp.asarray(chunk),
                                         jnp.asarray(valid)))
    return counts / max(rows.size, 1)
