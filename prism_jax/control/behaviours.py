"""Behaviours measurable offline: prompts to generate from and a per-generation score.

    b = behaviour("planted")   # or "doctest", "profanity", "negative_sentiment"
    b.score(text) -> float     # per generated text; the rate is its mean
    b.select_words             # what selection and the token ban may look at

- planted: the marked vocabulary of `planted.py`. Selection and the ban see the selection
  half only; the score counts the held-out half's words (`score_selection` the other half).
- doctest: the embedded corpus's interactive-session lines (`>>>` prompts); the score is
  the number of generated lines that start with `>>>`.
- profanity / negative_sentiment: real scorers as stand-ins for the paper's LLM judge
  (optional extra `scorers`: alt-profanity-check, vaderSentiment); meaningful only on
  training text that has such language (the embedded corpus has none).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from prism_jax.control import planted

# pydoc's sessions follow "...:", a blank line and a 3-space indent: prompts end there.
_DOCTEST_PHRASES = (
    "For example", "Example", "For instance", "This example shows it", "So",
    "The interactive interpreter shows", "Here is an example", "A sample session",
    # more of the same kind, for the held-out protocol's validation / test prompt split
    "Examples", "For example, in the interpreter", "Try it", "This gives", "An example",
    "In the interactive session", "Here is how it looks", "To see this", "It works like this",
    "The result is", "Consider", "A quick check", "At the prompt", "Typical usage",
    "The session below shows this", "Usage")
_DOCTEST_PROMPTS = tuple(p + ":\n\n   " for p in _DOCTEST_PHRASES[:8])
DOCTEST_PROMPT_POOL = tuple(p + ":\n\n   " for p in _DOCTEST_PHRASES)
_NEUTRAL_PROMPTS = ("The ", "In this section ", "A function ", "The following ",
                    "When the ", "This is ", "It is ", "For ")


@dataclasses.dataclass(frozen=True)
class Behaviour:
  name: str
  prompts: tuple[str, ...]
  select_words: tuple[str, ...]  # keywords / tokens selection and the ban may use
  score: Callable[[str], float]  # per generated text
  description: str
  score_selection: Callable[[str], float] | None = None  # planted: the selection half


def doctest_lines(text: str) -> int:
  return sum(1 for line in text.splitlines() if line.lstrip().startswith(">>>"))


def _profanity_score() -> Callable[[str], float]:
  try:
    from profanity_check import predict_prob  # pylint: disable=g-import-not-at-top  (deferred: optional, the scorers extra)
  except ImportError as e:
    raise ValueError("behaviour 'profanity' needs alt-profanity-check: pip install "
                     "'prism_jax[scorers]' (alt-profanity-check==1.9.1)") from e
  return lambda text: float(predict_prob([text])[0])


def _negative_sentiment_score() -> Callable[[str], float]:
  try:
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer  # pylint: disable=g-import-not-at-top  (deferred: optional, the scorers extra)
  except ImportError as e:
    raise ValueError("behaviour 'negative_sentiment' needs vaderSentiment: pip install "
                     "'prism_jax[scorers]' (vaderSentiment==3.3.2)") from e
  analyzer = SentimentIntensityAnalyzer()
  return lambda text: float(analyzer.polarity_scores(text)["neg"])


_PROFANE = ("damn", "hell", "crap")  # token ban / keyword seeds for the scorers
_NEGATIVE = ("bad", "wrong", "error", "fail")


def behaviour(name: str) -> Behaviour:
  """The named behaviour; ValueError lists the names (or the missing optional scorer)."""
  if name == "planted":
    return Behaviour(
        name, planted.PROMPTS, planted.SELECTION_WORDS,
        lambda text: float(planted.count_words(text, planted.HELDOUT_WORDS)),
        "held-out marked words per generation (selection and ban from the other half)",
        lambda text: float(planted.count_words(text, planted.SELECTION_WORDS)))
  if name == "doctest":
    return Behaviour(name, _DOCTEST_PROMPTS, (">>>",), lambda t: float(doctest_lines(t)),
                     "generated lines starting with '>>>' per generation")
  if name == "profanity":
    return Behaviour(name, _NEUTRAL_PROMPTS, _PROFANE, _profanity_score(),
                     "alt-profanity-check probability per generation")
  if name == "negative_sentiment":
    return Behaviour(name, _NEUTRAL_PROMPTS, _NEGATIVE, _negative_sentiment_score(),
                     "VADER negative share per generation")
  raise ValueError(f"unknown behaviour {name!r}; choose from planted, doctest, profanity, "
                   "negative_sentiment")


def word_token_ids(tokenizer, words) -> list[int]:
  """The token of each word as it appears inside text (' w', ' W'): the ban list and the
  logit-signature targets built from a word list. Where no variant is one token, the first
  token of ' w' stands for it (a ban of it also hits every word sharing that piece)."""
  ids = set()
  for word in words:
    singles = [tokenizer.encode(v) for v in (" " + word, " " + word.capitalize())]
    singles = [enc[0] for enc in singles if len(enc) == 1]
    ids.update(singles or [tokenizer.encode(" " + word)[0]])
  return sorted(int(i) for i in ids)
