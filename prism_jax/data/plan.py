"""The work plan of a pack: sources -> units -> pieces, a pure function of the sources.

A unit is a whole .txt / .jsonl file, one row group of a parquet file, or the embedded
corpus. Units are grouped in order into pieces of about `piece_bytes` of text (the file
size, or a row group's uncompressed text column); training and validation files never
share a piece. A piece is what one worker tokenizes and writes in one go, the unit of
parallelism and of resumption, and the scope of the by-document train/val draw. Nothing
here depends on how many processes or workers pack, so neither does the result.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from prism_jax.data import sources as sources_lib

DEFAULT_CORPUS_UNIT = {"kind": "pydoc", "path": sources_lib.DEFAULT_CORPUS, "file": 0,
                       "bytes": 1}


def _file_units(path: str, file_index: int, text_field: str) -> list[dict[str, Any]]:
  kind = sources_lib.file_kind(path)
  if kind != "parquet":
    return [{"kind": kind, "path": path, "file": file_index,
             "bytes": sources_lib.file_size(path)}]
  pf, _ = sources_lib.open_parquet(path, text_field)
  col = pf.schema_arrow.names.index(text_field)
  units, row = [], 0
  for g in range(pf.metadata.num_row_groups):
    rg = pf.metadata.row_group(g)
    units.append({"kind": "parquet", "path": path, "file": file_index, "row_groups": [g, g + 1],
                  "first_row": row, "bytes": max(1, rg.column(col).total_uncompressed_size)})
    row += rg.num_rows
  return units


def make_plan(data_cfg, piece_bytes: int) -> dict[str, Any]:
  """{"files": [...], "pieces": [{"units": [...], "val_files": bool}]}."""
  if not data_cfg.sources:
    return {"files": [sources_lib.DEFAULT_CORPUS],
            "pieces": [{"units": [DEFAULT_CORPUS_UNIT], "val_files": False}]}
  groups = [(sources_lib.resolve_paths(data_cfg.sources), False)]
  if data_cfg.val_sources:
    groups.append((sources_lib.resolve_paths(data_cfg.val_sources), True))
  files, pieces = [], []
  for paths, val_files in groups:
    cur, cur_bytes = [], 0
    for path in paths:
      for unit in _file_units(path, len(files), data_cfg.text_field):
        if cur and cur_bytes + unit["bytes"] > piece_bytes:
          pieces.append({"units": cur, "val_files": val_files})
          cur, cur_bytes = [], 0
        cur.append(unit)
        cur_bytes += unit["bytes"]
      files.append(path)
    if cur:
      pieces.append({"units": cur, "val_files": val_files})
  return {"files": files, "pieces": pieces}


def iter_piece(piece: dict[str, Any], data_cfg: dict[str, Any], warn: bool = True
               ) -> Iterator[tuple[int, str, str]]:
  """(unit index within the piece, name, text) of the piece's non-blank documents."""
  txt_max = sources_lib.txt_max_chars(data_cfg["txt_documents"])
  for u, unit in enumerate(piece["units"]):
    if unit["kind"] == "pydoc":
      records = sources_lib.default_corpus_records()
    else:
      rg = unit.get("row_groups")
      records = sources_lib.iter_records(
          unit["path"], data_cfg["text_field"], data_cfg["on_decode_error"], warn, txt_max,
          tuple(rg) if rg else None, unit.get("first_row", 0))
    for name, text in records:
      if text.strip():
        yield u, name, text


def is_val(piece_index: int, n_docs: int, val_fraction: float, split_seed: int,
           val_files: bool) -> np.ndarray:
  """bool (n_docs,): which of a piece's documents are validation documents.

  A seeded choice of round(val_fraction * n) of them, at least one and at most n - 1 (a
  one-document piece is validation with probability val_fraction). Piece 0 draws with
  the seed alone, as format 1 drew over the whole corpus: a corpus of one piece splits
  exactly as it did before pieces existed.
  """
  if val_files:
    return np.ones(n_docs, bool)
  out = np.zeros(n_docs, bool)
  if val_fraction <= 0 or n_docs == 0:
    return out
  rng = np.random.default_rng(split_seed if piece_index == 0 else [split_seed, piece_index])
  if n_docs == 1:
    out[0] = rng.random() < val_fraction
    return out
  n_val = int(np.clip(round(val_fraction * n_docs), 1, n_docs - 1))
  out[rng.permutation(n_docs)[:n_val]] = True
  return out
