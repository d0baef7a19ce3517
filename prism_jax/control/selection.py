"""Prototype sets for a behaviour: by card keywords, by logit signature, by contrast sets.

Every selector returns a `Selection`: prototype ids by decreasing score, the scores, and
(when a CardSet is given) their cards, so a set can be read before it is suppressed.

- `by_keywords(cards, keywords, where=)`: share of a prototype's top contexts whose text
  window, trigger token or next (predicted) token holds a keyword (issue 14's
  `prism_jax.analysis.cards.CardSet`).
- `by_logit_signature(model, token_ids)`: how far W p_i promotes the given tokens, in
  standard deviations of its own logit row: mean_y (W p_i)_y − mean_v (W p_i)_v over std_v.
- `by_contrast(feats_with, feats_without)`: mean activation on texts with the behaviour
  minus without, over the pooled standard deviation (per prototype, features from
  `text_features`).
- `by_token_contrast(tokens_with, tokens_without, vocab_size)`: the same contrast statistic
  on each text's token frequencies: the tokens over-represented in the texts with the
  behaviour (a token ban built like the contrast prototype set, at the same budget).
- `by_probe(feats_with, feats_without)`: an L1-regularised logistic probe on the same
  features, fitted by proximal gradient (ISTA) in JAX; the prototypes with positive
  weight, by weight. Written here rather than scikit-learn: 30 lines, no new dependency,
  float64-exact on the tiny problems it sees, and the same code runs on a device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from prism_jax.model.lm import PrismLM


@dataclasses.dataclass(frozen=True)
class Selection:
  ids: tuple[int, ...]  # by decreasing score
  scores: tuple[float, ...]
  method: str  # "keywords" | "logit_signature" | "contrast" | "probe"
  query: str  # what was asked for, human-readable
  cards: tuple = ()  # the CardSet's cards of `ids`, when one was given

  def top(self, num: int) -> "Selection":
    """The first `num` ids (all when fewer)."""
    if num < 1:
      raise ValueError(f"num must be >= 1, got {num}")
    return dataclasses.replace(self, ids=self.ids[:num], scores=self.scores[:num],
                               cards=self.cards[:num])


def _ranked(scores_K: np.ndarray, method: str, query: str, *, num: int | None,
            min_score: float | None, cards=None) -> Selection:
  scores_K = np.asarray(scores_K, np.float64)
  order = np.argsort(-scores_K, kind="stable")
  if min_score is not None:
    order = order[scores_K[order] > min_score]
  if num is not None:
    if num < 1:
      raise ValueError(f"num must be >= 1, got {num}")
    order = order[:num]
  if not order.size:
    raise ValueError(f"selection by {method} ({query}) matched no prototype")
  chosen = tuple(cards.card(int(i)) for i in order) if cards is not None else ()
  return Selection(tuple(int(i) for i in order), tuple(float(scores_K[i]) for i in order),
                   method, query, chosen)


def _check_model(model) -> None:
  if not isinstance(model, PrismLM):
    raise ValueError("selection needs a PrismLM: the dense model has no prototypes")


def logit_signature_scores(model: PrismLM, token_ids: Sequence[int]) -> np.ndarray:
  """(K,) standardised promotion of `token_ids` by each W p_i (module doc)."""
  _check_model(model)
  ids = np.unique(np.asarray(list(token_ids), np.int64))
  if not ids.size:
    raise ValueError("logit signature selection needs at least one token id")
  if ids.min() < 0 or ids.max() >= model.cfg.vocab_size:
    raise ValueError(f"token ids must be in [0, {model.cfg.vocab_size}), got {ids.tolist()}")
  sig_KxV = np.asarray(model.proto_logit_signatures(), np.float64)
  centred_KxV = sig_KxV - sig_KxV.mean(-1, keepdims=True)
  return centred_KxV[:, ids].mean(-1) / (sig_KxV.std(-1) + 1e-12)


def by_logit_signature(model: PrismLM, token_ids: Sequence[int], *, num: int | None = None,
                       min_score: float | None = None, cards=None) -> Selection:
  scores = logit_signature_scores(model, token_ids)
  return _ranked(scores, "logit_signature", f"tokens {sorted(set(map(int, token_ids)))}",
                 num=num, min_score=min_score, cards=cards)


def text_features(model: PrismLM, tokens_BxT, mask_BxT=None) -> np.ndarray:
  """(B, K): each text's mean activation of every prototype over its valid tokens."""
  _check_model(model)
  tokens_BxT = jnp.asarray(tokens_BxT, jnp.int32)
  batch, seq = tokens_BxT.shape
  mask_BxT = jnp.ones((batch, seq), bool) if mask_BxT is None else jnp.asarray(mask_BxT, bool)
  protos = model(tokens_BxT, mask_BxT=mask_BxT).protos
  act_Nxk = protos.act_Nxk * mask_BxT.reshape(-1, 1)
  rows_Nxk = jnp.broadcast_to((jnp.arange(batch * seq) // seq)[:, None], act_Nxk.shape)
  feats_BxK = jnp.zeros((batch, model.cfg.num_prototypes), jnp.float32)
  feats_BxK = feats_BxK.at[rows_Nxk, protos.idx_Nxk].add(act_Nxk)
  return np.asarray(feats_BxK / jnp.maximum(mask_BxT.sum(-1, keepdims=True), 1))


def batched_text_features(model: PrismLM, tokens_BxT, mask_BxT=None, batch: int = 16
                          ) -> np.ndarray:
  """`text_features` of many texts, `batch` at a time: (B, K)."""
  tokens_BxT = np.asarray(tokens_BxT)
  return np.concatenate([
      text_features(model, tokens_BxT[i:i + batch],
                    None if mask_BxT is None else np.asarray(mask_BxT)[i:i + batch])
      for i in range(0, len(tokens_BxT), batch)])


def row_contrast_features(model: PrismLM, packed, words: Sequence[str], *, num_rows: int,
                          seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """(features of training rows whose text contains one of `words`, of rows that contain
  none), up to `num_rows` of each drawn with `seed`: the inputs of `by_contrast` /
  `by_probe` when the behaviour is given by words rather than texts."""
  rows = packed.rows("train")["tokens"]
  lowered = [w.lower() for w in words]
  has = np.array([any(w in packed.tokenizer.decode(r.tolist()).lower() for w in lowered)
                  for r in rows])
  rng = np.random.default_rng(seed)
  pick = lambda m: rng.choice(np.flatnonzero(m), size=min(num_rows, int(m.sum())),
                              replace=False)
  with_rows, without_rows = pick(has), pick(~has)
  if len(with_rows) < 2:
    raise ValueError(f"only {len(with_rows)} training rows contain {list(words)}: no contrast")
  feats = lambda ix: batched_text_features(model, np.asarray(rows[ix])[:, :-1])
  return feats(with_rows), feats(without_rows)


def _check_feats(feats_with, feats_without):
  a, b = np.asarray(feats_with, np.float64), np.asarray(feats_without, np.float64)
  if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
    raise ValueError(f"contrast features must be (texts, K) with the same K, got "
                     f"{a.shape} and {b.shape}")
  if len(a) < 2 or len(b) < 2:
    raise ValueError(f"contrast sets need >= 2 texts each, got {len(a)} and {len(b)}")
  return a, b


def contrast_scores(feats_with, feats_without) -> np.ndarray:
  a, b = _check_feats(feats_with, feats_without)
  pooled = np.sqrt(0.5 * (a.var(0, ddof=1) + b.var(0, ddof=1))) + 1e-6
  return (a.mean(0) - b.mean(0)) / pooled


def by_contrast(feats_with, feats_without, *, num: int | None = None,
                min_score: float | None = 0.0, cards=None) -> Selection:
  scores = contrast_scores(feats_with, feats_without)
  return _ranked(scores, "contrast", f"{len(feats_with)} vs {len(feats_without)} texts",
                 num=num, min_score=min_score, cards=cards)


def token_features(token_lists: Sequence[Sequence[int]], vocab_size: int) -> np.ndarray:
  """(B, V): each text's token frequencies (counts over its length)."""
  feats_BxV = np.zeros((len(token_lists), vocab_size))
  for b, toks in enumerate(token_lists):
    toks = np.asarray(list(toks), np.int64)
    if toks.size:
      np.add.at(feats_BxV[b], toks, 1.0 / toks.size)
  return feats_BxV


def by_token_contrast(tokens_with, tokens_without, vocab_size: int, *, num: int | None = None,
                      exclude: Sequence[int] = (), min_score: float | None = 0.0) -> Selection:
  """Token ids by contrast_scores of token frequencies (texts with vs without), `exclude`
  (e.g. EOS) left out: a Selection whose ids are tokens, not prototypes."""
  scores_V = contrast_scores(token_features(tokens_with, vocab_size),
                             token_features(tokens_without, vocab_size))
  scores_V[np.asarray(list(exclude), np.int64)] = -np.inf
  return _ranked(scores_V, "token_contrast", f"{len(tokens_with)} vs {len(tokens_without)} "
                 "texts", num=num, min_score=min_score)


def l1_logistic(x_NxK, y_N, *, l1: float, steps: int = 2000) -> tuple[np.ndarray, float]:
  """argmin_w,b mean log(1 + exp(−s (x w + b))) + l1 |w|_1 (s = ±1) by ISTA, float64.

  Features are standardised inside (weights returned on the original scale); the step is
  1 / L with L = λ_max(X̃ᵀX̃) / (4 N), the loss's Lipschitz constant."""
  x = np.asarray(x_NxK, np.float64)
  mu, sd = x.mean(0), x.std(0) + 1e-12
  xs = (x - mu) / sd
  with jax.enable_x64():
    xs_j, y_j = jnp.asarray(xs), jnp.asarray(np.asarray(y_N, np.float64))
    lr = 1.0 / (np.linalg.norm(xs, 2) ** 2 / (4 * len(xs)) + 1e-12)
    grad = jax.grad(lambda w, b: jnp.mean(jnp.logaddexp(0.0, -(2 * y_j - 1) * (xs_j @ w + b))),
                    argnums=(0, 1))

    def body(_, wb):
      w, b = wb
      gw, gb = grad(w, b)
      w = w - lr * gw
      return jnp.sign(w) * jnp.maximum(jnp.abs(w) - lr * l1, 0.0), b - lr * gb
    w, b = jax.lax.fori_loop(0, steps, body, (jnp.zeros(xs.shape[1]), jnp.zeros(())))
    w = np.asarray(w)
  return w / sd, float(b) - float((w / sd) @ mu)


def by_probe(feats_with, feats_without, *, l1: float = 0.02, num: int | None = None,
             cards=None) -> Selection:
  a, b = _check_feats(feats_with, feats_without)
  w_K, _ = l1_logistic(np.concatenate([a, b]), np.r_[np.ones(len(a)), np.zeros(len(b))],
                       l1=l1)
  return _ranked(w_K, "probe", f"L1 {l1}, {len(a)} vs {len(b)} texts", num=num,
                 min_score=0.0, cards=cards)


def keyword_scores(cards, keywords: Sequence[str], where: str = "text") -> np.ndarray:
  """(K,) share of each card's contexts that contain a keyword (case-insensitive): in
  their text window or trigger token (where="text" | "trigger": issue 14's
  `CardSet.search`), or (where="next") as the predicted token, the start of
  `tokens_after`: the prototypes active right before the behaviour."""
  scores = np.zeros(len(cards))
  if where == "next":
    words = [w.strip().lower() for w in keywords if w.strip()]
    if not words:
      raise ValueError("keyword selection needs at least one non-blank keyword")
    for card in cards.cards:
      nxt = [c.tokens_after.lstrip().lower() for c in card.contexts]
      hits = sum(any(t.startswith(w) for w in words) for t in nxt)
      scores[card.proto_id] = hits / max(len(card.contexts), 1)
    return scores
  for proto_id, hits in cards.search(list(keywords), where=where):
    scores[proto_id] = hits / max(len(cards.card(proto_id).contexts), 1)
  return scores


def by_keywords(cards, keywords: Sequence[str], *, where: str = "text",
                num: int | None = None, min_score: float | None = 0.0) -> Selection:
  scores = keyword_scores(cards, keywords, where)
  return _ranked(scores, "keywords", f"{where}: " + ",".join(keywords), num=num,
                 min_score=min_score, cards=cards)
