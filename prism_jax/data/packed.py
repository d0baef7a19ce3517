"""Read-only handle on a packed directory: rows, tokenizer, metadata, document snippets."""

from __future__ import annotations

import numpy as np

from prism_jax import io_guard, paths
from prism_jax.data import pack_format as fmt
from prism_jax.data import packing
from prism_jax.data import tokenizers as tok_lib


class PackedData:
  """A finished pack (layout: pack_format.py). Rows are read on demand, never whole."""

  def __init__(self, path: str):
    self.path = paths.resolve(path)  # a local path or a gs:// URI
    paths.check_access(self.path)
    meta_path = paths.path(self.path) / fmt.METADATA
    if not meta_path.is_file():
      partial = (paths.path(self.path) / fmt.PLAN).is_file()
      raise FileNotFoundError(f"{self.path} is not a packed dataset (no {fmt.METADATA})"
                              + ("; it is an unfinished pack: rerun the packing command to "
                                 "finish it" if partial else ""))
    self.metadata = fmt.read_json(str(meta_path))
    fmt.check_format(self.path, self.metadata)
    self.tokenizer = tok_lib.load_tokenizer(self.path)
    cfg = self.metadata["config"]
    self.seq_len = int(cfg["seq_len"])
    self.vocab_size = self.tokenizer.vocab_size
    self.eos_id, self.pad_id = self.tokenizer.eos_id, self.tokenizer.pad_id
    pieces = self.metadata["pieces"]
    self._doc_base = np.concatenate([[0], np.cumsum(pieces["documents"])]).astype(np.int64)
    self._readers = {s: fmt.SplitReader(self.path, s, self.seq_len, pieces[f"{s}_rows"],
                                        pieces["documents"]) for s in fmt.SPLITS}

  def __repr__(self):
    c = self.metadata["counts"]
    return (f"PackedData({self.path!r}, seq_len={self.seq_len}, vocab={self.vocab_size}, "
            f"docs={c['documents']}, rows train={c['train']['rows']} "
            f"val={c['val']['rows']})")

  @staticmethod
  def _check_split(split: str) -> None:
    if split not in fmt.SPLITS:
      raise ValueError(f"unknown split {split!r}; choose from {fmt.SPLITS}")

  def num_rows(self, split: str) -> int:
    self._check_split(split)
    return int(self.metadata["counts"][split]["rows"])

  def reader(self, split: str) -> fmt.SplitReader:
    """The split's picklable random-access reader (the grain source reads through it)."""
    self._check_split(split)
    return self._readers[split]

  def rows(self, split: str) -> dict[str, fmt.RowView]:
    """{"tokens", "example_id", "offset"}: int32 (R, T+1) views that read the rows
    indexed (NumPy indexing; np.asarray reads the whole split)."""
    return {f: fmt.RowView(self.reader(split), f) for f in fmt.FIELDS}

  # --- documents --------------------------------------------------------------------

  @property
  def num_documents(self) -> int:
    return int(self._doc_base[-1])

  def _locate(self, example_id: int) -> tuple[int, int, fmt.PieceIndex]:
    """(piece, index within the piece, the piece's index)."""
    if not 0 <= example_id < self.num_documents:
      raise IndexError(f"example id {example_id} out of range [0, {self.num_documents})")
    k = int(np.searchsorted(self._doc_base, example_id, side="right") - 1)
    return k, int(example_id - self._doc_base[k]), self._readers["train"].index(k)

  def document_name(self, example_id: int) -> str:
    _, i, index = self._locate(example_id)
    return index.name(i)

  def document_split(self, example_id: int) -> str:
    _, i, index = self._locate(example_id)
    return fmt.SPLITS[int(index.split_D[i])]

  def document_ids(self, split: str) -> np.ndarray:
    """Every document of the split (reads each piece's index)."""
    self._check_split(split)
    s, reader = fmt.SPLITS.index(split), self._readers[split]
    parts = [self._doc_base[k] + reader.index(k).local[s]
             for k in range(len(self._doc_base) - 1)]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

  def document_tokens(self, example_id: int, with_eos: bool = False) -> np.ndarray:
    """The document's tokens, read back from the packed rows."""
    k, i, index = self._locate(example_id)
    split = fmt.SPLITS[int(index.split_D[i])]
    start, length = int(index.start_D[i]), int(index.length_D[i])
    reader, T = self._readers[split], self.seq_len
    pos_L = np.arange(start, start + length)
    row_L = (pos_L - 1) // T  # stream position p >= 1 is target column p - r*T of row r
    rows = np.unique(row_L)
    block = reader.tokens(reader.row_base[k] + rows)
    tokens = block[np.searchsorted(rows, row_L), pos_L - row_L * T]
    return tokens if with_eos else tokens[:-1]

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


def prepare_data(data_cfg, vocab_size: int, workdir: str, *, workers: int | None = None
                 ) -> PackedData:
  """Packs data_cfg's sources (once) into data_cfg.packed_dir or <workdir>/data.

  The trainer's single entry point, called by every process of a job: they pack
  together (packing.pack), reuse a finished pack of the same config, refuse one of
  another config, and return the handle.

  Args:
    data_cfg (DataConfig): the sources, tokenizer, seq_len, validation split and
      packed_dir ("" packs into <workdir>/data; a relative one is tried against the cwd,
      then the workdir).
    vocab_size: the model's vocabulary size: the size of a byte/char/BPE tokenizer built
      here, an upper bound on a pretrained (gpt2/neox) one's.
    workdir: the run directory (a local path or a gs:// URI) that holds the default
      <workdir>/data.
    workers: worker processes per process for the packing; None (default) uses the CPU
      count, 0 or 1 packs in this process.

  Returns:
    A `PackedData`: the read-only handle on the finished pack (tokenizer, metadata,
    train/val rows, document snippets).
  """
  out_dir = io_guard.find_packed_dir(workdir, data_cfg.packed_dir, must_exist=False)
  return PackedData(packing.pack(data_cfg, vocab_size, out_dir, workers=workers))


def run_tokenizer(workdir: str, packed_dir: str):
  """The tokenizer a run saved beside its packed data (`data.packed_dir` of its config)."""
  return tok_lib.load_tokenizer(io_guard.find_packed_dir(workdir, packed_dir))

