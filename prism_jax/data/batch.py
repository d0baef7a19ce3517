"""The batch contract (data -> train -> attribution) and the one padding function.

A batch is a dict of numpy arrays, all (B, T) but row_id (B,):
  inputs, targets     int32  tokens t and t + 1 of a packed row of T + 1 tokens
  mask                bool   the target is a real token whose input is not the EOS ending a
                             document (no cross-document prediction); False on padding
  example_id, offset  int32  the target token's document and its position in it (-1: pad)
  row_id              int32  the packed row (-1: padding)
Training and scoring read inputs/targets/mask; the ids map a token back to its text.
Padding rows (mask False, ids -1) fill a short batch so one compiled shape serves all.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

KEYS = ("inputs", "targets", "mask", "example_id", "offset", "row_id")
PAD_VALUES = {"inputs": 0, "targets": 0, "mask": False, "example_id": -1, "offset": -1,
              "row_id": -1}


def next_token(tokens_BxL: np.ndarray, mask_BxT: np.ndarray | None = None
               ) -> dict[str, np.ndarray]:
  """inputs/targets/mask of next-token prediction on rows of L = T + 1 tokens (mask
  default: every position)."""
  tokens_BxL = np.asarray(tokens_BxL)
  inputs, targets = tokens_BxL[..., :-1], tokens_BxL[..., 1:]
  mask = np.ones(inputs.shape, bool) if mask_BxT is None else np.asarray(mask_BxT, bool)
  if mask.shape != inputs.shape:
    raise ValueError(f"mask must have the inputs' shape {inputs.shape}, got {mask.shape}")
  return {"inputs": inputs, "targets": targets, "mask": mask}


def from_rows(tokens: np.ndarray, example_id: np.ndarray, offset: np.ndarray,
              row_id: np.ndarray) -> dict[str, np.ndarray]:
  """The contract from packed rows of T + 1 tokens (one row, or a (B, T + 1) block).

  offset 0 marks a document's first token, whose input is the previous document's EOS;
  offset -1 is padding: neither is a training target.
  """
  offset_T = np.asarray(offset)[..., 1:]
  out = next_token(tokens, offset_T > 0)
  out.update(example_id=np.asarray(example_id)[..., 1:], offset=offset_T, row_id=row_id)
  return out


def pad_batch(batch: Mapping[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
  """`batch` with padding rows appended up to `rows` rows (any subset of the keys)."""
  unknown = sorted(set(batch) - set(KEYS))
  if unknown:
    raise ValueError(f"batch keys {unknown} are not in the batch contract {KEYS}")
  have = len(np.asarray(batch["inputs"]))
  if have > rows:
    raise ValueError(f"a batch of {have} rows cannot be padded to {rows} rows")
  if have == rows:
    return dict(batch)
  pad = lambda k, x: np.concatenate([x, np.full((rows - have,) + x.shape[1:], PAD_VALUES[k],
                                                x.dtype)])
  return {k: pad(k, np.asarray(v)) for k, v in batch.items()}
