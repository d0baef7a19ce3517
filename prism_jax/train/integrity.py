"""Checkpoint integrity: a mesh-independent digest per saved array, and a finiteness check.

The digest of an array is two wrapping uint32 sums over its elements' bit patterns, each
bit pattern times an odd multiplier that depends on the element's global position:

  h1 = Σ_i bits_i · (2i + 1)             h2 = Σ_i rot16(bits_i) · ((i · φ) | 1)   (mod 2³²)

Sums modulo 2³² are exact and order-independent, so the digest is the same whatever the
mesh or the number of hosts the array is sharded over (each device sums its shard, XLA
adds the partial sums), and it is computed on device in one pass. Multiplying by an odd
number is a bijection mod 2³², so changing any single element always changes h1; several
changes cancel in both sums only by chance (~2⁻⁶⁴). Saved with the checkpoint as a JSON
item of the same orbax composite, so orbax's atomic finalize covers it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_PHI = 0x9E3779B9  # 2³² / golden ratio: spreads consecutive positions over all bits


class CheckpointCorruptError(ValueError):
  """A restored checkpoint does not match its digests, or holds non-finite values."""


def _as_uint32(x: jax.Array) -> jax.Array:
  """The element bits of x as uint32 (8-byte elements become a trailing pair of words)."""
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  size = jnp.dtype(x.dtype).itemsize
  if size == 4:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  if size == 8:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)  # (..., 2)
  if size in (1, 2):
    word = jnp.uint8 if size == 1 else jnp.uint16
    return jax.lax.bitcast_convert_type(x, word).astype(jnp.uint32)
  raise TypeError(f"cannot digest dtype {x.dtype}")


def _position(shape: tuple[int, ...]) -> jax.Array:
  """Row-major linear index of every element (mod 2³²), without a reshape of the array."""
  idx = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for d in reversed(range(len(shape))):
    idx = idx + jax.lax.broadcasted_iota(jnp.uint32, shape, d) * jnp.uint32(stride % 2**32)
    stride *= shape[d]
  return idx


def _leaf_stats(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  bits = _as_uint32(x)
  pos = _position(bits.shape)
  m1 = pos * jnp.uint32(2) + jnp.uint32(1)
  m2 = (pos * jnp.uint32(_PHI)) | jnp.uint32(1)
  rot = (bits << 16) | (bits >> 16)
  h1 = jnp.sum(bits * m1, dtype=jnp.uint32)
  h2 = jnp.sum(rot * m2, dtype=jnp.uint32)
  finite = jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else \
      jnp.bool_(True)
  return h1, h2, finite


@jax.jit
def _tree_stats(leaves: list[jax.Array]):
  return [_leaf_stats(x) for x in leaves]


def _flatten(tree: Any) -> tuple[list[str], list[Any]]:
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [jax.tree_util.keystr(p) for p, _ in flat], [x for _, x in flat]


def _stats(tree: Any) -> tuple[list[str], list[Any], list[tuple[int, int, bool]]]:
  names, leaves = _flatten(tree)
  arrays = [x if isinstance(x, jax.Array) else jnp.asarray(x) for x in leaves]
  out = jax.device_get(_tree_stats(arrays)) if arrays else []
  return names, arrays, [(int(a), int(b), bool(f)) for a, b, f in out]


def digest(tree: Any) -> dict[str, dict[str, Any]]:
  """{keystr path: {shape, dtype, h: [h1, h2]}} of every array leaf (JSON-serialisable)."""
  names, arrays, stats = _stats(tree)
  return {n: {"shape": list(x.shape), "dtype": str(x.dtype), "h": [h1, h2]}
          for n, x, (h1, h2, _) in zip(names, arrays, stats)}


def verify(tree: Any, saved: dict[str, dict[str, Any]] | None, what: str) -> None:
  """Raises CheckpointCorruptError if `tree` differs from the digests `saved` (None: not
  checked) or holds a non-finite float; the message names the first arrays concerned."""
  names, arrays, stats = _stats(tree)
  bad_finite = [n for n, (_, _, f) in zip(names, stats) if not f]
  if saved is not None:
    got = {n: {"shape": list(x.shape), "dtype": str(x.dtype), "h": [h1, h2]}
           for n, x, (h1, h2, _) in zip(names, arrays, stats)}
    wrong = sorted(n for n in set(got) | set(saved) if got.get(n) != saved.get(n))
    if wrong:
      raise CheckpointCorruptError(
          f"checksum mismatch in {what}: {_some(wrong)} (the saved bytes changed)")
  if bad_finite:
    raise CheckpointCorruptError(f"non-finite values restored in {what}: {_some(bad_finite)}")


def json_digest(obj: Any) -> str:
  """sha256 of a JSON item's canonical form (sorted keys, no spaces): equal before the
  save and after orbax's JSON round trip (a tuple saved comes back a list, same text)."""
  # Through JSON once first: int keys become the strings orbax's round trip gives back
  # (sorted as strings, as they will be then).
  obj = json.loads(json.dumps(obj, allow_nan=True))
  text = json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=True)
  return hashlib.sha256(text.encode()).hexdigest()


def verify_json(obj: Any, saved: str, what: str) -> None:
  """CheckpointCorruptError when the JSON item `obj` no longer hashes to `saved`."""
  if json_digest(obj) != saved:
    raise CheckpointCorruptError(f"checksum mismatch in {what}: the item was edited or "
                                 "damaged after it was saved")


def _some(names: list[str], n: int = 3) -> str:
  more = f" and {len(names) - n} more" if len(names) > n else ""
  return ", ".join(names[:n]) + more


def nbytes(tree: Any) -> int:
  return int(sum(np.prod(x.shape) * jnp.dtype(x.dtype).itemsize
                 for x in jax.tree.leaves(tree)))
