"""Text sources: .txt files/globs, .jsonl, .parquet and the embedded default corpus.

Every source yields `Document`s with a stable integer id (order of sources, then order
within each file) and a human-readable name (`file:line`, `file:row` or `pydoc:topic`),
so that attribution can map a training token back to its text.

The embedded corpus is the documentation topics every CPython install carries
(`pydoc_data.topics.topics`, ~80 topics, ~0.5 MB): the demo runs offline on a fresh machine.
"""

from __future__ import annotations

import codecs
import dataclasses
import glob
import hashlib
import json
import os
import threading
from typing import Iterator, Sequence

from absl import logging

from prism_jax import paths as paths_lib

DEFAULT_CORPUS = "pydoc_data.topics"
# Long texts (.txt files, long pydoc topics) are split at blank lines into documents of
# about this many characters: whole-file documents would make a by-document split useless.
DOC_MAX_CHARS = 2048
_HASH_CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True)
class Document:
  example_id: int
  name: str  # "path:line", "path:row" or "pydoc:topic"
  text: str


# --- non-UTF-8 bytes -------------------------------------------------------------------

_counter = threading.local()


def _count_and_replace(err: UnicodeDecodeError):
  _counter.bytes += err.end - err.start
  if _counter.first is None:
    _counter.first = err.start
  return "\ufffd", err.end


codecs.register_error("prism_count_replace", _count_and_replace)


class Utf8Decoder:
  """Decodes one file's bytes (whole or in pieces); "replace" writes U+FFFD and counts the
  bytes replaced, "strict" raises naming the file and the byte offset."""

  def __init__(self, path: str, on_decode_error: str):
    if on_decode_error not in ("replace", "strict"):
      raise ValueError(f"on_decode_error={on_decode_error!r} is not 'replace' or 'strict'")
    self.path, self.mode = path, on_decode_error
    self.replaced, self.first = 0, None

  def __call__(self, raw: bytes, offset: int = 0, where: str | None = None) -> str:
    """`offset`: where `raw` starts in the file; `where`: how to name it in errors."""
    if self.mode == "strict":
      try:
        return raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise ValueError(
            f"{where or self.path}: invalid UTF-8 at byte offset {offset + e.start} "
            f"({e.reason}); set data.on_decode_error=replace to decode such bytes as "
            "U+FFFD") from None
    _counter.bytes, _counter.first = 0, None
    text = raw.decode("utf-8", errors="prism_count_replace")
    if _counter.bytes:
      self.replaced += _counter.bytes
      if self.first is None:
        self.first = offset + _counter.first
    return text

  def check_str(self, value: str, where: str) -> str:
    """JSON "\\ud800" escapes decode to lone surrogates, which are not UTF-8 text."""
    try:
      value.encode("utf-8")
      return value
    except UnicodeEncodeError as e:
      if self.mode == "strict":
        raise ValueError(f"{where}: lone surrogate U+{ord(value[e.start]):04X} at "
                         f"character {e.start} is not valid UTF-8 text") from None
    raw = value.encode("utf-8", "surrogatepass")
    return self(raw, 0, where)

  def report(self, warn: bool = True) -> None:
    if self.replaced and warn:
      logging.warning("%s: replaced %d non-UTF-8 byte(s) with U+FFFD (first at byte "
                      "offset %d)", self.path, self.replaced, self.first)


def decode_bytes(raw: bytes, where: str, on_decode_error: str, warn: bool = True) -> str:
  """UTF-8 decode of one blob; see Utf8Decoder."""
  decoder = Utf8Decoder(where, on_decode_error)
  text = decoder(raw)
  decoder.report(warn)
  _counter.last = decoder.replaced
  return text


def replaced_bytes_last_decode() -> int:
  """Bytes replaced by the last file decoded on this thread (for tests)."""
  return getattr(_counter, "last", 0)


# --- paths ---------------------------------------------------------------------------

_KINDS = {".txt": "txt", ".text": "txt", ".md": "txt", ".jsonl": "jsonl",
          ".parquet": "parquet"}


def _kind(path: str) -> str:
  ext = os.path.splitext(path)[1].lower()
  if ext not in _KINDS:
    raise ValueError(f"{path}: unsupported file type {ext!r}; expected one of "
                     f"{sorted(_KINDS)}")
  return _KINDS[ext]


def resolve_paths(sources: Sequence[str]) -> list[str]:
  """Expands globs in order (sorted within a glob); errors name what matched nothing."""
  if isinstance(sources, str):
    sources = (sources,)
  found = []
  for src in sources:  # local paths or gs:// URIs (paths_lib: epath / fsspec)
    if glob.has_magic(src):
      matched = paths_lib.glob(src)
      if not matched:
        raise FileNotFoundError(f"data source glob {src!r} matches no files")
      found.extend(matched)
    elif paths_lib.path(src).is_dir():
      raise IsADirectoryError(f"data source {src!r} is a directory; pass a glob such as "
                              f"'{os.path.join(src, '*.txt')}'")
    elif not paths_lib.path(src).is_file():
      raise FileNotFoundError(f"data source {src!r} does not exist")
    else:
      found.append(src)
  for p in found:
    _kind(p)
    if _size(p) == 0:
      raise ValueError(f"data source {p!r} is empty (0 bytes)")
  return found


def file_size(p: str) -> int:
  return _size(p)


def _size(p: str) -> int:
  return os.path.getsize(p) if not paths_lib.is_remote(p) else paths_lib.path(p).stat().length


# --- splitting long texts ------------------------------------------------------------


def split_paragraphs(text: str, max_chars: int = DOC_MAX_CHARS) -> list[tuple[int, str]]:
  """Splits at blank lines into chunks of <= max_chars (a longer paragraph stays whole,
  cut at line ends). Returns (0-based line of the chunk start, chunk text); chunks
  joined back with their separators give the text again."""
  lines = text.splitlines(keepends=True)
  chunks, cur, cur_len, cur_line = [], [], 0, 0
  for i, line in enumerate(lines):
    blank = not line.strip()
    # Close the chunk at a paragraph start (a non-blank line after a blank one) if this
    # chunk is full, or anywhere when a single paragraph overflows twice over.
    para_start = not blank and i > 0 and not lines[i - 1].strip()
    if cur and ((para_start and cur_len + len(line) > max_chars)
                or cur_len + len(line) > 2 * max_chars):
      chunks.append((cur_line, "".join(cur)))
      cur, cur_len, cur_line = [], 0, i
    cur.append(line)
    cur_len += len(line)
  if cur:
    chunks.append((cur_line, "".join(cur)))
  return [(ln, c) for ln, c in chunks if c.strip()]


# --- readers -------------------------------------------------------------------------


def txt_max_chars(txt_documents: str) -> int | None:
  """DataConfig.txt_documents -> the chunk size for .txt files (None: the whole file)."""
  if txt_documents == "file":
    return None
  if txt_documents == "paragraphs":
    return DOC_MAX_CHARS
  if str(txt_documents).isdigit() and int(txt_documents) > 0:
    return int(txt_documents)
  raise ValueError(f"txt_documents={txt_documents!r}: use 'file', 'paragraphs' or a "
                   "positive number of characters")


def _read_txt(path, on_decode_error, warn, max_chars=DOC_MAX_CHARS):
  with paths_lib.open_file(path, "rb") as f:
    text = decode_bytes(f.read(), path, on_decode_error, warn)
  if max_chars is None:
    yield f"{path}:1", text
    return
  for line, chunk in split_paragraphs(text, max_chars):
    yield f"{path}:{line + 1}", chunk


def _read_jsonl(path, text_field, on_decode_error, warn):
  decoder = Utf8Decoder(path, on_decode_error)
  offset = 0
  with paths_lib.open_file(path, "rb") as f:
    for i, raw in enumerate(f):
      where = f"{path}:{i + 1}"
      line = decoder(raw, offset, where)
      offset += len(raw)
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
      if not isinstance(record, dict) or text_field not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{where}: no text field {text_field!r} (found {keys}); set "
                         "data.text_field")
      value = record[text_field]
      if value is None:
        continue
      if not isinstance(value, str):
        raise ValueError(f"{where}: field {text_field!r} is {type(value).__name__}, not "
                         "a string")
      yield where, decoder.check_str(value, where)
  decoder.report(warn)
  _counter.last = decoder.replaced


def open_parquet(path, text_field):
  """(ParquetFile, is_binary) after checking the text column; errors name the file."""
  import pyarrow as pa  # pylint: disable=g-import-not-at-top  (deferred: pyarrow, for parquet only)
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top  (deferred: pyarrow, for parquet only)
  try:
    pf = pq.ParquetFile(path if not paths_lib.is_remote(path) else paths_lib.open_file(path))
  except (pa.ArrowException, OSError) as e:  # pyarrow's message lacks the file name
    raise ValueError(f"{path}: not a readable parquet file ({e})") from e
  names = pf.schema_arrow.names
  if text_field not in names:
    raise ValueError(f"{path}: no column {text_field!r} (columns: {names}); set "
                     "data.text_field")
  col_type = pf.schema_arrow.field(text_field).type
  is_binary = pa.types.is_binary(col_type) or pa.types.is_large_binary(col_type)
  if not (is_binary or pa.types.is_string(col_type) or pa.types.is_large_string(col_type)):
    raise ValueError(f"{path}: column {text_field!r} has type {col_type}, not text")
  return pf, is_binary


_PARQUET_BATCH_ROWS = 1024  # rows decoded at a time: memory stays one batch, not a group


def _read_parquet(path, text_field, on_decode_error, warn, row_groups=None, first_row=0):
  """`row_groups`: (first, end) of the groups to read (all by default); `first_row`: the
  file row where the first of them starts (names are `path:row`)."""
  import pyarrow as pa  # pylint: disable=g-import-not-at-top  (deferred: pyarrow, for parquet only)
  pf, is_binary = open_parquet(path, text_field)
  decoder = Utf8Decoder(path, on_decode_error)
  row = first_row
  g0, g1 = row_groups or (0, pf.num_row_groups)
  for g in range(g0, g1):
    batches = pf.iter_batches(_PARQUET_BATCH_ROWS, row_groups=[g], columns=[text_field])
    while True:
      try:
        batch = next(batches, None)
      except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: row group {g} is unreadable ({e})") from e
      if batch is None:
        break
      yield from _parquet_values(batch.column(0).to_pylist(), path, row, is_binary, decoder)
      row += batch.num_rows
  decoder.report(warn)
  _counter.last = decoder.replaced


def _parquet_values(values, path, row, is_binary, decoder):
  del path
  for value in values:
    where = f"{decoder.path}:{row}"
    row += 1
    if value is None:
      continue
    if is_binary:
      value = decoder(value, 0, where)  # offsets count within the value
    yield where, value


def _read_default_corpus():
  from pydoc_data import topics  # pylint: disable=g-import-not-at-top  (deferred: pydoc_data, the embedded corpus, 0.8 MB)
  for name in sorted(topics.topics):
    chunks = split_paragraphs(topics.topics[name])
    for part, (_, chunk) in enumerate(chunks):
      yield (f"pydoc:{name}" if len(chunks) == 1 else f"pydoc:{name}#{part}"), chunk


def iter_documents(sources: Sequence[str] = (), text_field: str = "text",
                   on_decode_error: str = "replace", warn: bool = True,
                   txt_documents: str = "paragraphs", first_id: int = 0
                   ) -> Iterator[Document]:
  """Yields every non-blank document of the sources; () means the embedded corpus.

  Ids count documents in order from `first_id`, so the same sources always give the same
  ids. `warn=False` silences the non-UTF-8 warnings (for a second pass over the same
  files); `txt_documents` as in DataConfig.
  """
  if not sources:
    records = _read_default_corpus()
  else:
    records = _iter_files(resolve_paths(sources), text_field, on_decode_error, warn,
                          txt_max_chars(txt_documents))
  example_id = first_id
  for name, text in records:
    if text.strip():
      yield Document(example_id, name, text)
      example_id += 1


def file_kind(path: str) -> str:
  """"txt", "jsonl" or "parquet" (errors on any other extension)."""
  return _kind(path)


def iter_records(path: str, text_field: str = "text", on_decode_error: str = "replace",
                 warn: bool = True, txt_max: int | None = DOC_MAX_CHARS,
                 row_groups: tuple[int, int] | None = None, first_row: int = 0
                 ) -> Iterator[tuple[str, str]]:
  """(name, text) of one file's records, blank ones included; `row_groups` and
  `first_row` read part of a parquet file (see _read_parquet)."""
  kind = _kind(path)
  if kind == "txt":
    return _read_txt(path, on_decode_error, warn, txt_max)
  if kind == "jsonl":
    return _read_jsonl(path, text_field, on_decode_error, warn)
  return _read_parquet(path, text_field, on_decode_error, warn, row_groups, first_row)


def default_corpus_records() -> Iterator[tuple[str, str]]:
  return _read_default_corpus()


def _iter_files(paths, text_field, on_decode_error, warn, txt_max=DOC_MAX_CHARS):
  for path in paths:
    n = 0
    gen = iter_records(path, text_field, on_decode_error, warn, txt_max)
    for name, text in gen:
      if text.strip():
        n += 1
        yield name, text
    if n == 0:
      raise ValueError(f"data source {path!r} holds no non-blank documents")


def load_documents(sources: Sequence[str] = (), text_field: str = "text",
                   on_decode_error: str = "replace") -> list[Document]:
  docs = list(iter_documents(sources, text_field, on_decode_error))
  if not docs:
    raise ValueError(f"no documents in data sources {list(sources) or DEFAULT_CORPUS}")
  return docs


def check_disjoint(sources: Sequence[str], val_sources: Sequence[str]) -> None:
  """Validation files must not also be training files (the split would leak)."""
  real = lambda p: p if paths_lib.is_remote(p) else os.path.realpath(p)
  train = {real(p) for p in resolve_paths(sources)}
  shared = sorted(p for p in resolve_paths(val_sources) if real(p) in train)
  if shared:
    raise ValueError(f"data.val_sources {shared} are also in data.sources: validation "
                     "text must not be training text")


def source_hash(sources: Sequence[str] = (), text_field: str = "text",
                val_sources: Sequence[str] = ()) -> str:
  """sha256 of the sources' bytes (in order) and the text field: identifies the corpus.
  A gs:// file enters by its size and stored crc32c instead of its bytes (reusing a pack
  must not download the corpus). Validation sources, when given, follow the training
  ones behind a marker."""
  if val_sources:
    h = hashlib.sha256(source_hash(sources, text_field).encode())
    h.update(b"\nval_sources\n" + source_hash(val_sources, text_field).encode())
    return h.hexdigest()
  h = hashlib.sha256()
  h.update(f"text_field={text_field}\n".encode())
  if not sources:
    from pydoc_data import topics  # pylint: disable=g-import-not-at-top  (deferred: pydoc_data, the embedded corpus, 0.8 MB)
    h.update(json.dumps(topics.topics, sort_keys=True).encode())
    return h.hexdigest()
  for path in resolve_paths(sources):
    h.update(f"file {_size(path)}\n".encode())
    stored = _stored_checksum(path)
    if stored:  # an object store's own content checksum: no download of the corpus
      h.update(f"checksum {stored}\n".encode())
      continue
    with paths_lib.open_file(path, "rb") as f:
      while chunk := f.read(_HASH_CHUNK):
        h.update(chunk)
  return h.hexdigest()


def _stored_checksum(path: str) -> str | None:
  """A gs:// object's crc32c (GCS computes it from the content on upload), else None."""
  if paths_lib.scheme(path) != "gs":
    return None
  import fsspec  # pylint: disable=g-import-not-at-top  (deferred: fsspec, for gs:// only)
  fs = fsspec.filesystem("gs")
  fs.invalidate_cache(path)  # a listing cached before the file was written would hide it
  info = fs.info(path)
  return f"crc32c:{info['crc32c']}" if info.get("crc32c") else None
