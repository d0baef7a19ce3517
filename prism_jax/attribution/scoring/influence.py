"""Attribute a prediction to training sequences: cached PRISM scores and the full reference.

PRISM.md §5 steps 2–3. A query is the summed token loss at `target_positions` of a token
sequence (position p: the model predicts tokens[p] from tokens[:p]). One forward pass gives
its active prototypes S_q, activations a_q and g_q = ∂ℓ_q/∂ẑ_q. With the bank's curvature
in G's eigenbasis, G = U E Uᵀ and ĝ = U_rᵀ g, the block of prototype i is
H_ii = A_ii G + μ_i I + λ I, so

    score(q, t) = Σ_{i∈S_q∩S_t} a_{q,i} a_{t,i} Σ_j ĝ_{q,j} ĝ_{t,j} / (A_ii e_j + μ_i + λ)
                = ∇_P ℓ_qᵀ H⁻¹ ∇_P ℓ_t   (linear-layer gradients a gᵀ),

summed over a sequence's tokens (kronfluence's summed-loss convention). **Sign: positive =
the training sequence helps the query** (kronfluence's convention; PRISM.md's
I(q,t) = −score). λ = damping_ratio × mean_{i,j}(A_ii e_j + μ_i) (0.1, like EK-FAC's default;
0 gives the bare §5 formula). coupling="co_usage" keeps A's off-diagonal blocks: for each
eigen-direction j it solves (e_j A + diag μ + λ I) x_j = b_j over all K prototypes.

Cost per query (block-diagonal): one forward pass, then for each i ∈ S_q one pass over
prototype i's inverted-index list: its tokens' cached g rows are gathered in cache-sized
chunks and dotted with x_i = H_ii⁻¹ b_i in float64 (AttributionCache.g_dot); sequence scores,
the ranking, breakdowns and snippets are a few bincounts. `attribute_batch` runs many queries'
forwards in one compiled call (rows of a lax.map, so a query's result does not depend on
what it is batched with) and then scores each query; `attribute` is a batch of one.

The full prototype-space reference (exact autodiff gradients w.r.t. P, no cache records) is
`influence_full.full_scores`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterator, Literal, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from prism_jax import generate as gen
from prism_jax.attribution.caching import cache as cache_lib
from prism_jax.attribution.hessians import curvature as cv
from prism_jax.config import LossConfig
from prism_jax.data import batch as batch_lib
from prism_jax.model.token_ids import check_token_ids

# What the attribution cache scores, as every surface names it (Run.attribute, prism
# attribute, the report, the explorer). It is the best method the cache supports: the
# whole-model methods that score higher on LDS (EK-FAC, ekfac_cached; docs/RESULTS.md "Where
# EK-FAC's signal lives") need every parameter's gradient per training row, which the
# cache, holding the bank's alone, does not keep.
METHOD = "prism"  # its name in the methods registry (prism_jax.attribution.quality.methods)
METHOD_LABEL = ("cached PRISM: prototype-space influence from the attribution cache "
                "(PRISM.md §5)")


@dataclasses.dataclass(frozen=True)
class InfluenceConfig:
  coupling: Literal["block_diagonal", "co_usage"] = "block_diagonal"
  damping_ratio: float = 0.1
  max_per_proto: int | None = None  # keep the top-M tokens (by activation) per prototype
  top: int = 10  # ranked sequences returned
  snippet_width: int = 16
  unit: Literal["document", "row"] = "document"  # a training sequence: document | packed row

  def __post_init__(self):
    if self.unit not in ("document", "row"):
      raise ValueError(f"unit={self.unit!r}; use 'document' (example id) or 'row'")
    if self.coupling not in ("block_diagonal", "co_usage"):
      raise ValueError(f"coupling={self.coupling!r}; use 'block_diagonal' or 'co_usage'")
    if self.damping_ratio < 0:
      raise ValueError(f"damping_ratio must be >= 0, got {self.damping_ratio}")


class Attribution(NamedTuple):
  example_ids: np.ndarray  # ranked training sequences (documents, or rows if unit="row")
  scores: np.ndarray  # their scores (positive = helps the query)
  snippets: list[str]  # text around each sequence's highest-scoring token ('' w/o data)
  breakdown: list[dict[int, float]]  # per sequence: prototype id -> its share of the score
  query_protos: np.ndarray  # the union of the query's active prototypes
  all_ids: np.ndarray  # every scored sequence (sorted by id) ...
  all_scores: np.ndarray  # ... and its score, for retention / overlap metrics


class QuerySide(NamedTuple):
  idx_Qxk: np.ndarray
  act_Qxk: np.ndarray
  g_QxD: np.ndarray


def _query_row(tokens, target_positions, max_len, vocab_size):
  """(tokens padded to max_len + 1, prediction columns) of one query, validated."""
  tokens = check_token_ids(tokens, vocab_size, "query token ids").astype(np.int32).reshape(-1)
  pos = np.asarray(target_positions, np.int64).reshape(-1)
  if len(pos) == 0:
    raise ValueError("target_positions is empty: give at least one position to attribute")
  if pos.min() < 1 or pos.max() >= len(tokens):
    raise ValueError(f"target positions must be in [1, {len(tokens) - 1}] (position p is "
                     f"the prediction of tokens[p] from tokens[:p]); got {pos.tolist()}")
  if len(tokens) - 1 > max_len:
    raise ValueError(f"query of {len(tokens) - 1} inputs exceeds model.max_len={max_len}")
  # Pad to max_len (causal: the tail cannot change earlier positions) so that one compiled
  # program serves every query length.
  padded = np.zeros(max_len + 1, np.int32)
  padded[:len(tokens)] = tokens
  return padded, pos - 1


def query_batch(tokens, target_positions, max_len, vocab_size):
  """The (1, max_len) batch of one query (mask on its target positions) and its columns."""
  padded, cols = _query_row(tokens, target_positions, max_len, vocab_size)
  return batch_lib.next_token(padded[None], np.isin(np.arange(max_len), cols)[None]), cols


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("model_cfg", "loss_cfg"))
def _query_outputs(graphdef, state, inputs_BxT, targets_BxT, mask_BxT, *, model_cfg,
                   loss_cfg):
  """Forward + output gradients of each row, one row at a time (lax.map). A batched forward
  is a different program whose float32 results differ in the last bits with the batch size
  (measured: 1e-5 relative in scores after preconditioning); the loop body is the same for
  every batch size, so a query's attribution does not depend on what it was batched with."""
  model = nnx.merge(graphdef, state)

  def one(row):
    inputs_1xT, targets_1xT, mask_1xT = (a[None] for a in row)
    z_TxD = model.backbone(inputs_1xT)[0].reshape(-1, model.cfg.d_model)
    head = cv.head_constants(model, z_TxD, targets_1xT.reshape(-1), mask_1xT.reshape(-1),
                             z_TxD.dtype)
    return cv.output_grads_from_head(head, model_cfg, loss_cfg)

  return jax.lax.map(one, (inputs_BxT, targets_BxT, mask_BxT))


def _bucket(n: int, cap: int) -> int:
  """Rows of the compiled forward for n queries: a power of two, at most cap."""
  return min(cap, 1 << max(n - 1, 0).bit_length())


def query_sides(model, queries, loss_cfg: LossConfig, split=None,
                batch_size: int = 16) -> list[QuerySide]:
  """S_q, a_q and g_q of every target position of every query (tokens, positions).

  The forwards run `batch_size` queries at a time in one compiled call (rows padded to a
  power of two: a few programs serve every count; each row's result is the same whatever
  the batch, see _query_outputs). `split`: a (graphdef, state) of `model` taken earlier."""
  if batch_size <= 0:
    raise ValueError(f"batch_size must be positive, got {batch_size}")
  max_len = model.cfg.max_len
  prepared = [_query_row(t, p, max_len, model.cfg.vocab_size) for t, p in queries]
  graphdef, state = nnx.split(model) if split is None else split
  model_cfg = cv.check_model(model)
  out = []
  for lo in range(0, len(prepared), batch_size):
    chunk = prepared[lo:lo + batch_size]
    rows = _bucket(len(chunk), batch_size)
    batch = batch_lib.pad_batch(batch_lib.next_token(
        np.stack([padded for padded, _ in chunk]),
        np.stack([np.isin(np.arange(max_len), cols) for _, cols in chunk])), rows)
    og = _query_outputs(graphdef, state, *(jnp.asarray(batch[k]) for k in
                                           ("inputs", "targets", "mask")),
                        model_cfg=model_cfg, loss_cfg=loss_cfg)
    idx, act, g = (np.asarray(a).reshape(rows, max_len, -1)
                   for a in (og.idx_Nxk, og.act_Nxk, og.g_NxD))
    out += [QuerySide(idx[b, cols], act[b, cols].astype(np.float64),
                      g[b, cols].astype(np.float64)) for b, (_, cols) in enumerate(chunk)]
  return out


def query_side(model, tokens, target_positions, loss_cfg: LossConfig,
               split=None) -> QuerySide:
  """One forward pass: S_q, a_q and g_q of every target position.

  `split`: a (graphdef, state) of `model` taken earlier (saves the graph traversal)."""
  return query_sides(model, [(tokens, target_positions)], loss_cfg, split)[0]


class Preconditioner:
  """(A_ii G + μ_i I + λ I)⁻¹ in G's eigenbasis (or the co-usage version), from a cache."""

  def __init__(self, cache: cache_lib.AttributionCache, cfg: InfluenceConfig, model=None):
    """With `model`, also snapshots its (graphdef, state) for fast repeated queries: the
    cache pins the parameters anyway (fingerprint), so do not mutate them afterwards."""
    self.cfg = cfg
    self.model, self.split = model, (None if model is None else nnx.split(model))
    self.a_diag, self.mu = cache.a_diag, np.asarray(cache.mu, np.float64)
    self.A = cache.A
    evals, evecs = np.linalg.eigh(0.5 * (cache.G + cache.G.T))
    order = np.argsort(evals)[::-1]
    self.e_full, self.u_full = np.maximum(evals[order], 0.0), evecs[:, order]
    # The cache's own eigenvectors (its g coordinates are in this basis).
    self.e_r = np.maximum(np.asarray(cache.g_evals, np.float64), 0.0)
    self.u_r = np.asarray(cache.g_evecs, np.float64)
    mean_block = self.a_diag.mean() * self.e_full.mean() + self.mu.mean()
    self.damping = cfg.damping_ratio * mean_block

  def apply(self, b_KxR: np.ndarray, protos: np.ndarray, evals: np.ndarray) -> tuple:
    """Preconditions rows b (one per prototype in `protos`, eigen coordinates).

    Returns (protos', X) with X the rows of H⁻¹ b for protos' (all K under co-usage)."""
    if self.cfg.coupling == "block_diagonal":
      denom = self.a_diag[protos, None] * evals[None, :] + self.mu[protos, None] + self.damping
      return protos, b_KxR / denom
    num_k = len(self.a_diag)
    a = self.A.toarray() if hasattr(self.A, "toarray") else np.asarray(self.A)
    b_full = np.zeros((num_k, b_KxR.shape[1]))
    b_full[protos] = b_KxR
    base = np.diag(self.mu + self.damping)
    x = np.stack([np.linalg.solve(e * a + base, b_full[:, j]) for j, e in enumerate(evals)], 1)
    return np.arange(num_k), x


def _proto_rows(idx_Qxk, act_Qxk, coords_QxR):
  """Σ_q a_{q,i} coords_q for every prototype i in the union of the S_q."""
  protos = np.unique(idx_Qxk)
  pos = np.searchsorted(protos, idx_Qxk)
  b = np.zeros((len(protos), coords_QxR.shape[1]))
  np.add.at(b, pos.reshape(-1), (act_Qxk[..., None] * coords_QxR[:, None, :]).reshape(
      -1, coords_QxR.shape[1]))
  return protos, b


def token_scores(rec: dict[str, np.ndarray], protos: np.ndarray, x_SxR: np.ndarray,
                 num_protos: int) -> tuple[np.ndarray, np.ndarray]:
  """Per candidate token score and its per-(token, slot) parts, from cached records."""
  lookup = np.full(num_protos, -1, np.int64)
  lookup[protos] = np.arange(len(protos))
  pos_Cxk = lookup[rec["idx"]]
  m_CxS = np.asarray(rec["g"], np.float64) @ x_SxR.T
  parts = np.where(pos_Cxk >= 0, rec["act"] * np.take_along_axis(
      m_CxS, np.maximum(pos_Cxk, 0), 1), 0.0)
  return parts.sum(1), parts


def _rank(ids_E, scores_E, top):
  return np.lexsort((ids_E, -scores_E))[:top]


def _scored_pairs(cache, q: QuerySide, pre: Preconditioner, cfg: InfluenceConfig):
  """(token, prototype, contribution) for every scored (training token, prototype) pair."""
  q_protos, b = _proto_rows(q.idx_Qxk, q.act_Qxk, q.g_QxD @ pre.u_r)
  protos, x = pre.apply(b, q_protos, pre.e_r)
  if cfg.coupling == "block_diagonal":
    # Each (t, i) with i ∈ S_q ∩ S_t is one entry of prototype i's list: no dedup needed.
    entries = [cache.proto_entries(int(i), cfg.max_per_proto) for i in protos]
    tok = np.concatenate([t for t, _ in entries]) if entries else np.zeros(0, np.int64)
    pid = np.repeat(np.asarray(protos, np.int64), [len(t) for t, _ in entries])
    val = np.concatenate([a * cache.g_dot(t, x[s]) for s, (t, a) in enumerate(entries)]) \
        if entries else np.zeros(0)
    return q_protos, tok, pid, val
  cand = cache.candidates(q_protos, cfg.max_per_proto)
  rec = cache.records(cand)
  _, parts = token_scores(rec, protos, x, len(pre.a_diag))
  keep = parts.reshape(-1) != 0.0
  return (q_protos, np.repeat(cand, parts.shape[1])[keep], rec["idx"].reshape(-1)[keep]
          .astype(np.int64), parts.reshape(-1)[keep])


def _ranked(cache, q_protos, tok, pid, val, cfg: InfluenceConfig, packed) -> Attribution:
  """Sequence scores, the ranking, and each top sequence's best token and per-prototype
  breakdown, from the scored (token, prototype, contribution) entries."""
  ex = np.asarray(cache.sequence_of(tok, cfg.unit), np.int64)
  n_ex = max(cache.num_sequences(cfg.unit), 1)
  seq_scores = np.bincount(ex, weights=val, minlength=n_ex)
  all_ids = np.flatnonzero(np.bincount(ex, minlength=n_ex))
  top_ids = all_ids[_rank(all_ids, seq_scores[all_ids], cfg.top)]
  num_top = len(top_ids)
  slot_of = np.full(n_ex, -1, np.int64)
  slot_of[top_ids] = np.arange(num_top)
  sel = np.flatnonzero(slot_of[ex] >= 0)  # entries of the top sequences, in entry order
  slot, tok_s, val_s = slot_of[ex[sel]], tok[sel], val[sel]
  # Per-prototype breakdown of each top sequence: one bincount over (slot, prototype).
  upid, pinv = np.unique(pid[sel], return_inverse=True)
  per = np.bincount(slot * len(upid) + pinv, weights=val_s,
                    minlength=num_top * len(upid)).reshape(num_top, len(upid))
  breakdown = []
  for r in range(num_top):
    nz = np.flatnonzero(per[r])
    breakdown.append({int(upid[i]): float(per[r, i]) for i in nz[np.argsort(-np.abs(per[r, nz]))]})
  # Each top sequence's highest-scoring token (summed over its prototypes; ties: lowest).
  n_tok = max(cache.num_tokens, 1)
  ukey, kinv = np.unique(slot * n_tok + tok_s, return_inverse=True)
  tok_total = np.bincount(kinv, weights=val_s, minlength=len(ukey))
  order = np.lexsort((ukey, -tok_total, ukey // n_tok))
  _, first = np.unique(ukey[order] // n_tok, return_index=True)
  best = ukey[order][first] % n_tok  # slot order: first[r] is top sequence r's best token
  snippets = [""] * num_top
  if packed is not None and num_top:
    docs, offs = cache.gather("example_id", best), cache.gather("offset", best)
    snippets = [packed.snippet(int(d), int(o), cfg.snippet_width) for d, o in zip(docs, offs)]
  return Attribution(top_ids, seq_scores[top_ids], snippets, breakdown, q_protos, all_ids,
                     seq_scores[all_ids])


def cache_loss_config(cache, loss_cfg: LossConfig | None) -> LossConfig:
  """`loss_cfg`, or the loss config the cache was built with."""
  return LossConfig(**cache.metadata["identity"]["config"]["loss"]) if loss_cfg is None \
      else loss_cfg


def attribute_batch(model, cache: cache_lib.AttributionCache,
                    queries: Sequence[tuple[Sequence[int], Sequence[int]]], *,
                    loss_cfg: LossConfig | None = None,
                    cfg: InfluenceConfig = InfluenceConfig(), packed=None,
                    precond: Preconditioner | None = None,
                    batch_size: int = 16) -> list[Attribution]:
  """Cached PRISM attribution of many queries (tokens, target_positions): their forward
  passes run `batch_size` at a time in one padded batch (see query_sides), then each query
  is scored. Equal to calling `attribute` on each query.

  Args:
    model (PrismLM): the model the cache was built from.
    cache: the finished `AttributionCache` of the training data (curvature, records and
      the inverted index).
    queries: (tokens, target_positions) pairs. tokens: a query's token ids, at most
      model.max_len + 1 of them; target_positions: one or more positions p in
      [1, len(tokens) - 1], each the prediction of tokens[p] from tokens[:p]. A query's
      loss is the sum of those positions' token losses.
    loss_cfg: the loss whose gradients are attributed; None (default) takes the loss
      config the cache was built with.
    cfg: the scoring options (coupling, damping_ratio, max_per_proto, top, snippet_width,
      unit). Default: `InfluenceConfig()`.
    packed (PackedData | None): the packed data the cache was built over, for the text
      snippets; None (default) leaves the snippets empty.
    precond: a `Preconditioner` of `cache` built with the same `cfg`, to reuse across
      calls (built with `model`, it also reuses that model's split); None (default)
      builds one here.
    batch_size: queries per compiled forward call (positive; 16 by default).

  Returns:
    One `Attribution` per query, in the order of `queries`: the `cfg.top` training
    sequences (documents, or packed rows with unit="row") ranked by decreasing score with
    their scores (positive: the sequence helps the query), snippets, per-prototype
    breakdowns, the query's active prototypes, and every scored sequence with its score.
  """
  pre = Preconditioner(cache, cfg) if precond is None else precond
  sides = query_sides(model, queries, cache_loss_config(cache, loss_cfg),
                      pre.split if pre.model is model else None, batch_size)
  return [_ranked(cache, *_scored_pairs(cache, q, pre, cfg), cfg, packed) for q in sides]


def attribute(model, cache: cache_lib.AttributionCache, prompt_tokens,
              target_positions: Sequence[int], *, loss_cfg: LossConfig | None = None,
              cfg: InfluenceConfig = InfluenceConfig(), packed=None,
              precond: Preconditioner | None = None) -> Attribution:
  """Cached PRISM attribution of the loss at `target_positions` (see module docstring)."""
  return attribute_batch(model, cache, [(prompt_tokens, target_positions)],
                         loss_cfg=loss_cfg, cfg=cfg, packed=packed, precond=precond)[0]


def attribute_generation(model, cache: cache_lib.AttributionCache, prompt_tokens, *,
                         max_new_tokens: int = 16, cfg: InfluenceConfig = InfluenceConfig(),
                         packed=None, **generate_kwargs) -> Iterator[tuple[int, Attribution]]:
  """Generates with prism_jax.generate and yields (token, its Attribution) one at a time."""
  prompt = check_token_ids(prompt_tokens, model.cfg.vocab_size,
                           "prompt token ids").astype(np.int32).reshape(-1)
  out = gen.generate(model, prompt[None], max_new_tokens=max_new_tokens, **generate_kwargs)
  new = out.tokens_BxL[0, :int(out.lengths_B[0])]
  seq = np.concatenate([prompt, new]).astype(np.int32)
  pre = Preconditioner(cache, cfg, model)
  for i, tok in enumerate(new):
    pos = len(prompt) + i
    yield int(tok), attribute(model, cache, seq[:pos + 1], [pos], cfg=cfg, packed=packed,
                              precond=pre)


def top_overlap(ids_a, scores_a, ids_b, scores_b, m: int) -> float:
  """|top-m(a) ∩ top-m(b)| / m, ranking by decreasing score (ties by id)."""
  top_a = set(np.asarray(ids_a)[_rank(np.asarray(ids_a), np.asarray(scores_a), m)].tolist())
  top_b = set(np.asarray(ids_b)[_rank(np.asarray(ids_b), np.asarray(scores_b), m)].tolist())
  return len(top_a & top_b) / max(1, min(m, len(top_b)))
