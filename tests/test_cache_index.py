"""The inverted index pass (cache_index.py) split over P processes gives the same bits for
every P, equal to a brute-force Python inversion; it resumes after an interruption and
refuses a resume with another process count.

The P processes are simulated in one process: each step runs for pid 0..P-1 in turn
(the order the barriers of a real jax.distributed job allow); the real 2-process build
is tests/test_cache_multihost.py.
"""

import os

import numpy as np
import pytest

from prism_jax.attribution.caching import cache_format as fmt
from prism_jax.attribution.caching import cache_index

K, k, CHUNK_TOKENS = 11, 3, 8
DRIVER = "zarr3"


def _records(directory, num_tokens, seed):
  """Random records with tied and zero activations and one hot prototype."""
  rng = np.random.default_rng(seed)
  others = [p for p in range(K) if p not in (2, 7)]  # 7 is never used: an empty CSR row
  rows = []
  for _ in range(num_tokens):  # prototype 2 on most tokens: it spans many chunks
    first = [2] if rng.random() < 0.6 else []
    rows.append(first + list(rng.permutation(others)[:k - len(first)]))
  idx = np.array(rows, np.int32).reshape(num_tokens, k)
  act = rng.choice([0.0, 0.25, 0.5, 1.0, 2.0], size=(num_tokens, k)).astype(np.float32)
  act += (rng.random((num_tokens, k)) < 0.3) * rng.random((num_tokens, k)).astype(np.float32)
  ids = np.sort(rng.integers(0, max(num_tokens // 3, 1), num_tokens)).astype(np.int32)
  os.makedirs(directory)
  fmt.write_json(os.path.join(directory, fmt.METADATA), {"identity": {}})
  chunk = min(CHUNK_TOKENS, max(num_tokens, 1))
  for name, val in (("idx", idx), ("act", act), ("example_id", ids)):
    fmt.store(directory, name, DRIVER, shape=val.shape, dtype=val.dtype,
              chunks=(chunk,) + val.shape[1:], create=True).write(val).result()
  return idx, act, ids


def _bruteforce(idx, act):
  """CSR by plain Python sorting: per prototype, (−act, token) ascending, act > 0."""
  lists = [[] for _ in range(K)]
  for t in range(idx.shape[0]):
    for j in range(k):
      if act[t, j] > 0:
        lists[idx[t, j]].append((-float(act[t, j]), t))
  offsets = np.cumsum([0] + [len(l) for l in lists])
  entries = [e for l in lists for e in sorted(l)]
  return offsets, np.array([t for _, t in entries]), np.array([-a for a, _ in entries])


def _run(directory, count, stop_at=None):
  """The four steps of index_pass for pids 0..count-1 in turn; `stop_at(pid, done)` may
  raise to interrupt a write."""
  for pid in range(count):
    cache_index.write_part(directory, DRIVER, K, pid, count)
  cache_index.create_outputs(directory, DRIVER, count)
  for pid in range(count):
    cache_index.write_share(directory, DRIVER, pid, count,
                            on_block=stop_at and (lambda done, p=pid: stop_at(p, done)))
  cache_index.finish(directory, DRIVER, count)


def _index(directory):
  return {n: fmt.store(directory, n, DRIVER).read().result()
          for n in ("proto_offsets", "proto_tokens", "proto_acts")}


@pytest.mark.parametrize("num_tokens,group_chunks", [(150, 1), (150, 16), (5, 1), (0, 1)])
def test_index_is_the_same_for_every_process_count_and_matches_bruteforce(
    tmp_path, monkeypatch, num_tokens, group_chunks):
  monkeypatch.setattr(cache_index, "GROUP_CHUNKS", group_chunks)  # 1: many merge groups
  idx, act, ids = _records(str(tmp_path / "ref"), num_tokens, seed=num_tokens)
  offsets, tokens, acts = _bruteforce(idx, act)
  results = []
  for count in (1, 2, 3, 7):  # 7 processes: some shares are empty
    d = str(tmp_path / f"p{count}")
    _records(d, num_tokens, seed=num_tokens)
    _run(d, count)
    got = _index(d)
    np.testing.assert_array_equal(got["proto_offsets"], offsets)
    if len(tokens):
      np.testing.assert_array_equal(got["proto_tokens"], tokens)
      np.testing.assert_array_equal(got["proto_acts"], acts.astype(np.float32))
    meta = fmt.read_json(os.path.join(d, fmt.METADATA))
    assert meta["num_examples"] == (int(ids.max()) + 1 if num_tokens else 0)
    assert not [n for n in os.listdir(d) if n.startswith(("index_part-", "progress-index"))]
    results.append(got)
  for got in results[1:]:
    for name, value in got.items():
      assert value.tobytes() == results[0][name].tobytes(), name
  if num_tokens == 150:  # chunked, so a lazy query reads only the chunks it touches
    chunk = fmt.store(str(tmp_path / "p1"), "proto_tokens", DRIVER).chunk_layout
    assert chunk.write_chunk.shape[0] == CHUNK_TOKENS * k < len(tokens)


def test_interrupted_index_resumes_identically_and_refuses_another_count(tmp_path,
                                                                         monkeypatch):
  monkeypatch.setattr(cache_index, "GROUP_CHUNKS", 1)  # several writes per share
  want_dir, d = str(tmp_path / "want"), str(tmp_path / "stopped")
  _records(want_dir, 150, seed=3)
  _run(want_dir, 2)
  _records(d, 150, seed=3)
  writes = []

  def stop(pid, done):  # process 1 dies after its first write
    writes.append((pid, done))
    if pid == 1:
      raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    _run(d, 2, stop_at=stop)
  prog = fmt.read_json(os.path.join(d, cache_index.progress_name(1)))
  assert prog["share"][0] < prog["entries_done"] < prog["share"][1]
  assert not os.path.exists(os.path.join(d, "proto_offsets"))  # not complete
  with pytest.raises(ValueError, match="started with 2 processes, now 3"):
    cache_index.write_part(d, DRIVER, K, 0, 3)
  resumed = []
  _run(d, 2, stop_at=lambda pid, done: resumed.append((pid, done)))
  # only process 1 writes again, from where its progress says it stopped
  assert [p for p, _ in resumed] == [1] * len(resumed) and resumed[0][1] > prog["entries_done"]
  got, want = _index(d), _index(want_dir)
  for name in want:
    assert got[name].tobytes() == want[name].tobytes(), name
