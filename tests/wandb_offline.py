"""Reads an offline W&B run file (run-<id>.wandb) back: its run id and history rows.

The file is W&B's record log (the LevelDB log layout: a 7-byte ":W&B" header, 32 KiB
blocks, records split FULL / FIRST / MIDDLE / LAST behind a 7-byte crc-length-type header)
of `wandb.proto.wandb_internal_pb2.Record` messages; wandb itself no longer ships a Python
reader, so the tests read it with this."""

import json
import struct

BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _records(data: bytes):
  ident, _, _ = struct.unpack("<4sHB", data[:7])
  if ident != b":W&B":
    raise ValueError(f"not a W&B run file (header {ident!r})")
  pos, buf = 7, b""
  while pos + 7 <= len(data):
    left = BLOCK - pos % BLOCK
    if left < 7:  # block trailer: padding
      pos += left
      continue
    _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
    if kind == 0 and length == 0:  # zero fill to the block's end
      pos += left
      continue
    chunk = data[pos + 7:pos + 7 + length]
    pos += 7 + length
    if kind == FULL:
      yield chunk
    elif kind == FIRST:
      buf = chunk
    elif kind == MIDDLE:
      buf += chunk
    elif kind == LAST:
      yield buf + chunk
      buf = b""


def read_run(path: str) -> tuple[str, list[dict]]:
  """(run id, history rows {key: value, "_step": step}) of one offline run file."""
  from wandb.proto import wandb_internal_pb2  # pylint: disable=g-import-not-at-top
  with open(path, "rb") as f:
    data = f.read()
  run_id, rows = None, []
  for raw in _records(data):
    rec = wandb_internal_pb2.Record()
    rec.ParseFromString(raw)
    kind = rec.WhichOneof("record_type")
    if kind == "run":
      run_id = rec.run.run_id
    elif kind == "history":
      rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                   for i in rec.history.item})
  return run_id, rows
