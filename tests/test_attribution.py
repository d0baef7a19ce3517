"""Attribution cache + influence: cached score vs the full prototype-space score and vs a
brute-force NumPy evaluation of PRISM.md §5's formula; resume after a real kill; refusal of a
cache built from another checkpoint or config."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from prism_jax.attribution.caching import cache as cache_lib
from prism_jax.attribution.caching import cache_build, cache_format
from prism_jax.attribution.hessians import curvature as cv
from prism_jax.attribution.scoring import influence, influence_full
from prism_jax.config import Config, DataConfig, LossConfig, ModelConfig
from prism_jax.data import prepare_data
from prism_jax.model.lm import build_model

WORDS = ("alpha beta gamma delta eps zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
         "sigma tau").split()

BUILD_SCRIPT = """
import sys, time
from prism_jax.attribution.caching import cache as cache_lib
from prism_jax.data import PackedData
from prism_jax.model.lm import build_model
import test_attribution as t
packed_dir, out = sys.argv[1:3]
cfg = t.make_config(packed_dir.rsplit('/data', 1)[0])
model = build_model(cfg.model, 0)
slow = lambda p, rows: time.sleep(0.05)  # widen the window for the kill
cache_lib.build_cache(model, cfg, PackedData(packed_dir), out, t.CACHE_CFG, progress=False,
                      on_batch=slow)
"""
CACHE_CFG = cache_lib.CacheConfig(batch_rows=4, chunk_tokens=96, save_every=2)


def make_config(workdir):
  return Config(model=ModelConfig(vocab_size=258, max_len=16, d_model=16, n_layers=1,
                                  n_heads=2, num_prototypes=24, k=4),
                data=DataConfig(sources=(os.path.join(workdir, "docs.jsonl"),),
                                tokenizer="byte", seq_len=16, val_fraction=0.1),
                loss=LossConfig(lambda_r1=0.2, lambda_r2=0.2))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("attr"))
  rng = np.random.default_rng(0)
  with open(os.path.join(workdir, "docs.jsonl"), "w") as f:
    for _ in range(30):
      f.write(json.dumps({"text": " ".join(rng.choice(WORDS, rng.integers(4, 25)))}) + "\n")
  cfg = make_config(workdir)
  packed = prepare_data(cfg.data, cfg.model.vocab_size, workdir)
  model = build_model(cfg.model, 0)
  cache = cache_lib.build_cache(model, cfg, packed, os.path.join(workdir, "cache"), CACHE_CFG,
                                progress=False)
  return workdir, cfg, packed, model, cache


def _query(packed):
  return np.asarray(packed.rows("train")["tokens"][3, :12]), [5, 9, 11]


def test_cached_equals_full_and_bruteforce(setup):
  _, cfg, packed, model, cache = setup
  assert cache.rank == cfg.model.d_model and cache.num_tokens > 0
  tokens, pos = _query(packed)
  icfg = influence.InfluenceConfig(top=5)
  att = influence.attribute(model, cache, tokens, pos, cfg=icfg, packed=packed)
  ids, full = influence_full.full_scores(model, cache, packed, [(tokens, pos)], cfg=icfg,
                                    batch_rows=4)
  cached = dict(zip(att.all_ids.tolist(), att.all_scores))
  ref = full[0]
  got = np.array([cached.get(e, 0.0) for e in ids.tolist()])
  assert np.max(np.abs(got - ref)) <= 1e-5 * np.max(np.abs(ref))
  assert set(cached) <= set(ids.tolist())
  # The same equality with packed rows as the training sequences.
  rcfg = influence.InfluenceConfig(top=5, unit="row")
  att_r = influence.attribute(model, cache, tokens, pos, cfg=rcfg)
  ids_r, full_r = influence_full.full_scores(model, cache, packed, [(tokens, pos)], cfg=rcfg,
                                        batch_rows=4)
  got_r = dict(zip(att_r.all_ids.tolist(), att_r.all_scores))
  np.testing.assert_allclose([got_r.get(r, 0.0) for r in ids_r.tolist()], full_r[0],
                             rtol=1e-5, atol=1e-5 * np.max(np.abs(full_r)))
  assert np.isclose(att_r.all_scores.sum(), att.all_scores.sum(), rtol=1e-6)

  # Brute force in float64 over every cached training token, straight from §5's formula
  # (dense inverse of each block, no eigenbasis), with the same damping λ.
  q = influence.query_side(model, tokens, pos, cfg.loss)
  rec = cache.records(np.arange(cache.num_tokens))
  g_t = rec["g"].astype(np.float64) @ np.asarray(cache.g_evecs).T  # rank D: exact rotation
  pre = influence.Preconditioner(cache, icfg)
  eye = np.eye(cfg.model.d_model)
  seq = {}
  for t in range(cache.num_tokens):
    total = 0.0
    for qq in range(len(pos)):
      for j, i in enumerate(q.idx_Qxk[qq]):
        hit = np.flatnonzero(rec["idx"][t] == i)
        if hit.size:
          h = cache.a_diag[i] * cache.G + (cache.mu[i] + pre.damping) * eye
          total += (q.act_Qxk[qq, j] * rec["act"][t, hit[0]]
                    * q.g_QxD[qq] @ np.linalg.solve(h, g_t[t]))
    e = int(rec["example_id"][t])
    seq[e] = seq.get(e, 0.0) + total
  brute = np.array([seq[e] for e in ids.tolist()])
  np.testing.assert_allclose(got, brute, rtol=1e-4, atol=1e-6 * np.max(np.abs(brute)))
  # Ranking, snippets and the per-prototype breakdown are consistent.
  assert np.all(np.diff(att.scores) <= 0) and len(att.example_ids) == 5
  assert all("[[" in s for s in att.snippets)
  for e, s, parts in zip(att.example_ids, att.scores, att.breakdown):
    assert abs(sum(parts.values()) - s) <= 1e-6 * max(1.0, abs(s))
    assert set(parts) <= set(att.query_protos.tolist())


def test_co_usage_matches_dense_kronecker_solve(setup):
  _, cfg, packed, model, cache = setup
  tokens, pos = _query(packed)
  icfg = influence.InfluenceConfig(coupling="co_usage", top=3)
  att = influence.attribute(model, cache, tokens, pos, cfg=icfg)
  ids, full = influence_full.full_scores(model, cache, packed, [(tokens, pos)], cfg=icfg,
                                    batch_rows=4)
  # Dense (K·D)×(K·D) H = A ⊗ G + blockdiag((μ_i + λ) I), solved directly in float64.
  k_, d = cfg.model.num_prototypes, cfg.model.d_model
  lam = influence.Preconditioner(cache, icfg).damping
  h = np.kron(cache.A, cache.G) + np.kron(np.diag(cache.mu + lam), np.eye(d))
  q = influence.query_side(model, tokens, pos, cfg.loss)
  grad_q = np.zeros((k_, d))
  np.add.at(grad_q, q.idx_Qxk.reshape(-1), (q.act_Qxk[..., None] * q.g_QxD[:, None]).reshape(
      -1, d))
  x = np.linalg.solve(h, grad_q.reshape(-1)).reshape(k_, d)
  rec = cache.records(np.arange(cache.num_tokens))
  g_t = rec["g"].astype(np.float64) @ np.asarray(cache.g_evecs).T
  tok = np.einsum("tk,tkd,td->t", rec["act"], x[rec["idx"]], g_t)
  shares = np.isin(rec["idx"], q.idx_Qxk).any(1)
  ex = rec["example_id"]
  want_full = np.array([tok[ex == e].sum() for e in ids])
  np.testing.assert_allclose(full[0], want_full, rtol=1e-4, atol=1e-6 * np.abs(want_full).max())
  want_cached = np.array([tok[(ex == e) & shares].sum() for e in att.all_ids])
  np.testing.assert_allclose(att.all_scores, want_cached, rtol=1e-4,
                             atol=1e-6 * np.abs(want_cached).max())


def test_streaming_generation_attributes_each_token(setup):
  _, _, packed, model, cache = setup
  prompt = np.asarray(packed.rows("train")["tokens"][5, :6])
  got = list(influence.attribute_generation(model, cache, prompt, max_new_tokens=2,
                                            cfg=influence.InfluenceConfig(top=3)))
  assert len(got) == 2
  seq = np.concatenate([prompt, [t for t, _ in got]])
  for i, (_, att) in enumerate(got):
    ref = influence.attribute(model, cache, seq[:len(prompt) + i + 1], [len(prompt) + i],
                              cfg=influence.InfluenceConfig(top=3))
    np.testing.assert_array_equal(att.example_ids, ref.example_ids)
    np.testing.assert_allclose(att.scores, ref.scores, rtol=1e-6)


def _random_queries(packed, vocab, rng, n):
  """Half slices of training rows, half random token strings; 1-3 random target positions."""
  rows = packed.rows("train")["tokens"]
  out = []
  for q in range(n):
    length = int(rng.integers(4, 17))
    tokens = (np.asarray(rows[int(rng.integers(packed.num_rows("train"))), :length])
              if q % 2 else rng.integers(0, vocab, length))
    pos = rng.choice(np.arange(1, length), int(rng.integers(1, 4)), replace=False)
    out.append((tokens.astype(np.int32), sorted(pos.tolist())))
  return out


def _bruteforce(cache, q, unit, damping_ratio, top, packed, width):
  """§5's block-diagonal score in float64 over every cached token (no inverted index, no
  Preconditioner): (ids, scores, top ids, breakdowns, snippets)."""
  rec = cache.records(np.arange(cache.num_tokens))
  g_t = rec["g"].astype(np.float64)
  u_r, e_r = np.asarray(cache.g_evecs, np.float64), np.maximum(cache.g_evals, 0.0)
  e_all = np.maximum(np.linalg.eigvalsh(np.asarray(cache.G, np.float64)), 0.0)
  a_ii, mu = np.asarray(cache.a_diag, np.float64), np.asarray(cache.mu, np.float64)
  lam = damping_ratio * (a_ii.mean() * e_all.mean() + mu.mean())
  x_KxR = np.zeros((len(a_ii), len(e_r)))  # row i: H_ii⁻¹ Σ_q a_{q,i} ĝ_q (eigenbasis)
  for p in range(len(q.idx_Qxk)):
    for i, a in zip(q.idx_Qxk[p].tolist(), q.act_Qxk[p]):
      x_KxR[i] += a * (q.g_QxD[p] @ u_r)
  x_KxR /= a_ii[:, None] * e_r[None, :] + mu[:, None] + lam
  hit = np.isin(rec["idx"], q.idx_Qxk) & (rec["act"] > 0)
  parts = np.where(hit, rec["act"] * np.einsum("tr,tjr->tj", g_t, x_KxR[rec["idx"]]), 0.0)
  seq = (rec["example_id"] if unit == "document" else
         np.searchsorted(cache.row_offsets, np.arange(cache.num_tokens), "right") - 1)
  scored = hit.any(1)
  ids = np.unique(seq[scored])
  scores = np.array([parts[seq == e].sum() for e in ids])
  top_ids = ids[np.lexsort((ids, -scores))[:top]]
  breakdowns, snippets = [], []
  for e in top_ids:
    in_e = (seq == e)[:, None] & hit
    breakdowns.append({i: parts[in_e & (rec["idx"] == i)].sum()
                       for i in np.unique(rec["idx"][in_e]).tolist()})
    tok = np.flatnonzero(seq == e)
    best = tok[np.argmax(parts[tok].sum(1))]
    snippets.append(packed.snippet(int(rec["example_id"][best]), int(rec["offset"][best]),
                                   width))
  return ids, scores, top_ids, breakdowns, snippets


@pytest.mark.parametrize("unit", ["document", "row"])
def test_attribute_batch_equals_per_query_and_bruteforce(setup, unit):
  _, cfg, packed, model, cache = setup
  rng = np.random.default_rng(7 if unit == "row" else 11)
  queries = _random_queries(packed, cfg.model.vocab_size, rng, 6)
  icfg = influence.InfluenceConfig(top=4, unit=unit)
  pre = influence.Preconditioner(cache, icfg, model)
  # batch_size 4: one full chunk and one of 2 rows (padded bucket), both compiled once.
  got = influence.attribute_batch(model, cache, queries, cfg=icfg, packed=packed,
                                  precond=pre, batch_size=4)
  sides = influence.query_sides(model, queries, cfg.loss, batch_size=4)
  assert len(got) == len(sides) == len(queries)
  # Reference forward: every query in one plain (B, T) batch through cv.output_grads.
  t_len = cfg.model.max_len
  batch = {"inputs": np.zeros((len(queries), t_len), np.int32),
           "targets": np.zeros((len(queries), t_len), np.int32),
           "mask": np.zeros((len(queries), t_len), bool)}
  for b, (tokens, pos) in enumerate(queries):
    batch["inputs"][b, :len(tokens) - 1] = tokens[:-1]
    batch["targets"][b, :len(tokens) - 1] = tokens[1:]
    batch["mask"][b, np.asarray(pos) - 1] = True
  og = cv.output_grads(model, batch, cfg.loss)
  ref_idx, ref_g = (np.asarray(a).reshape(len(queries), t_len, -1) for a in (og.idx_Nxk,
                                                                             og.g_NxD))
  for b, ((tokens, pos), att, q) in enumerate(zip(queries, got, sides)):
    one = influence.attribute(model, cache, tokens, pos, cfg=icfg, packed=packed)
    np.testing.assert_array_equal(att.all_ids, one.all_ids)
    np.testing.assert_array_equal(att.example_ids, one.example_ids)
    scale = np.max(np.abs(one.all_scores))
    np.testing.assert_allclose(att.all_scores, one.all_scores, rtol=0, atol=1e-12 * scale)
    assert att.snippets == one.snippets
    assert [list(b) for b in att.breakdown] == [list(b) for b in one.breakdown]
    # The query side against the reference forward (float32 tolerance: another program).
    cols = np.asarray(pos) - 1
    np.testing.assert_array_equal(np.sort(q.idx_Qxk, 1), np.sort(ref_idx[b, cols], 1))
    np.testing.assert_allclose(q.g_QxD, ref_g[b, cols], rtol=1e-4, atol=1e-6)
    # Scoring against float64 brute force from the same query side.
    ids, scores, top_ids, breakdowns, snippets = _bruteforce(
        cache, q, unit, icfg.damping_ratio, icfg.top, packed, icfg.snippet_width)
    np.testing.assert_array_equal(att.all_ids, ids)
    np.testing.assert_allclose(att.all_scores, scores, rtol=0,
                               atol=1e-12 * np.max(np.abs(scores)))
    np.testing.assert_array_equal(att.example_ids, top_ids)
    assert att.snippets == snippets
    for b_got, b_want in zip(att.breakdown, breakdowns):
      assert set(b_got) <= set(b_want)  # a part that sums to exactly 0 is left out
      np.testing.assert_allclose([b_got.get(i, 0.0) for i in b_want], list(b_want.values()),
                                 rtol=0, atol=1e-12 * np.max(np.abs(scores)))
  with pytest.raises(ValueError, match="batch_size"):
    influence.attribute_batch(model, cache, queries, batch_size=0)


def _read_all(path):
  out = {}
  for name in sorted(os.listdir(path)):
    if os.path.isdir(os.path.join(path, name)):
      out[name] = cache_format.store(path, name, CACHE_CFG.driver).read().result()
  with open(os.path.join(path, cache_format.METADATA)) as f:
    meta = json.load(f)
  meta.pop("build_seconds_last_run")
  return out, meta


def test_killed_build_resumes_to_identical_cache(setup, tmp_path):
  workdir, cfg, packed, model, cache = setup
  out = str(tmp_path / "killed")
  script = tmp_path / "build.py"
  script.write_text(BUILD_SCRIPT)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]), JAX_PLATFORMS="cpu")
  proc = subprocess.Popen([sys.executable, str(script), packed.path, out], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  prog_path = os.path.join(out, cache_format.PROGRESS)
  deadline, killed_at = time.time() + 90, None
  try:
    while time.time() < deadline and proc.poll() is None:
      try:
        with open(prog_path) as f:
          prog = json.load(f)
      except (OSError, ValueError):
        prog = {"pass": 0}
      if prog["pass"] == 2 and prog["rows_done"] >= 40:
        proc.send_signal(signal.SIGKILL)
        killed_at = prog
        break
      time.sleep(0.01)
  finally:
    if proc.poll() is None and killed_at is None:
      proc.kill()
    proc.wait(timeout=30)
  assert killed_at is not None, f"build was not killed mid-pass-2: {proc.stderr.read()[-2000:]}"
  assert proc.returncode == -signal.SIGKILL
  with pytest.raises(ValueError, match="unfinished"):
    cache_lib.AttributionCache(out, model, cfg)

  # Pass 1 finished before the kill; the resumed build redoes pass 2 from its marker.
  resumed = cache_lib.build_cache(model, cfg, packed, out, CACHE_CFG, progress=False)
  assert resumed.num_tokens == cache.num_tokens
  got, meta_got = _read_all(out)
  want, meta_want = _read_all(cache.path)
  assert meta_got["identity"] == meta_want["identity"] and meta_got["sizes"] == meta_want["sizes"]
  assert sorted(got) == sorted(want)
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_pass1_interruption_resumes_identically(setup, tmp_path):
  _, cfg, packed, model, cache = setup
  out = str(tmp_path / "p1")

  def stop(pass_index, rows):
    if pass_index == 1 and rows >= 20:
      raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    cache_lib.build_cache(model, cfg, packed, out, CACHE_CFG, progress=False, on_batch=stop)
  assert os.path.exists(os.path.join(out, "pass1_state.npz"))
  cache_lib.build_cache(model, cfg, packed, out, CACHE_CFG, progress=False)
  got, _ = _read_all(out)
  want, _ = _read_all(cache.path)
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_pass2_recomputed_equals_pass2_from_pass1s_held_outputs(setup, tmp_path):
  """hold_bytes=0: pass 2 runs the model again (what a resumed build does) and writes the
  bits of the default build, whose pass 2 wrote pass 1's held outputs."""
  _, cfg, packed, model, cache = setup
  assert cache_build._fits_in_memory(cfg, packed.num_rows("train"), CACHE_CFG)  # pylint: disable=protected-access
  out = str(tmp_path / "recomputed")
  cache_lib.build_cache(model, cfg, packed, out, dataclasses.replace(CACHE_CFG, hold_bytes=0),
                        progress=False)
  got, meta_got = _read_all(out)
  want, meta_want = _read_all(cache.path)
  assert meta_got["identity"] == meta_want["identity"]  # hold_bytes is not in the identity
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)


RECORDS = ("row_offsets", "example_id", "offset", "idx", "act", "g")


def test_records_only_build_equals_the_full_build_records(setup, tmp_path):
  _, cfg, packed, model, cache = setup
  want, meta_want = _read_all(cache.path)
  out = str(tmp_path / "records")
  cache_build.write_records(model, cfg, packed, out, CACHE_CFG, basis_DxR=want["g_evecs"],
                            progress=False)
  got, meta = _read_all(out)
  assert meta["records_only"] and meta["sizes"] == meta_want["sizes"]
  assert sorted(got) == sorted(RECORDS + ("g_evecs",))  # no curvature, no inverted index
  for name in RECORDS + ("g_evecs",):
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)
  # Without a basis g is the raw D-dim g_t: the full build's g rotated back.
  raw = str(tmp_path / "raw")
  cache_build.write_records(model, cfg, packed, raw, CACHE_CFG, progress=False)
  g_raw = cache_format.store(raw, "g", CACHE_CFG.driver).read().result()
  np.testing.assert_allclose(g_raw.astype(np.float64) @ want["g_evecs"], want["g"],
                             rtol=0, atol=1e-5 * np.abs(want["g"]).max())
  with pytest.raises(ValueError, match="records-only"):
    cache_lib.AttributionCache(out, model, cfg)
  with pytest.raises(cache_lib.CacheMismatchError, match="records-only build"):
    cache_lib.build_cache(model, cfg, packed, out, CACHE_CFG, progress=False)
  with pytest.raises(ValueError, match=r"basis_DxR must have shape \(D=16, rank\)"):
    cache_build.write_records(model, cfg, packed, raw, CACHE_CFG, basis_DxR=np.eye(8))


def test_mismatched_cache_is_refused(setup):
  _, cfg, packed, model, cache = setup
  other = build_model(cfg.model, 1)
  with pytest.raises(cache_lib.CacheMismatchError, match="another checkpoint"):
    cache_lib.AttributionCache(cache.path, other, cfg)
  changed = Config(model=cfg.model, data=cfg.data, loss=LossConfig(lambda_r1=0.3))
  with pytest.raises(cache_lib.CacheMismatchError, match="lambda_r1"):
    cache_lib.AttributionCache(cache.path, model, changed)
  with pytest.raises(cache_lib.CacheMismatchError, match="model_fingerprint"):
    cache_lib.build_cache(other, cfg, packed, cache.path, CACHE_CFG, progress=False)
  # The refused build left the cache intact.
  cache_lib.AttributionCache(cache.path, model, cfg)
  with pytest.raises(ValueError, match="target positions"):
    influence.attribute(model, cache, _query(packed)[0], [0])


def test_a_finished_cache_serves_readers_whatever_its_build_settings(setup):
  """open_or_build (prism report / cards): a cache built with other build settings (here
  batch_rows 4, chunk 96, save_every 2 against the defaults) is opened as it is, not
  rebuilt; other contents (a rank) or another model still go to build_cache and its refusal."""
  _, cfg, packed, model, cache = setup
  before = cache_format.read_json(os.path.join(cache.path, cache_format.METADATA))
  assert before["identity"]["cache"]["batch_rows"] != cache_lib.CacheConfig().batch_rows
  opened = cache_lib.open_or_build(model, cfg, packed, cache.path)
  assert opened.num_tokens == cache.num_tokens
  assert cache_format.read_json(os.path.join(cache.path, cache_format.METADATA)) == before
  with pytest.raises(cache_lib.CacheMismatchError, match="cache.rank"):
    cache_lib.open_or_build(model, cfg, packed, cache.path, cache_lib.CacheConfig(rank=3))
  with pytest.raises(cache_lib.CacheMismatchError, match="model_fingerprint"):
    cache_lib.open_or_build(build_model(cfg.model, 1), cfg, packed, cache.path)
