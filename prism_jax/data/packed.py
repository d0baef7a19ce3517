"""Read-only handle on a packed directory: rows, tokenizer, metadata, document snippets."""

from __future__ import annotations

import functools
import json

import numpy as np

from prism_jax import io_guard, paths
from prism_jax.data import packing
from prism_jax.data import tokenizers as tok_lib


class PackedData:
  """A finished pack (see packing.py for the layout). Arrays are memory-mapped."""

  def __init__(self, path: str):
    self.path = paths.resolve(path)  # a local path or a gs:// URI
    paths.check_access(self.path)
    meta_path = paths.path(self.path) / packing.METADATA
    if not meta_path.is_file():
      raise FileNotFoundError(f"{self.path} is not a packed dataset (no {packing.METADATA})")
    self.metadata = json.loads(meta_path.read_text())
    self.tokenizer = tok_lib.load_tokenizer(self.path)
    cfg = self.metadata["config"]
    self.seq_len = int(cfg["seq_len"])
    self.vocab_size = self.tokenizer.vocab_size
    self.eos_id, self.pad_id = self.tokenizer.eos_id, self.tokenizer.pad_id
    self._rows = {}

  def __repr__(self):
    c = self.metadata["counts"]
    return (f"PackedData({self.path!r}, seq_len={self.seq_len}, vocab={self.vocab_size}, "
            f"docs={c['documents']}, rows train={c['train']['rows']} "
            f"val={c['val']['rows']})")

  @staticmethod
  def _check_split(split: str) -> None:
    if split not in packing.SPLITS:
      raise ValueError(f"unknown split {split!r}; choose from {packing.SPLITS}")

  def num_rows(self, split: str) -> int:
    self._check_split(split)
    return int(self.metadata["counts"][split]["rows"])

  def array_path(self, split: str, field: str) -> str:
    self._check_split(split)
    return paths.join(self.path, f"{split}_{field}.npy")

  def rows(self, split: str) -> dict[str, np.ndarray]:
    """{"tokens", "example_id", "offset"}: int32 (R, T+1) memory maps (read whole from an
    object store)."""
    if split not in self._rows:
      self._rows[split] = {f: paths.load_npy(self.array_path(split, f))
                           for f in packing.FIELDS}
    return self._rows[split]

  # --- documents --------------------------------------------------------------------

  @functools.cached_property
  def _documents_Nx3(self) -> np.ndarray:
    return paths.load_npy(paths.join(self.path, "documents.npy"), mmap=False)

  @functools.cached_property
  def _names(self) -> list[str]:
    return paths.path(self.path).joinpath("names.txt").read_text(
        encoding="utf-8").split("\n")[:-1]

  @property
  def num_documents(self) -> int:
    return len(self._documents_Nx3)

  def _doc(self, example_id: int) -> tuple[int, int, int]:
    if not 0 <= example_id < self.num_documents:
      raise IndexError(f"example id {example_id} out of range [0, {self.num_documents})")
    split, start, length = (int(v) for v in self._documents_Nx3[example_id])
    return split, start, length

  def document_name(self, example_id: int) -> str:
    self._doc(example_id)
    return self._names[example_id]

  def document_split(self, example_id: int) -> str:
    return packing.SPLITS[self._doc(example_id)[0]]

  def document_ids(self, split: str) -> np.ndarray:
    self._check_split(split)
    return np.flatnonzero(self._documents_Nx3[:, 0] == packing.SPLITS.index(split))

  def document_tokens(self, example_id: int, with_eos: bool = False) -> np.ndarray:
    """The document's tokens, read back from the packed rows."""
    split, start, length = self._doc(example_id)
    T = self.seq_len
    pos_L = np.arange(start, start + length)
    row_L = (pos_L - 1) // T  # stream position p >= 1 is target column p - r*T of row r
    tokens = self.rows(packing.SPLITS[split])["tokens"][row_L, pos_L - row_L * T]
    return np.asarray(tokens if with_eos else tokens[:-1])

  def document_text(self, example_id: int) -> str:
    return self.tokenizer.decode(self.document_tokens(example_id))

  def snippet_parts(self, example_id: int, offset: int, width: int = 32
                    ) -> tuple[str, str, str]:
    """(text before, the token at `offset`, text after), `width` tokens each side."""
    tokens = self.document_tokens(example_id, with_eos=True)
    if not 0 <= offset < len(tokens):
      raise IndexError(f"offset {offset} out of range for document {example_id} "
                       f"({len(tokens)} tokens with EOS)")
    dec = self.tokenizer.decode
    return (dec(tokens[max(0, offset - width):offset]),
            dec(tokens[offset:offset + 1], skip_special=False),
            dec(tokens[offset + 1:offset + 1 + width]))

  def snippet(self, example_id: int, offset: int, width: int = 32) -> str:
    """`name: ...before[[token]]after...`: where a training token sits in its text."""
    before, token, after = self.snippet_parts(example_id, offset, width)
    return f"{self.document_name(example_id)}: {before}[[{token}]]{after}"


def prepare_data(data_cfg, vocab_size: int, workdir: str) -> PackedData:
  """Packs data_cfg's sources (once) into data_cfg.packed_dir or <workdir>/data.

  The trainer's single entry point: reuses a finished pack of the same config, refuses
  one of another config, and returns the handle (tokenizer, metadata, rows, snippets).
  """
  out_dir = io_guard.find_packed_dir(workdir, data_cfg.packed_dir, must_exist=False)
  return PackedData(packing.pack(data_cfg, vocab_size, out_dir))
