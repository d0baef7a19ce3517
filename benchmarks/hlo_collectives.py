"""The collectives of a compiled XLA program, read from its HLO text.

`collectives(hlo_text)` lists every all-gather, reduce-scatter, all-reduce, all-to-all and
collective-permute instruction (the async `*-start` forms counted once, their `*-done`
halves skipped) with its operand and result shapes. `summary` sums count and bytes per
kind; the bytes of one op are the size of the whole (unsharded side) array it moves, per
device: an all-gather's output, every other kind's operand (a reduce-scatter's input, an
all-reduce's buffer). `moves_tokens_by_protos` names the ops whose arrays have a prototype
axis (K, or K over the model axis) and, on another axis, a whole number of sequences: the
N×K similarity a K-sharded bank must never communicate.
"""

from __future__ import annotations

import dataclasses
import math
import re

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
BYTES_PER = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4,
             "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
             "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
# `%name = <result type> <opcode>(<operands>), attributes`; the result type may be a tuple.
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\((.*)$")
_REF = re.compile(r"%([\w.\-]+)")
_SHAPE = re.compile(r"\b(" + "|".join(sorted(BYTES_PER, key=len, reverse=True))
                    + r")\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
  kind: str  # one of KINDS
  operands: tuple[tuple[int, ...], ...]
  results: tuple[tuple[int, ...], ...]  # the op's outputs (an async start's operands dropped)
  bytes: int


def _shapes(text: str) -> list[tuple[str, tuple[int, ...]]]:
  return [(dt, tuple(int(d) for d in dims.split(",") if d))
          for dt, dims in _SHAPE.findall(text)]


def _nbytes(shapes) -> int:
  return sum(BYTES_PER[dt] * math.prod(dims) for dt, dims in shapes)


def _operand_text(rest: str) -> str:
  """The text inside the opcode's parentheses (attributes after it dropped)."""
  depth = 1
  for i, ch in enumerate(rest):
    depth += {"(": 1, ")": -1}.get(ch, 0)
    if depth == 0:
      return rest[:i]
  return rest


def collectives(hlo_text: str) -> list[Collective]:
  """Every collective of the text; operand shapes printed inline or, when the printer
  leaves them out (jax 0.12's CPU text), looked up from the instruction defining each."""
  out, shapes_of = [], {}
  for line in hlo_text.splitlines():
    m = _INSTR.match(line)
    if m is None:
      continue
    name, result_text, opcode, rest = m.groups()
    results = _shapes(result_text)
    shapes_of[name] = results
    start = opcode.endswith("-start")
    kind = opcode[:-len("-start")] if start else opcode
    if kind not in KINDS:
      continue
    operand_text = _operand_text(rest)
    operands = _shapes(operand_text) or [shape for ref in _REF.findall(operand_text)
                                         for shape in shapes_of.get(ref, [])]
    if start:  # async start: the result tuple holds the operands first, then the outputs
      results = results[len(operands):] or operands
      if kind == "collective-permute":  # (operand, output, u32 contexts...)
        results = results[:len(operands)]
    moved = results if kind == "all-gather" else operands
    out.append(Collective(kind, tuple(d for _, d in operands), tuple(d for _, d in results),
                          _nbytes(moved)))
  return out


def summary(ops: list[Collective]) -> dict[str, dict[str, int]]:
  """{kind: {"count": n, "bytes": b}} for every kind of KINDS (zeros included)."""
  out = {kind: {"count": 0, "bytes": 0} for kind in KINDS}
  for op in ops:
    out[op.kind]["count"] += 1
    out[op.kind]["bytes"] += op.bytes
  return out


def with_proto_dim(ops: list[Collective], proto_dims: set[int]) -> list[Collective]:
  return [op for op in ops if any(set(s) & proto_dims for s in op.operands + op.results)]


def moves_tokens_by_protos(ops: list[Collective], proto_dims: set[int], seq_len: int,
                           d_model: int) -> list[Collective]:
  """Ops carrying an array with a prototype axis (a size in `proto_dims`) and, on another
  axis, a whole number of sequences (a size divisible by `seq_len`): a (tokens x K) matrix.
  Two distinct axes, so activations whose token count happens to equal K (attention's
  (heads, N, Dh)) do not count. The bank itself, (K, D) or (D, K), is exempt: its gradient
  is what FSDP reduces."""
  def nxk(shape):
    for i, dim in enumerate(shape):
      rest = tuple(d for d in shape[:i] + shape[i + 1:] if d != 1)
      if dim in proto_dims and rest != (d_model,) and any(d % seq_len == 0 for d in rest):
        return True
    return False
  return [op for op in ops if any(nxk(s) for s in op.operands + op.results)]
