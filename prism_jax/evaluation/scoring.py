"""The scoring harness: option log-likelihoods as lm-evaluation-harness 0.4 computes them,
batched and jitted over ragged options, for PrismLM and DenseLM with any project tokenizer.

    enc = encode_items(items, tok, max_len=cfg.model.max_len)
    scores = score_options(model, enc)                  # Scores: logprob per option
    acc, acc_norm = correct(items, scores.logprob_O), correct(items, scores.logprob_O, True)

`encode_token_pairs` takes pairs already tokenised (the lm-eval adapter's requests and
rolling windows, evaluation/lm_eval_adapter.py); `score_options(..., gains_K=g)` scores a
PrismLM's logits after the prototype-gain edit of model/logit_edit.py, and every score
says whether its continuation is the greedy one (lm-eval's is_greedy).

Per option: trailing whitespace of the context moves to the continuation; continuation
tokens are tok(ctx + cont)[len(tok(ctx)):] (an empty context is EOS); the score is the sum
of their log-probabilities. Over-long options are left-truncated (lm-eval's window
`(ctx + cont)[-(max_len + 1):]`): the context loses its head so context + continuation fit;
a continuation longer than max_len itself (a tiny model's 128-token window cannot hold
some HellaSwag endings) keeps that window, whose first token is then the continuation's
own, and scores its last max_len tokens, every one the window can predict. lm-eval has no
rule for that case (its HF model asserts the continuation fits); `too_long="refuse"`
raises OptionTooLongError instead, and drop_too_long is the explicit opt-in to leave such
items out. Encoded counts what was cut (truncated_O, cont_cut_O).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from prism_jax.data import batch as batch_lib
from prism_jax.evaluation.tasks import Item
from prism_jax.losses import token_nll
from prism_jax.model.logit_edit import controlled_logits


class OptionTooLongError(ValueError):
  """An option's continuation does not fit the model's context window."""


def move_whitespace(context: str, continuation: str) -> tuple[str, str]:
  """lm-eval: trailing whitespace of the context becomes the continuation's head."""
  n = len(context) - len(context.rstrip())
  return (context[:-n], context[-n:] + continuation) if n else (context, continuation)


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
  """(context ids, continuation ids) of one option, lm-eval's _encode_pair."""
  context, continuation = move_whitespace(context, continuation)
  if not context:
    return [tok.eos_id], list(tok.encode(continuation))
  whole = list(tok.encode(context + continuation))
  ctx = list(tok.encode(context))
  return ctx, whole[len(ctx):]


def option_chars(continuation: str) -> int:
  """acc_norm's length: the option text's characters (the " " delimiter not counted)."""
  return len(continuation) - 1 if continuation.startswith(" ") else len(continuation)


@dataclasses.dataclass
class Encoded:
  """Every option as one window: inputs (ragged), how many trailing targets score."""
  inputs: list[np.ndarray]  # int32 (L_o,) with L_o <= max_len
  targets: list[np.ndarray]
  num_cont_O: np.ndarray  # continuation tokens of option o
  item_O: np.ndarray  # the item option o belongs to
  truncated_O: np.ndarray  # bool: the window was cut from the left
  cont_cut_O: np.ndarray  # continuation tokens left out of the score (its head; usually 0)


TOO_LONG = ("truncate", "refuse")


def encode_items(items: Sequence[Item], tok, max_len: int,
                 too_long: str = "truncate") -> Encoded:
  """Every option's window (module doc); too_long="refuse" raises on a continuation
  longer than max_len instead of scoring its last max_len tokens."""
  if too_long not in TOO_LONG:
    raise ValueError(f"too_long={too_long!r}: expected one of {TOO_LONG}")
  pairs, item_of = [], []
  for i, it in enumerate(items):
    for ctx, cont in zip(it.contexts, it.continuations):
      ctx_ids, cont_ids = encode_pair(tok, ctx, cont)
      if not cont_ids:
        raise ValueError(f"{it.task} item {it.doc_id}: continuation {cont!r} has no token "
                         "of its own after tokenising context + continuation")
      if len(cont_ids) > max_len and too_long == "refuse":
        raise OptionTooLongError(
            f"{it.task} item {it.doc_id}: the continuation is {len(cont_ids)} tokens, "
            f"longer than the model's max_len {max_len}; it cannot be scored")
      pairs.append((ctx_ids, cont_ids))
      item_of.append(i)
  return encode_token_pairs(pairs, max_len, item_of)


def encode_token_pairs(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], max_len: int,
                       item_of: Sequence[int] | None = None) -> Encoded:
  """The windows of (context ids, continuation ids) pairs already tokenised (lm-eval's
  requests after its _encode_pair, or its rolling windows), left-truncated as in the
  module doc; `item_of` (default: one item per pair) groups them."""
  inputs, targets, num_cont, cut, cont_cut = [], [], [], [], []
  for ctx_ids, cont_ids in pairs:
    if not len(ctx_ids) or not len(cont_ids):
      raise ValueError("a scored pair needs a context token and a continuation token, got "
                       f"{len(ctx_ids)} and {len(cont_ids)}")
    seq = (list(ctx_ids) + list(cont_ids))[-(max_len + 1):]  # left truncation
    scored = min(len(cont_ids), len(seq) - 1)
    inputs.append(np.asarray(seq[:-1], np.int32))
    targets.append(np.asarray(seq[1:], np.int32))
    num_cont.append(scored)
    cut.append(len(ctx_ids) + len(cont_ids) > max_len + 1)
    cont_cut.append(len(cont_ids) - scored)
  item_of = np.arange(len(pairs)) if item_of is None else np.asarray(item_of)
  return Encoded(inputs, targets, np.asarray(num_cont, np.int64), item_of,
                 np.asarray(cut, bool), np.asarray(cont_cut, np.int64))


def drop_too_long(items: Sequence[Item], tok, max_len: int) -> tuple[list[Item], int]:
  """(items whose every continuation fits max_len, how many were dropped): the explicit
  opt-in to leave out what encode_items would left-truncate (the scores are then not on
  the whole benchmark)."""
  keep = [it for it in items
          if all(len(encode_pair(tok, c, k)[1]) <= max_len
                 for c, k in zip(it.contexts, it.continuations))]
  return keep, len(items) - len(keep)


@dataclasses.dataclass
class Scores:
  """logprob_O per option and greedy_O (every scored token is its position's argmax, as
  lm-eval's is_greedy); with `collect`, the continuation tokens' rows (C of them, in
  option order): unedited logits, targets, their option, z, and the prototype codes."""
  logprob_O: np.ndarray
  option_C: np.ndarray | None = None
  logits_CxV: np.ndarray | None = None
  targets_C: np.ndarray | None = None
  z_CxD: np.ndarray | None = None
  idx_Cxk: np.ndarray | None = None
  act_Cxk: np.ndarray | None = None
  greedy_O: np.ndarray | None = None


def _buckets(max_len: int) -> list[int]:
  sizes, n = [], 16
  while n < max_len:
    sizes.append(n)
    n *= 2
  return sizes + [max_len]


# One program per (model graph, gains or not, bucket shape), reused across calls.
@jax.jit(static_argnames=("graphdef",))
def _forward(graphdef, state, gains_K, inputs_BxT, targets_BxT, mask_BxT):
  model = nnx.merge(graphdef, state)
  out = model(inputs_BxT)
  logits_BxTxV = out.logits_BxTxV
  if gains_K is not None:  # PRISM.md §6's edit, r_t kept from this pass
    logits_BxTxV = controlled_logits(model, out, gains_K)
  b, t, v = logits_BxTxV.shape
  logp_BxT = -token_nll(logits_BxTxV.reshape(b * t, v),
                        targets_BxT.reshape(-1)).reshape(b, t)
  greedy_B = jnp.all((jnp.argmax(logits_BxTxV, axis=-1) == targets_BxT) | ~mask_BxT, axis=1)
  return jnp.where(mask_BxT, logp_BxT, 0.0).sum(1), greedy_B, out


def score_options(model, enc: Encoded, *, batch_rows: int = 32, collect: bool = False,
                  progress=None, gains_K=None) -> Scores:
  """Sum of continuation log-probabilities per option (fp32) and whether each continuation
  is the greedy one, options bucketed by length (powers of two up to max_len) into fixed
  (batch_rows, bucket) shapes. `gains_K` (a PrismLM's (K,) prototype gains) scores the
  edited logits of model/logit_edit.py's controlled_logits instead (not with `collect`,
  whose rows are the unedited pass the controllers are fit on)."""
  if gains_K is not None and collect:
    raise ValueError("score_options: collect=True gathers the unedited pass; score with "
                     "gains_K without collect")
  max_len = model.cfg.max_len
  graphdef, state = nnx.split(model)
  gains_K = None if gains_K is None else jnp.asarray(gains_K, jnp.float32)
  lengths = np.asarray([len(x) for x in enc.inputs])
  if lengths.size and lengths.max() > max_len:
    raise OptionTooLongError(f"an encoded option has {lengths.max()} tokens > max_len "
                             f"{max_len}: encode with this model's max_len")
  logprob = np.zeros(len(lengths), np.float64)
  greedy = np.zeros(len(lengths), bool)
  rows = {k: [] for k in ("option", "logits", "targets", "z", "idx", "act")}
  bucket_of = np.searchsorted(np.asarray(_buckets(max_len)), lengths)
  for b, size in enumerate(_buckets(max_len)):
    members = np.flatnonzero(bucket_of == b)
    for start in range(0, len(members), batch_rows):
      opts = members[start:start + batch_rows]
      batch = {k: np.zeros((len(opts), size), d) for k, d in
               (("inputs", np.int32), ("targets", np.int32), ("mask", bool))}
      for r, o in enumerate(opts):
        n = lengths[o]
        batch["inputs"][r, :n], batch["targets"][r, :n] = enc.inputs[o], enc.targets[o]
        batch["mask"][r, n - enc.num_cont_O[o]:n] = True  # the continuation's targets
      batch = batch_lib.pad_batch(batch, batch_rows)
      lp_B, greedy_B, out = _forward(graphdef, state, gains_K, batch["inputs"],
                                     batch["targets"], batch["mask"])
      logprob[opts] = np.asarray(lp_B, np.float64)[:len(opts)]
      greedy[opts] = np.asarray(greedy_B)[:len(opts)]
      if collect:
        mask = batch["mask"][:len(opts)]
        sel = mask.reshape(-1)
        rows["option"].append(np.repeat(opts, mask.sum(1)))
        rows["logits"].append(np.asarray(out.logits_BxTxV[:len(opts)]).reshape(-1, out.logits_BxTxV.shape[-1])[sel])
        rows["targets"].append(batch["targets"][:len(opts)].reshape(-1)[sel])
        rows["z"].append(np.asarray(out.z_BxTxD[:len(opts)]).reshape(-1, out.z_BxTxD.shape[-1])[sel])
        if out.protos is not None:
          n_tok = len(opts) * size
          rows["idx"].append(np.asarray(out.protos.idx_Nxk[:n_tok])[sel])
          rows["act"].append(np.asarray(out.protos.act_Nxk[:n_tok])[sel])
      if progress is not None:
        progress(len(opts))
  if not collect:
    return Scores(logprob, greedy_O=greedy)
  order = np.argsort(np.concatenate(rows["option"]), kind="stable")
  cat = lambda k: np.concatenate(rows[k])[order] if rows[k] else None
  return Scores(logprob, cat("option"), cat("logits"), cat("targets"), cat("z"), cat("idx"),
                cat("act"), greedy)


def per_item(items: Sequence[Item], values_O: np.ndarray) -> list[np.ndarray]:
  """Option values split by item (options are laid out item by item)."""
  cuts = np.cumsum([it.num_options for it in items])[:-1]
  return np.split(np.asarray(values_O), cuts)


def correct(items: Sequence[Item], scores_O: np.ndarray, norm: bool = False) -> np.ndarray:
  """Per item 1.0 where argmax (acc) or argmax of score / option chars (acc_norm) is gold."""
  out = []
  for it, s in zip(items, per_item(items, scores_O)):
    if norm:
      s = s / np.asarray([max(option_chars(c), 1) for c in it.continuations], np.float64)
    out.append(float(int(np.argmax(s)) == it.gold))
  return np.asarray(out)


def requests(items: Sequence[Item]) -> list[dict]:
  """Every request as {task, doc_id, context, continuation, gold} (for --dump_requests)."""
  return [{"task": it.task, "doc_id": it.doc_id, "context": c, "continuation": k,
           "gold": it.gold, "option": j, "is_gold": j == it.gold}
          for it in items for j, (c, k) in enumerate(zip(it.contexts, it.continuations))]
