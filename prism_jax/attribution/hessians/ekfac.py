"""EK-FAC influence over every linear layer of the backbone and the prototype bank.

The baseline PRISM's cached attribution is measured against (PRISM.md §5; Grosse et al. 2023,
George et al. 2018). Conventions follow kronfluence (pomonam/kronfluence):

  * training loss = token cross-entropy *summed* over the valid tokens of a sequence;
    factors use labels sampled from the model (true Fisher) unless `empirical_fisher`;
  * per layer l with input a (bias: a 1 appended) and output-gradient δ:
      A_l = Σ_t a aᵀ / #tokens,  S_l = Σ_t δ δᵀ / #tokens,  A = Q_A diag Q_Aᵀ, S = Q_S diag Q_Sᵀ
    A_l sums over the loss tokens (`mask`), S_l over every non-padding position
    (example_id >= 0): a position outside the loss but inside a document (a document
    start inside a packed row, whose input is the previous document's EOS) still carries
    δ from later tokens' losses. #tokens counts the loss tokens.
      Λ_l = Σ_seq (Q_Sᵀ G_seq Q_A)² / #seq        (eigenvalue correction, G_seq = Σ_t δ aᵀ)
      precondition(G) = Q_S [(Q_Sᵀ G Q_A) / (Λ_l + λ_l)] Q_Aᵀ,  λ_l = 0.1 · mean(Λ_l) default
  * score(q, t) = Σ_l ⟨precondition(G_q), G_t⟩ = ∇L_qᵀ H⁻¹ ∇L_t. **Positive = the training
    sequence helps the query** (a step on it lowers the query loss); it is −I(q,t) in the
    Koh & Liang sign of PRISM.md §5.

This file holds the config, factor fitting, the eigenvalue correction, preconditioning and
scoring. Which layers, and how their inputs a and output-gradients δ are captured (the real
model run with probes), is ekfac_capture.py; its public names (split_model, layer_names,
capture, per_sequence_grads, segment_weights, stream_capture, Capture) are importable from
here too.

Memory-bounded scoring (`ekfac_scores`, default `layerwise`): `stream_capture` chains the
backward by hand one layer group at a time (bank, then blocks last to first), each group a
small program shared by every block, so the peak is one block's programs and per-sequence
gradients plus the query chunk's preconditioned gradients, whatever the depth.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from prism_jax.attribution.hessians.ekfac_capture import (  # public names re-exported
    Batch, Capture, Split, _capture, capture, layer_names, per_sequence_grads, sample_labels,
    segment_weights, split_model, stream_capture)
from prism_jax.data import batch as batch_lib
from prism_jax.model.tap import BLOCK_LAYERS


@dataclasses.dataclass(frozen=True)
class EkfacConfig:
  damping: float | None = None  # None: 0.1 × mean(Λ_l) per layer (kronfluence heuristic)
  include_bank: bool = True  # the prototype bank as a linear layer (PrismLM only)
  empirical_fisher: bool = False  # False: labels sampled from the model for the factors
  seed: int = 0  # label sampling

  def __post_init__(self):
    if self.damping is not None and self.damping < 0:
      raise ValueError(f"ekfac.damping must be >= 0 or None, got {self.damping}")


class Factors(NamedTuple):
  q_a: dict[str, jax.Array]  # (in, in) eigenvectors of A_l
  q_s: dict[str, jax.Array]  # (out, out) eigenvectors of S_l
  lam: dict[str, jax.Array]  # (out, in) corrected eigenvalues Λ_l
  damping: dict[str, jax.Array]  # λ_l actually used (scalars)
  num_tokens: int
  num_sequences: int


_HI = jax.lax.Precision.HIGHEST


@functools.partial(jax.jit, static_argnums=(0, 1))
def _cov_step(graphdef, names, state, cov, tokens_BxT, labels_BxT, mask_BxT, real_BxT):
  """Adds A_l (over the loss tokens `mask`) and S_l (over the non-padding positions
  `real`, kronfluence's convention: see the module docstring) of one batch to `cov`."""
  deltas, acts = _capture(graphdef, names, state, tokens_BxT, labels_BxT, mask_BxT[None])
  m, r = mask_BxT[..., None], real_BxT[..., None]
  new = {n: (jnp.einsum("bti,btj->ij", acts[n] * m, acts[n], precision=_HI),
             jnp.einsum("bti,btj->ij", deltas[n][0] * r, deltas[n][0], precision=_HI))
         for n in names}
  return new if cov is None else jax.tree.map(jnp.add, cov, new)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _lam_step(graphdef, names, state, lam, q_a, q_s, tokens_BxT, labels_BxT, mask_BxT):
  deltas, acts = _capture(graphdef, names, state, tokens_BxT, labels_BxT, mask_BxT[None])
  grads = per_sequence_grads(Capture(acts, deltas))
  out = {}
  for n in names:
    rot = jnp.einsum("om,bmn,ni->boi", q_s[n].T, grads[n][0], q_a[n], precision=_HI)
    out[n] = lam[n] + jnp.sum(rot * rot, 0)
  return out


@jax.jit
def _eigvecs(cov, num_tokens):
  return jax.tree.map(lambda c: jnp.linalg.eigh(c / num_tokens)[1], cov)


def fit_factors(model, batches: Iterable[Batch], cfg: EkfacConfig = EkfacConfig(), *,
                lambda_batches: Iterable[Batch] | None = None, dtype=None) -> Factors:
  """Two streaming passes: covariances → eigenbases, then the eigenvalue correction Λ.

  `batches` is iterated once (pass 1); `lambda_batches` (default: `batches` again, so pass a
  re-iterable) once more. Memory: the factors plus one batch's activations.
  """
  split = split_model(model, dtype)
  names = tuple(layer_names(model, cfg.include_bank))
  key = jax.random.key(cfg.seed)
  fdt = split.dtype

  def args(batch, step):
    tokens = jnp.asarray(batch["inputs"], jnp.int32)
    labels = (jnp.asarray(batch["targets"], jnp.int32) if cfg.empirical_fisher else
              sample_labels(split, tokens, jax.random.fold_in(key, step)))
    return tokens, labels, jnp.asarray(batch["mask"], fdt)

  cov, num_tokens = None, 0
  for step, batch in enumerate(batches):
    if "example_id" not in batch:
      raise ValueError("fit_factors needs the batch's example_id (-1 on padding) to tell "
                       "padding from positions outside the loss")
    real = jnp.asarray(np.asarray(batch["example_id"]) >= 0, fdt)
    cov = _cov_step(split.graphdef, names, split.state, cov, *args(batch, step), real)
    num_tokens += int(np.asarray(batch["mask"]).sum())
  if cov is None or num_tokens == 0:
    raise ValueError("fit_factors got no valid training tokens")
  q_a = _eigvecs({n: c[0] for n, c in cov.items()}, num_tokens)
  q_s = _eigvecs({n: c[1] for n, c in cov.items()}, num_tokens)
  del cov

  lam = {n: jnp.zeros((q_s[n].shape[0], q_a[n].shape[0]), fdt) for n in names}
  num_seq = 0
  for step, batch in enumerate(batches if lambda_batches is None else lambda_batches):
    lam = _lam_step(split.graphdef, names, split.state, lam, q_a, q_s, *args(batch, step))
    num_seq += int(np.asarray(batch["mask"]).shape[0])
  lam = {n: v / num_seq for n, v in lam.items()}
  damping = {n: (0.1 * jnp.mean(lam[n]) if cfg.damping is None
                 else jnp.asarray(cfg.damping, fdt)) for n in names}
  return Factors(q_a, q_s, lam, damping, num_tokens, num_seq)


@jax.jit
def _precondition(q_a, q_s, lam, damping, grads):
  out = {}
  for n, g in grads.items():
    rot = jnp.einsum("om,...mn,ni->...oi", q_s[n].T, g, q_a[n], precision=_HI)
    rot = rot / (lam[n] + damping[n])
    out[n] = jnp.einsum("mo,...oi,ni->...mn", q_s[n], rot, q_a[n], precision=_HI)
  return out


def precondition(factors: Factors, grads: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
  """Q_S [(Q_Sᵀ G Q_A) / (Λ + λ)] Q_Aᵀ for gradients (..., out, in)."""
  grads = dict(grads)
  sub = lambda d: {n: d[n] for n in grads}
  return _precondition(sub(factors.q_a), sub(factors.q_s), sub(factors.lam),
                       sub(factors.damping), grads)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _query_step(graphdef, names, state, q_a, q_s, lam, damping, tokens_BxT, labels_BxT,
                mask_BxT):
  deltas, acts = _capture(graphdef, names, state, tokens_BxT, labels_BxT, mask_BxT[None])
  grads = {n: g[0] for n, g in per_sequence_grads(Capture(acts, deltas)).items()}
  return _precondition(q_a, q_s, lam, damping, grads)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _score_step(graphdef, names, state, pre_q, tokens_BxT, labels_BxT, weight_SxBxT):
  deltas, acts = _capture(graphdef, names, state, tokens_BxT, labels_BxT, weight_SxBxT)
  grads = per_sequence_grads(Capture(acts, deltas))
  return sum(jnp.einsum("qoi,sboi->qsb", pre_q[n], grads[n], precision=_HI) for n in names)


# Layerwise scoring: per layer group of `stream_capture` (ekfac_capture.py).
@jax.jit
def _group_precondition(q_a, q_s, lam, damping, acts, deltas):
  grads = {n: g[0] for n, g in per_sequence_grads(Capture(acts, deltas)).items()}
  return _precondition(q_a, q_s, lam, damping, grads)


@jax.jit
def _group_score(pre_q, acts, deltas):
  grads = per_sequence_grads(Capture(acts, deltas))
  return sum(jnp.einsum("qoi,sboi->qsb", pre_q[n], grads[n], precision=_HI) for n in grads)


def _local(name):
  return name.split(".")[-1]


def _query_layerwise(split, names, fac, tokens_BxT, labels_BxT, mask_BxT):
  """Preconditioned query gradients, group by group: {group: {local name: (Q, out, in)}}."""
  pre = {}
  for group, cap in stream_capture(split, names, tokens_BxT, labels_BxT, mask_BxT[None]):
    if not set(group) <= set(names):  # a block left out of `layers`
      continue
    sub = [{_local(n): d[n] for n in group} for d in fac]
    pre[group] = _group_precondition(*sub, cap.acts, cap.deltas)
  return pre


def _query_whole(split, names, fac, tokens_BxT, labels_BxT, mask_BxT):
  return _query_step(split.graphdef, names, split.state, *fac, tokens_BxT, labels_BxT,
                     mask_BxT)


def _score_whole(split, names, pre_q, tokens_BxT, labels_BxT, weight_SxBxT):
  return _score_step(split.graphdef, names, split.state, pre_q, tokens_BxT, labels_BxT,
                     weight_SxBxT)


def _score_layerwise(split, names, pre_q, tokens_BxT, labels_BxT, weight_SxBxT):
  total = 0.0
  for group, cap in stream_capture(split, names, tokens_BxT, labels_BxT, weight_SxBxT):
    if group in pre_q:
      total = total + _group_score(pre_q[group], cap.acts, cap.deltas)
  return total


def _row_chunks(batch: Batch, rows: int | None):
  """Splits a batch into `rows`-row chunks; a short (last) chunk is padded (mask False, ids
  -1) so that one compiled shape serves every chunk. rows=None: the batch as it is."""
  num = np.asarray(batch["inputs"]).shape[0]
  if rows is None or num == rows:
    yield batch
    return
  for start in range(0, num, rows):
    yield batch_lib.pad_batch({k: np.asarray(v)[start:start + rows] for k, v in batch.items()},
                              rows)


def ekfac_scores(model, factors: Factors, query: Batch, train_batches, *,
                 cfg: EkfacConfig = EkfacConfig(), query_batch_size: int | None = None,
                 train_batch_size: int | None = None, layerwise: bool = True,
                 by_example: bool = True, dtype=None,
                 layers=None) -> tuple[np.ndarray, np.ndarray]:
  """Influence of every training sequence on every query row: (Q, E) scores and E ids.

  Query rows are processed `query_batch_size` at a time, each chunk streaming over
  `train_batches` (a re-iterable or a zero-argument callable returning an iterable) once,
  `train_batch_size` rows at a time (default: as the batches come): memory ∝
  (query_batch_size + train rows) × #params, time ∝ #chunks — kronfluence's trade-off.
  `layerwise` (default) backpropagates one layer group at a time (`stream_capture`), so
  neither the whole model's backward program nor all layers' per-sequence gradients are
  held at once, and captures query rows `train_batch_size` at a time too; False runs the
  whole capture as one program (same scores).
  Sequences are documents (example ids) when `by_example`, else rows (row ids).
  The query loss is the summed CE over `query["mask"]`, the same convention as training.
  `layers` (names of layer_names, whole blocks: "bank", "block{i}.*") restricts the score to
  those layers' terms of Σ_l (the parameter-group LDS of issue 55); None: every layer.
  """
  split = split_model(model, dtype)
  names = tuple(layer_names(model, cfg.include_bank))
  if layers is not None:
    unknown = sorted(set(layers) - set(names))
    if unknown or not layers:
      raise ValueError(f"ekfac layers {unknown or '()'}: choose among {names}")
    names = tuple(n for n in names if n in set(layers))
    blocks = {n.split(".")[0] for n in names if n != "bank"}
    partial = sorted(b for b in blocks if not all(f"{b}.{n}" in names for n in BLOCK_LAYERS))
    if partial:
      raise ValueError(f"ekfac layers: give whole blocks, not part of {partial}")
  num_q = np.asarray(query["inputs"]).shape[0]
  qbs = num_q if query_batch_size is None else int(query_batch_size)
  if qbs <= 0:
    raise ValueError(f"query_batch_size must be positive, got {query_batch_size}")
  if train_batch_size is not None and train_batch_size <= 0:
    raise ValueError(f"train_batch_size must be positive, got {train_batch_size}")
  fdt = split.dtype
  fac = [{n: d[n] for n in names} for d in (factors.q_a, factors.q_s, factors.lam,
                                           factors.damping)]
  query_fn, score_fn = ((_query_layerwise, _score_layerwise) if layerwise else
                        (_query_whole, _score_whole))
  scores: dict[int, np.ndarray] = {}
  for start in range(0, num_q, qbs):
    sl = slice(start, start + qbs)
    chunk = {k: np.asarray(query[k])[sl] for k in ("inputs", "targets", "mask")}
    # Layerwise, the query rows are captured train_batch_size at a time (padded): the same
    # compiled programs as the training side, and only the preconditioned gradients grow.
    parts = [query_fn(split, names, fac, jnp.asarray(c["inputs"], jnp.int32),
                      jnp.asarray(c["targets"], jnp.int32), jnp.asarray(c["mask"], fdt))
             for c in _row_chunks(chunk, train_batch_size if layerwise else None)]
    pre_q = jax.tree.map(lambda *x: jnp.concatenate(x)[:len(chunk["inputs"])], *parts)
    del parts
    batches = train_batches() if callable(train_batches) else train_batches
    for big in batches:
      for batch in _row_chunks(big, train_batch_size):
        weights, seg_ids = segment_weights(batch, by_example)
        s_QxSxB = np.asarray(score_fn(split, names, pre_q,
                                      jnp.asarray(batch["inputs"], jnp.int32),
                                      jnp.asarray(batch["targets"], jnp.int32),
                                      jnp.asarray(weights, fdt)))
        for (s, b), e in np.ndenumerate(seg_ids):
          if e < 0:
            continue
          if e not in scores:
            scores[int(e)] = np.zeros(num_q, np.float64)
          scores[int(e)][sl] += s_QxSxB[:, s, b]
    del pre_q
  ids = np.asarray(sorted(scores), np.int64)
  return np.stack([scores[e] for e in ids], 1) if len(ids) else np.zeros((num_q, 0)), ids
