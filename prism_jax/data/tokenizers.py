"""Tokenizers with one small interface: byte-level (no files), character-level, byte-level
BPE trained on the corpus, and the pretrained GPT-2 / GPT-NeoX-20B BPEs (pretrained.py).

All are saved as `tokenizer.json` beside the packed data and reloaded by
`load_tokenizer(path_or_dir)`, so a run never needs the original files again. BPE is trained
offline with HuggingFace `tokenizers` to exactly the model's vocab size, special tokens
included, so any text round-trips. `char` maps every distinct character of the training
text to an id; a character it never saw maps to `<unk>` (id 2).
"""

from __future__ import annotations

import json
from typing import Callable, Iterable, Protocol, Sequence

import numpy as np

from prism_jax import paths
from prism_jax.data import pretrained

TOKENIZER_FILE = "tokenizer.json"
EOS, PAD, UNK = "<eos>", "<pad>", "<unk>"
_MIN_VOCAB = 258  # 256 bytes + EOS + PAD


class Tokenizer(Protocol):
  kind: str
  vocab_size: int
  eos_id: int
  pad_id: int

  def encode(self, text: str) -> list[int]: ...
  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...
  def decode(self, ids: Iterable[int], skip_special: bool = True) -> str: ...
  def piece(self, token_id: int) -> str: ...
  def save(self, directory: str) -> str: ...


def show_bytes(raw: bytes) -> str:
  """Bytes as text for a person: each valid UTF-8 character as itself, every byte that is
  not part of one as `<0xNN>` (a byte-level token is often part of a character: decoded
  alone it would print as U+FFFD, every such token the same "\ufffd")."""
  out, i = [], 0
  while i < len(raw):
    for j in range(min(len(raw), i + 4), i, -1):  # the longest valid character at i
      try:
        out.append(raw[i:j].decode("utf-8"))
        i = j
        break
      except UnicodeDecodeError:
        continue
    else:
      out.append(f"<0x{raw[i]:02X}>")
      i += 1
  return "".join(out)


def piece(tokenizer, token_id: int) -> str:
  """One token as a person should see it (`Tokenizer.piece`; a tokenizer without the method,
  a user's own, falls back to decoding the id alone)."""
  show = getattr(tokenizer, "piece", None)
  return show(int(token_id)) if show is not None else tokenizer.decode([int(token_id)])


def piece_fn(decode: Callable) -> Callable[[int], str]:
  """How one token id is shown, given what a caller holds: a tokenizer's bound `decode`
  gives that tokenizer's `piece`; any other decode function, decode([id])."""
  owner = getattr(decode, "__self__", None)
  if owner is not None and hasattr(owner, "piece"):
    return lambda i: owner.piece(int(i))
  return lambda i: decode([int(i)])


def _byte_level_table() -> dict[str, int]:
  """GPT-2's byte-level alphabet (Radford et al. 2019, `bytes_to_unicode`), reversed:
  the character a byte-level BPE vocabulary writes for each byte -> that byte."""
  keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
          + list(range(ord("\xae"), ord("\xff") + 1)))
  chars, n = {b: b for b in keep}, 0
  for b in range(256):
    if b not in chars:
      chars[b] = 256 + n
      n += 1
  return {chr(c): b for b, c in chars.items()}


_BYTE_OF = _byte_level_table()


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

  def piece(self, token_id: int) -> str:
    return show_bytes(bytes([token_id])) if 0 <= token_id < 256 else self.decode([token_id])

  def save(self, directory: str) -> str:
    return _save_json(directory, {"prism_tokenizer": "byte", "vocab_size": self.vocab_size,
                                  "eos_id": self.eos_id, "pad_id": self.pad_id})


class CharTokenizer:
  """Character-level: <eos>=0, <pad>=1, <unk>=2, then the corpus's characters in code-point
  order. Ids >= 3 + len(chars) up to vocab_size are unused model rows."""

  kind = "char"
  eos_id, pad_id, unk_id = 0, 1, 2
  _SPECIALS = 3

  def __init__(self, chars: Sequence[str], vocab_size: int | None = None):
    self.chars = sorted(set(chars))
    if any(len(c) != 1 for c in self.chars):
      raise ValueError("char tokenizer: every vocabulary entry must be one character")
    needed = self._SPECIALS + len(self.chars)
    self.vocab_size = needed if vocab_size is None else int(vocab_size)
    if self.vocab_size < needed:
      raise ValueError(f"char tokenizer: the training text has {len(self.chars)} distinct "
                       f"characters, which need vocab_size >= {needed} (3 specials + "
                       f"characters); model.vocab_size={self.vocab_size}: set "
                       f"--set model.vocab_size={needed}")
    self._ids = {c: i + self._SPECIALS for i, c in enumerate(self.chars)}

  @classmethod
  def from_texts(cls, texts: Iterable[str], vocab_size: int | None = None) -> "CharTokenizer":
    seen: set[str] = set()
    for t in texts:
      seen.update(t)
    if not seen:
      raise ValueError("char tokenizer: the training text is empty")
    return cls(sorted(seen), vocab_size)

  def encode(self, text: str) -> list[int]:
    get, unk = self._ids.get, self.unk_id
    return [get(c, unk) for c in text]

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [self.encode(t) for t in texts]

  def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
    names = {self.eos_id: EOS, self.pad_id: PAD, self.unk_id: UNK}
    out = []
    for i in np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids).tolist():
      if self._SPECIALS <= i < self._SPECIALS + len(self.chars):
        out.append(self.chars[i - self._SPECIALS])
      elif not skip_special:
        out.append(names.get(i, f"<{i}>"))
    return "".join(out)

  def piece(self, token_id: int) -> str:
    return self.decode([token_id])

  def save(self, directory: str) -> str:
    return _save_json(directory, {"prism_tokenizer": "char", "vocab_size": self.vocab_size,
                                  "chars": "".join(self.chars)})


class BpeTokenizer:
  """A HuggingFace byte-level BPE `tokenizers.Tokenizer` behind the common interface.

  The end-of-document / padding specials are ours (`<eos>`, `<pad>`) for a BPE trained here,
  `<|endoftext|>` (GPT-2: also the padding id) or `<|endoftext|>` / `<|padding|>` (NeoX).
  """

  def __init__(self, tok, kind: str = "bpe"):
    self._tok = tok
    self.kind = kind
    # "<eos>" typed in a document is text, not the special token.
    self._tok.encode_special_tokens = True
    self.vocab_size = tok.get_vocab_size()
    self.eos_id, self.pad_id = _special_ids(tok)

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

  def piece(self, token_id: int) -> str:
    text = self.decode([token_id])
    if "\ufffd" not in text:
      return text
    name = self._tok.id_to_token(int(token_id)) or ""
    if not name or any(c not in _BYTE_OF for c in name):
      return text  # not a byte-level entry: its own decoding is all there is
    return show_bytes(bytes(_BYTE_OF[c] for c in name))

  def save(self, directory: str) -> str:
    return _save_json(directory, json.loads(self._tok.to_str()))


def train_bpe(texts: Iterable[str], vocab_size: int) -> BpeTokenizer:
  """Trains byte-level BPE to exactly `vocab_size` ids (<eos>=0, <pad>=1 included).

  If the corpus runs out of merges first, the vocabulary is filled with unused
  `<unused_i>` specials so that ids line up with the model's embedding rows.
  """
  from tokenizers import Tokenizer as HfTokenizer  # pylint: disable=g-import-not-at-top  (deferred: tokenizers, only for a BPE)
  from tokenizers import decoders, models, pre_tokenizers, trainers  # pylint: disable=g-import-not-at-top  (deferred: tokenizers, only for a BPE)
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


FOREIGN_EOS = ("<|endoftext|>", "<|end_of_text|>", "</s>")


def _special_ids(tok) -> tuple[int, int]:
  """(eos, pad) ids of a HuggingFace tokenizer by the names our kinds use."""
  eos, pad = tok.token_to_id(EOS), tok.token_to_id(PAD)
  if eos is None:
    # GPT-2, NeoX and Qwen2's name first, then Llama 3's, then Llama 2's and Mistral's.
    eos = next((i for i in map(tok.token_to_id, FOREIGN_EOS) if i is not None), None)
    pad = tok.token_to_id("<|padding|>")
    pad = eos if pad is None else pad  # GPT-2 has no padding token; padding is masked
  if eos is None or pad is None:
    raise ValueError(f"BPE tokenizer lacks an end-of-document token ({EOS} or one of "
                     f"{', '.join(FOREIGN_EOS)})")
  return eos, pad


KINDS = ("byte", "char", "bpe", "gpt2", "neox")


def make_tokenizer(kind: str, vocab_size: int, texts: Iterable[str] | None = None):
  """The tokenizer a DataConfig asks for; BPE and char learn from `texts` (train split)."""
  if kind == "byte":
    return ByteTokenizer(vocab_size)
  if kind in ("bpe", "char") and texts is None:
    raise ValueError(f"building a {kind} tokenizer needs the training texts")
  if kind == "bpe":
    return train_bpe(texts, vocab_size)
  if kind == "char":
    return CharTokenizer.from_texts(texts, vocab_size)
  if kind in ("gpt2", "neox"):
    tok = BpeTokenizer(pretrained.load_hf(kind), kind)
    if tok.vocab_size > int(vocab_size):
      raise ValueError(f"the {kind} tokenizer has {tok.vocab_size} ids but model.vocab_size="
                       f"{vocab_size}; set --set model.vocab_size={tok.vocab_size} (or more)")
    return tok
  raise ValueError(f"unknown tokenizer kind {kind!r}; choose one of {KINDS}")


def _save_json(directory: str, spec: dict) -> str:
  """Writes <directory>/tokenizer.json (local or gs://); returns its path."""
  paths.path(directory).mkdir(parents=True, exist_ok=True)
  path = paths.join(directory, TOKENIZER_FILE)
  paths.write_text_atomic(path, json.dumps(spec, indent=2, ensure_ascii=False))
  return path


def load_tokenizer(path_or_dir: str):
  """Loads what `save` wrote: a tokenizer.json path or the directory holding it."""
  path = paths.resolve(path_or_dir)  # a local path or a gs:// URI
  if paths.path(path).is_dir():
    path = paths.join(path, TOKENIZER_FILE)
  if not paths.path(path).is_file():
    raise FileNotFoundError(f"no tokenizer at {path_or_dir!r} (expected {TOKENIZER_FILE})")
  try:
    return _from_text(paths.path(path).read_text(encoding="utf-8"))
  except (OSError, ImportError):  # unreadable, or `tokenizers` missing: their own errors
    raise
  except Exception as e:  # pylint: disable=broad-except  (tokenizers raises bare Exception)
    # JSON, UTF-8, a missing key or the tokenizers library's own parse error: one line that
    # names the file (a traceback ending in "line 1 column 1" names none).
    why = " ".join(str(e).split())[:200] or type(e).__name__
    raise ValueError(f"{path}: not a valid tokenizer file ({type(e).__name__}: {why})"
                     ) from e


def _from_text(text: str):
  spec = json.loads(text)
  if not isinstance(spec, dict):
    raise TypeError(f"a JSON {type(spec).__name__}, not an object")
  if spec.get("prism_tokenizer") == "byte":
    return ByteTokenizer(spec["vocab_size"])
  if spec.get("prism_tokenizer") == "char":
    return CharTokenizer(list(spec["chars"]), spec["vocab_size"])
  if "model" in spec:
    from tokenizers import Tokenizer as HfTokenizer  # pylint: disable=g-import-not-at-top  (deferred: tokenizers, only for a BPE)
    hf = HfTokenizer.from_str(text)
    kind = "bpe" if hf.token_to_id(EOS) is not None else (
        "neox" if hf.token_to_id("<|padding|>") is not None else "gpt2")
    return BpeTokenizer(hf, kind)
  raise ValueError("not written by prism_jax (no prism_tokenizer, no model)")
