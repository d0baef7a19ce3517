"""Tokenizers with one small interface: byte-level (no files) and byte-level BPE.

Both are saved as `tokenizer.json` beside the packed data and reloaded by
`load_tokenizer(path_or_dir)`. BPE is trained offline with HuggingFace `tokenizers` to
exactly the model's vocab size, special tokens included, so any text round-trips.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Protocol, Sequence

import numpy as np

TOKENIZER_FILE = "tokenizer.json"
EOS, PAD = "<eos>", "<pad>"
_MIN_VOCAB = 258  # 256 bytes + EOS + PAD


class Tokenizer(Protocol):
  kind: str
  vocab_size: int
  eos_id: int
  pad_id: int

  def encode(self, text: str) -> list[int]: ...
  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...
  def decode(self, ids: Iterable[int], skip_special: bool = True) -> str: ...
  def save(self, directory: str) -> str: ...


def _check_vocab(vocab_size: int, kind: str) -> None:
  if int(vocab_size) < _MIN_VOCAB:
    raise ValueError(f"{kind} tokenizer needs vocab_size >= {_MIN_VOCAB} (256 bytes + "
                     f"<eos> + <pad>), got {vocab_size}")


class ByteTokenizer:
  """UTF-8 bytes are ids 0..255, EOS=256, PAD=257; ids >= 258 are unused model rows."""

  kind = "byte"
  eos_id = 256
  pad_id = 257

  def __init__(self, vocab_size: int = _MIN_VOCAB):
    _check_vocab(vocab_size, "byte")
    self.vocab_size = int(vocab_size)

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [self.encode(t) for t in texts]

  def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
    out, parts = bytearray(), []
    for i in np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids).tolist():
      if 0 <= i < 256:
        out.append(i)
      elif not skip_special:
        parts.append(out.decode("utf-8", errors="replace"))
        out = bytearray()
        parts.append(EOS if i == self.eos_id else PAD if i == self.pad_id else f"<{i}>")
    parts.append(out.decode("utf-8", errors="replace"))
    return "".join(parts)

  def save(self, directory: str) -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, TOKENIZER_FILE)
    with open(path, "w") as f:
      json.dump({"prism_tokenizer": "byte", "vocab_size": self.vocab_size,
                 "eos_id": self.eos_id, "pad_id": self.pad_id}, f, indent=2)
    return path


class BpeTokenizer:
  """A HuggingFace byte-level BPE `tokenizers.Tokenizer` behind the common interface."""

  kind = "bpe"

  def __init__(self, tok):
    self._tok = tok
    # "<eos>" typed in a document is text, not the special token.
    self._tok.encode_special_tokens = True
    self.vocab_size = tok.get_vocab_size()
    self.eos_id = tok.token_to_id(EOS)
    self.pad_id = tok.token_to_id(PAD)
    if self.eos_id is None or self.pad_id is None:
      raise ValueError(f"BPE tokenizer lacks the special tokens {EOS} and {PAD}")

  @property
  def hf_tokenizer(self):
    return self._tok

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

  def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
    ids = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids).tolist()
    return self._tok.decode(ids, skip_special_tokens=skip_special)

  def save(self, directory: str) -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, TOKENIZER_FILE)
    self._tok.save(path)
    return path


def train_bpe(texts: Iterable[str], vocab_size: int) -> BpeTokenizer:
  """Trains byte-level BPE to exactly `vocab_size` ids (<eos>=0, <pad>=1 included).

  If the corpus runs out of merges first, the vocabulary is filled with unused
  `<unused_i>` specials so that ids line up with the model's embedding rows.
  """
  from tokenizers import Tokenizer as HfTokenizer  # pylint: disable=g-import-not-at-top
  from tokenizers import decoders, models, pre_tokenizers, trainers  # pylint: disable=g-import-not-at-top
  _check_vocab(vocab_size, "bpe")
  tok = HfTokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=int(vocab_size), special_tokens=[EOS, PAD], min_frequency=2,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  tok.train_from_iterator(texts, trainer=trainer)
  missing = int(vocab_size) - tok.get_vocab_size()
  if missing > 0:
    tok.add_special_tokens([f"<unused_{i}>" for i in range(missing)])
  if tok.get_vocab_size() != int(vocab_size):
    raise RuntimeError(f"BPE training produced {tok.get_vocab_size()} ids, expected "
                       f"{vocab_size}")
  return BpeTokenizer(tok)


def make_tokenizer(kind: str, vocab_size: int, texts: Iterable[str] | None = None):
  """The tokenizer a DataConfig asks for; BPE trains on `texts`."""
  if kind == "byte":
    return ByteTokenizer(vocab_size)
  if kind == "bpe":
    if texts is None:
      raise ValueError("training a BPE tokenizer needs texts")
    return train_bpe(texts, vocab_size)
  raise ValueError(f"unknown tokenizer kind {kind!r}; choose 'byte' or 'bpe'")


def load_tokenizer(path_or_dir: str):
  """Loads what `save` wrote: a tokenizer.json path or the directory holding it."""
  path = path_or_dir
  if os.path.isdir(path):
    path = os.path.join(path, TOKENIZER_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no tokenizer at {path_or_dir!r} (expected {TOKENIZER_FILE})")
  with open(path) as f:
    spec = json.load(f)
  if spec.get("prism_tokenizer") == "byte":
    return ByteTokenizer(spec["vocab_size"])
  if "model" in spec:
    from tokenizers import Tokenizer as HfTokenizer  # pylint: disable=g-import-not-at-top
    return BpeTokenizer(HfTokenizer.from_file(path))
  raise ValueError(f"{path}: not a tokenizer file written by prism_jax")
