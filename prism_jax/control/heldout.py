"""The held-out suppression protocol: what each stage may read, and the choice on validation.

    split = planted_split(without_texts, seed=0)      # or doctest_split(with, without)
    ranked = rankings(model, tokenizer, split, max_num=64, seq_len=128)
    evaluate = validation_evaluator(model, tokenizer, split, ranked.contrast, gen, neutral)
    choice, rows = choose(evaluate, nums=(16, 32, 48, 64), refills=(False, True))
    # then, once, at `choice`: the test prompts' held-out rate (experiments/suppress_heldout)

A `HeldoutSplit` holds the only texts selection and the token ban read (`with_texts`,
`without_texts`, `select_words`), the validation prompts and their measure, and the test
prompts and their measure. It refuses to exist when a forbidden (held-out) word is in any
text selection reads or in any prompt, or when validation and test prompts overlap.

- Planted behaviour: the with-texts are topic documents written apart from the training
  corpus with selection-half words only (planted.selection_documents); the without-texts
  are training rows with no marked word; validation = the selection-half rate on
  validation prompts (no held-out word anywhere); test = the held-out rate on test prompts.
- `>>>` behaviour (doctest): no vocabulary is held out; the with/without texts are training
  rows with / without `>>>`, and the held-out part is the prompts: choices on validation
  prompts, the rate measured once on the disjoint test prompts.

Selectors ranked from the split: contrast (prototype activations), logit signature (token
ids of `select_words` only) and the token ban by the same contrast statistic on token
frequencies (`selection.by_token_contrast`), each cut to the chosen budget.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from prism_jax.control import behaviours, measure, planted, selection


@dataclasses.dataclass(frozen=True)
class HeldoutSplit:
  behaviour: str
  with_texts: tuple[str, ...]  # texts with the behaviour: selection and the ban read these
  without_texts: tuple[str, ...]  # texts without it: likewise
  select_words: tuple[str, ...]  # the logit-signature selector's words
  validation_prompts: tuple[str, ...]
  test_prompts: tuple[str, ...]
  validation_score: Callable[[str], float]  # per generation; reads no forbidden word
  test_score: Callable[[str], float]  # the held-out measure, used once
  forbidden: tuple[str, ...] = ()  # held-out words: in no text above
  validation_measure: str = ""
  test_measure: str = ""

  def __post_init__(self):
    if len(self.with_texts) < 2 or len(self.without_texts) < 2:
      raise ValueError("a held-out split needs >= 2 texts with and without the behaviour")
    if len(self.validation_prompts) < 2 or len(self.test_prompts) < 2:
      raise ValueError("a held-out split needs >= 2 validation and >= 2 test prompts "
                       "(the prompts are the bootstrap's clusters)")
    shared = set(self.validation_prompts) & set(self.test_prompts)
    if shared:
      raise ValueError(f"{len(shared)} prompts are both validation and test prompts")
    if self.forbidden:
      for name in ("with_texts", "without_texts", "select_words", "validation_prompts",
                   "test_prompts"):
        leaked = [t for t in getattr(self, name) if planted.count_words(t, self.forbidden)]
        if leaked:
          raise ValueError(f"{len(leaked)} of the split's {name} contain a held-out word "
                           f"(first: {leaked[0][:80]!r})")


def planted_split(without_texts: Sequence[str], *, num_texts: int = 96,
                  num_validation: int = 16, num_test: int = 24, seed: int = 0) -> HeldoutSplit:
  """The planted behaviour's split (module doc); `without_texts`: training text with no
  marked word (the caller's sample of the corpus)."""
  validation = planted.topic_prompts(num_validation, planted.VALIDATION_SEED + seed)
  test = [p for p in planted.topic_prompts(num_test + num_validation, planted.TEST_SEED + seed)
          if p not in set(validation)][:num_test]
  sel = planted.SELECTION_WORDS
  return HeldoutSplit(
      "planted", tuple(planted.selection_documents(num_texts, seed)), tuple(without_texts),
      sel, tuple(validation), tuple(test),
      lambda text: float(planted.count_words(text, sel)),
      lambda text: float(planted.count_words(text, planted.HELDOUT_WORDS)),
      forbidden=planted.HELDOUT_WORDS,
      validation_measure="selection-half words per generation, validation prompts",
      test_measure="held-out words per generation, test prompts")


def doctest_split(with_texts: Sequence[str], without_texts: Sequence[str], *,
                  num_validation: int = 10, seed: int = 0) -> HeldoutSplit:
  """The `>>>` behaviour's split: behaviours.DOCTEST_PROMPT_POOL shuffled by `seed`, the
  first `num_validation` for validation, the rest for test."""
  pool = list(np.random.default_rng(planted.VALIDATION_SEED + seed).permutation(
      behaviours.DOCTEST_PROMPT_POOL))
  score = lambda text: float(behaviours.doctest_lines(text))
  return HeldoutSplit("doctest", tuple(with_texts), tuple(without_texts), (">>>",),
                      tuple(pool[:num_validation]), tuple(pool[num_validation:]), score, score,
                      validation_measure="'>>>' lines per generation, validation prompts",
                      test_measure="'>>>' lines per generation, test prompts")


def encode_texts(tokenizer, texts: Sequence[str], seq_len: int):
  """(tokens_BxT, mask_BxT): each text's first seq_len tokens, right-padded."""
  ids = [list(tokenizer.encode(t))[:seq_len] for t in texts]
  tokens = np.zeros((len(ids), seq_len), np.int32)
  mask = np.zeros((len(ids), seq_len), bool)
  for b, row in enumerate(ids):
    tokens[b, :len(row)], mask[b, :len(row)] = row, True
  return tokens, mask


def _features(model, tokenizer, texts, seq_len, batch: int = 16) -> np.ndarray:
  tokens, mask = encode_texts(tokenizer, texts, seq_len)
  return selection.batched_text_features(model, tokens, mask, batch)


@dataclasses.dataclass(frozen=True)
class Rankings:
  contrast: selection.Selection  # prototypes
  logit_signature: selection.Selection  # prototypes
  ban: selection.Selection  # token ids


def rankings(model, tokenizer, split: HeldoutSplit, *, max_num: int, seq_len: int,
             ban_common: float = 0.1) -> Rankings:
  """Every selector's ranking, from the split's selection texts and words only. The ban
  leaves out special tokens and tokens in more than `ban_common` of the without-texts
  ('.', ' the': banning them breaks all text, which no ban meant as a baseline would do)."""
  contrast = selection.by_contrast(_features(model, tokenizer, split.with_texts, seq_len),
                                   _features(model, tokenizer, split.without_texts, seq_len),
                                   num=max_num, min_score=None)
  with_tok = [tokenizer.encode(t) for t in split.with_texts]
  without_tok = [tokenizer.encode(t) for t in split.without_texts]
  share_V = np.zeros(model.cfg.vocab_size)
  for toks in without_tok:
    share_V[np.unique(np.asarray(toks, np.int64))] += 1.0 / len(without_tok)
  special = [i for i in (getattr(tokenizer, "eos_id", None), getattr(tokenizer, "pad_id", None))
             if i is not None and i < model.cfg.vocab_size]
  ban = selection.by_token_contrast(
      with_tok, without_tok, model.cfg.vocab_size, num=max_num, min_score=None,
      exclude=sorted(set(special) | set(np.flatnonzero(share_V > ban_common).tolist())))
  sig = selection.by_logit_signature(
      model, behaviours.word_token_ids(tokenizer, split.select_words), num=max_num)
  return Rankings(contrast, sig, ban)


def validation_evaluator(model, tokenizer, split: HeldoutSplit, ranking: selection.Selection,
                         gen_kw: dict, neutral: dict) -> Callable[[int, bool], dict]:
  """evaluate(num, refill) -> {"rate", "fall", "ppl_change"}: the top `num` of `ranking`
  suppressed, on the validation prompts and measure only; neutral = {inputs, targets, mask}
  (the quality split). The unedited rate is measured once, on first use."""
  base: dict = {}

  def rate(**edit) -> float:
    texts = measure.generations(model, tokenizer, split.validation_prompts, **gen_kw, **edit)
    return float(np.mean([split.validation_score(t) for t in texts]))

  def evaluate(num: int, refill: bool) -> dict:
    if "rate" not in base:
      base["rate"] = rate()
    ids = ranking.ids[:num]
    r = rate(ids=ids, refill=refill)
    q = measure.quality(model, neutral["inputs"], neutral["targets"], neutral["mask"], ids=ids,
                        refill=refill)
    return {"rate": r, "base_rate": base["rate"],
            "fall": 1.0 - r / base["rate"] if base["rate"] > 0 else float("nan"),
            "ppl_change": q["ppl_after"] / q["ppl_before"] - 1.0}

  return evaluate


def choose(evaluate: Callable[[int, bool], dict], nums: Sequence[int],
           refills: Sequence[bool] = (False,), *, ppl_budget: float = 0.02,
           tol: float = 0.02) -> tuple[dict, list[dict]]:
  """(the chosen row, every row): among the settings whose neutral perplexity rises at most
  `ppl_budget`, the smallest set (then no refill) whose validation fall is within `tol` of
  the best one's. Reads nothing but `evaluate`."""
  rows = [dict(num=int(n), refill=bool(r), **evaluate(int(n), bool(r)))
          for n in nums for r in refills]
  feasible = [r for r in rows if r["ppl_change"] <= ppl_budget and np.isfinite(r["fall"])]
  if not feasible:
    raise ValueError(f"no setting keeps neutral perplexity within +{100 * ppl_budget:g}%: "
                     f"{[(r['num'], r['refill'], round(r['ppl_change'], 4)) for r in rows]}")
  best = max(r["fall"] for r in feasible)
  chosen = min((r for r in feasible if r["fall"] >= best - tol),
               key=lambda r: (r["num"], r["refill"]))
  return chosen, rows
