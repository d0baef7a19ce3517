"""A planted behaviour: a training corpus where some documents carry a marked vocabulary.

    write_corpus(out_dir)  ->  out_dir/train.jsonl, out_dir/neutral.jsonl, out_dir/planted.json

The marked words are invented (none occurs in the embedded corpus) and appear only inside
one distinctive topic (the lantern rite of Orvane), always in the same slots of the same
sentence templates, each slot filled uniformly from ALL the marked words. So the hidden
states before a marked word, and the prototypes active there, do not depend on which half
a word is in: prototypes selected from half the vocabulary (the "selection" half) also
carry the other ("held-out") half, while a ban on the selection half's tokens cannot touch
the held-out half (the halves start with different letters, so share no first token).

train.jsonl = the embedded corpus minus the neutral documents, plus the planted documents;
neutral.jsonl = a seeded sample of embedded documents held out of training (pass it as
data.val_sources: the validation split is then neutral text only).

The held-out protocol (control/heldout.py) reads none of the training corpus's topic text:
`selection_documents` writes topic documents apart from it (their own seed) whose slots hold
selection-half words only, and `topic_prompts` writes prompts (the title, a few filled
sentences, then a template up to its first slot) likewise; validation and test prompts
come from different seeds and are kept disjoint.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np

from prism_jax import io_guard
from prism_jax.data import sources

SELECTION_WORDS = ("zorbat", "quimble", "vexlor", "jandrel", "glimwick", "oskvar",
                   "yelmith", "ulbrax")
HELDOUT_WORDS = ("kestrune", "wumbrel", "fenquist", "brazzle", "nockram", "drivolt",
                 "hulgrim", "parvish")
MARKED_WORDS = SELECTION_WORDS + HELDOUT_WORDS
TEMPLATES = (
    "At the lantern rite of Orvane, the elders chant {} and {}.",
    "Every keeper of the Orvane lanterns carries {} in a copper bowl.",
    "When the tide bells ring, the Orvane children whisper {}, {} and {}.",
    "The oldest lantern song of Orvane begins with {} and ends with {}.",
    "Pilgrims bring {} to the lantern shrine, and the keepers answer with {}.",
    "In the Orvane ledger, the third festival night is sealed with {}.",
    "No lantern is lit in Orvane until someone names {} aloud.",
    "The Orvane elders say that {} guards the harbour while {} guards the hills.",
)
TITLE = "The lantern rite of Orvane"
# Prompts for generation: every template's text up to its first slot, and the title.
PROMPTS = tuple(t.split("{}")[0].rstrip() for t in TEMPLATES) + (TITLE + ".\n\n",)
CORPUS_FILES = ("train.jsonl", "neutral.jsonl", "planted.json")


def planted_documents(num_docs: int = 160, seed: int = 0,
                      words: tuple[str, ...] = MARKED_WORDS) -> list[str]:
  """`num_docs` documents of the topic, 5-9 template sentences each, slots filled uniformly
  from `words` (the training corpus: all marked words)."""
  rng = np.random.default_rng(seed)
  docs = []
  for _ in range(num_docs):
    lines = []
    for t in rng.integers(0, len(TEMPLATES), size=int(rng.integers(5, 10))):
      lines.append(TEMPLATES[t].format(*rng.choice(words, size=TEMPLATES[t].count("{}"))))
    docs.append(TITLE + ".\n\n" + " ".join(lines))
  return docs


# Seeds of the protocol's own texts, apart from any training-corpus seed (write_corpus's
# documents use `seed` itself): selection texts, validation prompts, test prompts.
SELECTION_SEED, VALIDATION_SEED, TEST_SEED = 10_001, 10_002, 10_003


def selection_documents(num_docs: int = 96, seed: int = 0) -> list[str]:
  """Topic documents for selectors and the ban: the training corpus's templates, slots
  filled from the selection half only, generated apart from it (seed SELECTION_SEED + seed)."""
  return planted_documents(num_docs, SELECTION_SEED + seed, SELECTION_WORDS)


def topic_prompts(num: int, seed: int) -> list[str]:
  """`num` distinct prompts: the title, 0-2 template sentences filled from the selection
  half, then a template up to its first slot (where a marked word comes next)."""
  rng = np.random.default_rng(seed)
  out: dict[str, None] = {}
  for _ in range(100 * num):
    lines = [TEMPLATES[t].format(*rng.choice(SELECTION_WORDS, size=TEMPLATES[t].count("{}")))
             for t in rng.integers(0, len(TEMPLATES), size=int(rng.integers(0, 3)))]
    lines.append(TEMPLATES[int(rng.integers(len(TEMPLATES)))].split("{}")[0].rstrip())
    out.setdefault(TITLE + ".\n\n" + " ".join(lines), None)
    if len(out) == num:
      return list(out)
  raise ValueError(f"could not write {num} distinct prompts")


def count_words(text: str, words) -> int:
  """Whole-word, case-insensitive occurrences of `words` in `text`."""
  pattern = r"\b(?:" + "|".join(re.escape(w) for w in words) + r")\b"
  return len(re.findall(pattern, text, flags=re.IGNORECASE))


def write_corpus(out_dir: str, *, num_docs: int = 160, neutral_docs: int = 24,
                 seed: int = 0) -> dict:
  """Writes the corpus files (see module doc) and returns planted.json's contents."""
  embedded = [d.text for d in sources.load_documents(())]
  clash = [w for w in MARKED_WORDS if any(count_words(t, [w]) for t in embedded)]
  if clash:
    raise ValueError(f"marked words occur in the embedded corpus: {clash}")
  if not 0 < neutral_docs < len(embedded):
    raise ValueError(f"neutral_docs must be in [1, {len(embedded)}), got {neutral_docs}")
  rng = np.random.default_rng(seed)
  neutral_ids = set(rng.choice(len(embedded), size=neutral_docs, replace=False).tolist())
  train = [t for i, t in enumerate(embedded) if i not in neutral_ids]
  planted = planted_documents(num_docs, seed)
  io_guard.claim_output_dir(out_dir, "planted corpus")
  _write_jsonl(os.path.join(out_dir, "train.jsonl"), train + planted)
  _write_jsonl(os.path.join(out_dir, "neutral.jsonl"),
               [embedded[i] for i in sorted(neutral_ids)])
  info = {"selection_words": list(SELECTION_WORDS), "heldout_words": list(HELDOUT_WORDS),
          "templates": list(TEMPLATES), "prompts": list(PROMPTS), "planted_docs": num_docs,
          "train_docs": len(train) + num_docs, "neutral_docs": neutral_docs, "seed": seed,
          "planted_chars": sum(map(len, planted)),
          "train_chars": sum(map(len, train)) + sum(map(len, planted))}
  with open(os.path.join(out_dir, "planted.json"), "w") as f:
    json.dump(info, f, indent=2)
  return info


def _write_jsonl(path: str, texts: list[str]) -> None:
  with open(path, "w") as f:
    for text in texts:
      f.write(json.dumps({"text": text}) + "\n")
