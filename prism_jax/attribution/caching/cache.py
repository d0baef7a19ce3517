"""The attribution cache: one sparse record per training token, in tensorstore zarr arrays.

PRISM.md §5 step 1. `build_cache` (passes in cache_build.py) writes, per valid training
token t (mask True), row-major over (row, position):
  example_id (N,), offset (N,), idx (N,k) prototype ids, act (N,k) a_{t,i},
  g (N,r) = U_rᵀ g_t with g_t = ∂ℓ_t/∂ẑ_t (the token's own loss, not averaged);
the curvature statistics A (K×K co-usage), G (D×D), μ (K), G's top-`rank` eigenpairs
(g_evals, g_evecs; rank = D: a rotation, exact), row_offsets (each packed row's token range),
and the inverted index (CSR): proto_offsets (K+1,), proto_tokens (N·k,) token indices and
proto_acts their activations, each prototype's tokens sorted by decreasing activation (ties:
token index), so a query can keep the top-M tokens per prototype. `AttributionCache` reads it.

Identity: metadata.json holds the model fingerprint (SHA-256 of every parameter), the config,
cache options, the packed data's content digest (cache_format.data_digest: not its path, so
a copied run keeps its cache) and sizes. Building into a directory of another identity, or
opening a cache with a model/config it was not built from, raises CacheMismatchError.
"""

from __future__ import annotations

import numpy as np

from prism_jax import paths
from prism_jax.attribution.caching import cache_build
from prism_jax.attribution.caching import cache_format as fmt
from prism_jax.attribution.caching.cache_format import CacheConfig, CacheMismatchError
from prism_jax.config import Config


def build_cache(model, cfg: Config, packed, out_dir: str,
                cache_cfg: CacheConfig = CacheConfig(), *, overwrite: bool = False,
                progress: bool = True, on_batch=None) -> "AttributionCache":
  """Builds (or resumes building) the cache of `model` over `packed`'s split into out_dir.

  Args:
    model (PrismLM): the trained model (model.kind "prism") whose curvature statistics and
      per-token records are cached; its parameter fingerprint is stored with the cache.
    cfg: the run's Config; its model, loss and data parts are stored with the cache.
    packed (PackedData): the packed dataset (`prepare_data`'s handle) whose
      `cache_cfg.split` rows are cached.
    out_dir: the cache directory, a local path or a gs:// URI. A finished cache of the
      same model/config is kept as it is, an unfinished one resumed; one of another
      model/config is refused (CacheMismatchError) unless `overwrite`.
    cache_cfg: how to build: the rank of g, the split, rows per batch, the Fisher kind,
      max_rows, the store driver, ... Default: `CacheConfig()`.
    overwrite: True clears whatever cache out_dir holds and builds afresh (default False).
    progress: True (default) shows a progress bar per pass (log lines off a terminal).
    on_batch (Callable[[int, int], None] | None): called as `on_batch(pass_index,
      rows_done)` after every batch (tests, monitoring); in pass 3 after every index
      write, with the entries written. None (default): no callback.

  Returns:
    The finished cache in out_dir, opened as an `AttributionCache` (checked against
    `model` and `cfg`).
  """
  cache_build.write_cache(model, cfg, packed, out_dir, cache_cfg, overwrite=overwrite,
                          progress=progress, on_batch=on_batch)
  return AttributionCache(out_dir, model, cfg)


# How a cache was built, not what it holds: a finished cache built with other values of these
# serves any reader (e.g. `prism attribute --stat_shards=8`, then `prism report`).
BUILD_SETTINGS = ("batch_rows", "chunk_tokens", "save_every", "stat_shards")


def open_or_build(model, cfg: Config, packed, out_dir: str,
                  cache_cfg: CacheConfig = CacheConfig(), **build_kwargs) -> "AttributionCache":
  """The finished cache in out_dir if it was built from this model and data with
  `cache_cfg`'s contents (its build settings may differ); otherwise `build_cache`."""
  meta_path = paths.join(paths.resolve(out_dir), fmt.METADATA)
  if fmt.exists(meta_path):
    meta = fmt.read_json(meta_path)
    ident = meta.get("identity")
    if meta.get("complete") and not meta.get("records_only") and ident:
      want = fmt.identity(model, cfg, cache_cfg, packed)
      for ids in (ident, want):
        ids["cache"] = {k: v for k, v in ids["cache"].items() if k not in BUILD_SETTINGS}
      if not fmt.diff(ident, want):
        return AttributionCache(out_dir, model, cfg)
  return build_cache(model, cfg, packed, out_dir, cache_cfg, **build_kwargs)


class AttributionCache:
  """A finished cache: curvature statistics in memory, token records in memory or lazily.

  Refuses (CacheMismatchError) a model whose fingerprint, or a config that, differs from
  the one it was built from; refuses an unfinished build (resume it with build_cache).
  """

  def __init__(self, path: str, model=None, cfg: Config | None = None, *,
               in_memory: bool = True):
    self.path = paths.resolve(path)  # a local path or a gs:// URI
    paths.check_access(self.path)
    meta_path = paths.join(self.path, fmt.METADATA)
    if not fmt.exists(meta_path):
      raise FileNotFoundError(f"{self.path} is not an attribution cache (no {fmt.METADATA})")
    self.metadata = fmt.read_json(meta_path)
    if "identity" not in self.metadata:
      raise FileNotFoundError(f"{self.path} is not an attribution cache ({fmt.METADATA} has "
                              "no identity)")
    if self.metadata.get("records_only"):
      raise ValueError(f"{self.path} holds a records-only build (no curvature, no index); "
                       "read its arrays with cache_format.store, or build_cache elsewhere")
    if not self.metadata.get("complete"):
      raise ValueError(f"the cache in {self.path} is unfinished; run build_cache again with "
                       "the same model and config to resume it")
    ident = self.metadata["identity"]
    if model is not None and fmt.model_fingerprint(model) != ident["model_fingerprint"]:
      raise fmt.CacheMismatchError(
          f"the cache in {self.path} was built from another checkpoint (fingerprint "
          f"{ident['model_fingerprint'][:12]}…); rebuild it for this model")
    if cfg is not None:
      diffs = fmt.diff(ident["config"], fmt.relevant_config(cfg))
      if diffs:
        raise fmt.CacheMismatchError(f"the cache in {self.path} was built with another "
                                     f"config: {'; '.join(diffs[:5])}")
    self.sizes = self.metadata["sizes"]
    drv = ident["cache"]["driver"]
    rd = lambda n: fmt.store(self.path, n, drv).read().result()
    if self.metadata["stats"]["sparse_A"]:
      import scipy.sparse  # pylint: disable=import-outside-toplevel  (deferred: scipy, only for a sparse A)
      k = self.sizes["K"]
      self.A = scipy.sparse.coo_matrix((rd("A_vals"), (rd("A_rows"), rd("A_cols"))),
                                       shape=(k, k)).tocsr()
      self.a_diag = np.asarray(self.A.diagonal(), np.float64)
    else:
      self.A = rd("A")
      self.a_diag = np.diag(self.A).copy()
    self.G, self.mu = rd("G"), rd("mu")
    self.g_evals, self.g_evecs = rd("g_evals"), rd("g_evecs")
    self.proto_offsets = rd("proto_offsets")
    self.row_offsets = rd("row_offsets")  # token range of each packed row
    self._arrays = {n: fmt.store(self.path, n, drv) for n in (
        "example_id", "offset", "idx", "act", "g", "proto_tokens", "proto_acts")}
    if in_memory:
      self._arrays = {n: a.read().result() for n, a in self._arrays.items()}
    self._token_rows = None  # token -> packed row, built by sequence_of on first use
    self.num_examples = self.metadata.get("num_examples")  # None: a cache from before
    if self.num_examples is None:
      self.num_examples = int(self._read(self._arrays["example_id"], slice(None)).max()) + 1 \
          if self.num_tokens else 0

  @property
  def num_tokens(self) -> int:
    return int(self.sizes["num_tokens"])

  @property
  def rank(self) -> int:
    return int(self.sizes["rank"])

  def _read(self, arr, sel):
    return arr[sel] if isinstance(arr, np.ndarray) else arr[sel].read().result()

  def candidates(self, protos, max_per_proto: int | None = None) -> np.ndarray:
    """Sorted unique training-token indices active on any of `protos` (top-M each)."""
    parts = []
    for i in np.unique(np.asarray(protos, np.int64)):
      lo, hi = int(self.proto_offsets[i]), int(self.proto_offsets[i + 1])
      if max_per_proto is not None:
        hi = min(hi, lo + int(max_per_proto))
      if hi > lo:
        parts.append(np.asarray(self._read(self._arrays["proto_tokens"], slice(lo, hi)),
                                np.int64))
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)

  def proto_entries(self, proto: int, max_per_proto: int | None = None):
    """(token indices, their activations a_{t,i}) of prototype `proto`, by decreasing a."""
    lo, hi = int(self.proto_offsets[proto]), int(self.proto_offsets[proto + 1])
    if max_per_proto is not None:
      hi = min(hi, lo + int(max_per_proto))
    sel = slice(lo, hi)
    return (np.asarray(self._read(self._arrays["proto_tokens"], sel), np.int64),
            np.asarray(self._read(self._arrays["proto_acts"], sel)))

  def gather(self, name: str, tokens: np.ndarray) -> np.ndarray:
    """One record field (example_id, offset, idx, act, g) of the given token indices."""
    return self._read(self._arrays[name], np.asarray(tokens, np.int64))

  def sequence_of(self, tokens: np.ndarray, unit: str) -> np.ndarray:
    """Training sequence of each token index: its document (unit="document") or packed row.

    Rows come from a token -> row table built on first use (4 bytes per token): one gather
    instead of a binary search per token."""
    if unit == "document":
      return self.gather("example_id", tokens)
    if unit != "row":
      raise ValueError(f"unit={unit!r}; use 'document' or 'row'")
    if self._token_rows is None:
      self._token_rows = np.repeat(np.arange(len(self.row_offsets) - 1, dtype=np.int32),
                                   np.diff(self.row_offsets))
    return self._token_rows[np.asarray(tokens, np.int64)]

  def num_sequences(self, unit: str) -> int:
    return self.num_examples if unit == "document" else int(self.sizes["num_rows"])

  def g_dot(self, tokens: np.ndarray, x_R: np.ndarray, chunk_bytes: int = 1 << 20) -> np.ndarray:
    """⟨g_t, x⟩ in float64 for each token index (the cached float32 g, exactly widened).

    Gathers g in chunks of ~chunk_bytes (float64) so the copy stays in cache: gathering
    every row at once and then multiplying is memory-bound and several times slower."""
    tokens = np.asarray(tokens, np.int64)
    x_R = np.asarray(x_R, np.float64)
    out = np.empty(len(tokens))
    g = self._arrays["g"]
    step = max(64, chunk_bytes // (8 * max(self.rank, 1)))
    for lo in range(0, len(tokens), step):
      sel = tokens[lo:lo + step]
      rows = np.take(g, sel, axis=0) if isinstance(g, np.ndarray) else self._read(g, sel)
      np.dot(rows.astype(np.float64), x_R, out=out[lo:lo + len(sel)])
    return out

  def records(self, tokens: np.ndarray) -> dict[str, np.ndarray]:
    """example_id, offset, idx, act, g of the given token indices."""
    return {n: self.gather(n, tokens) for n in ("example_id", "offset", "idx", "act", "g")}

  def nbytes_per_token(self) -> float:
    """Bytes on disk per cached token (records + inverted index; stats amortised)."""
    return paths.tree_bytes(self.path) / max(self.num_tokens, 1)
