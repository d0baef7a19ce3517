"""The explorer's JSON API (prism_jax/serve) against independent computations on fresh
prompts: float64 NumPy decompositions from the model's z and bank, steered logits
W z − Σ (1 − g_i) a_i W p_i, the library's sampler, the attribution cache's own query; and a
64-request loopback load test that compiles nothing after warm-up."""

import asyncio
import json
import secrets

import numpy as np
import pytest

from prism_jax.attribution.caching import cache as cache_lib
from prism_jax.attribution.scoring import influence
from prism_jax.generate import generate as library_generate
from prism_jax.serve import client as client_lib
from prism_jax.serve import server

import serve_fixture

pytest.importorskip("starlette")


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
  return serve_fixture.served(tmp_path_factory)


_call = serve_fixture.call


def _reference(model, ids, gains_K):
  """float64: per position j (explaining ids[j+1]), the steered logits over the vocabulary,
  the k active prototypes, their steered contributions, residual, and W z_hat_g."""
  z = np.asarray(model.backbone(np.asarray(ids)[None])[0][0], np.float64)
  w = np.asarray(model.backbone.wte[...], np.float64)[:model.cfg.vocab_size]
  p = np.asarray(model.bank.protos[...], np.float64)
  k = model.cfg.k
  cos = (z / np.linalg.norm(z, axis=-1, keepdims=True)) @ (
      p / np.linalg.norm(p, axis=-1, keepdims=True)).T
  idx = np.argsort(-cos, -1, kind="stable")[:, :k]
  act = np.maximum(np.take_along_axis(cos, idx, -1), 0)
  act = act / act.sum(-1, keepdims=True)  # the tiny preset's normalised mixture
  z_hat = np.einsum("tk,tkd->td", act, p[idx])
  g = gains_K[idx]
  full = z @ w.T
  steered = full - np.einsum("tk,tkv->tv", (1 - g) * act, p[idx] @ w.T)
  proto_g = np.einsum("tk,tkd->td", g * act, p[idx]) @ w.T
  return dict(full=full, steered=steered, idx=idx, act=act, proto_g=proto_g, z=z,
              z_hat=z_hat, w=w, p=p, g=g)


def test_decompose_matches_float64_numpy_with_gains(srv):
  seed = secrets.randbits(32)
  rng = np.random.default_rng(seed)
  text = serve_fixture.random_text(seed, 5)
  gains = {int(i): float(rng.choice([0.0, 0.5, 2.0])) for i in rng.choice(16, 4, False)}
  r = _call(srv["app"], "POST", "/api/decompose",
            json={"prompt": text, "gains": {str(i): g for i, g in gains.items()}})
  assert r.status_code == 200, r.text
  out = r.json()
  ids = srv["tok"].encode(text)
  g_K = np.ones(16)
  for i, v in gains.items():
    g_K[i] = v
  ref = _reference(srv["model"], ids[:-1], g_K)
  assert len(out["tokens"]) == len(ids) - 1
  for j, t in enumerate(out["tokens"]):
    msg = f"seed {seed} position {t['i']}"
    y = ids[j + 1]
    assert t["id"] == y
    wy = ref["w"][y]
    want_logit = ref["steered"][j, y]
    assert abs(t["logit"] - want_logit) < 1e-3 * max(1, abs(want_logit)), msg
    assert abs(t["logit_unedited"] - ref["full"][j, y]) < 1e-3 * max(1, abs(want_logit)), msg
    assert abs(t["residual"] - (ref["z"][j] - ref["z_hat"][j]) @ wy) < 1e-3, msg
    want = {int(i): float(g * a * (ref["p"][i] @ wy))
            for i, a, g in zip(ref["idx"][j], ref["act"][j], ref["g"][j]) if g != 0}
    got = {s["id"]: s["contrib"] for s in t["slices"]}
    assert set(got) == set(want), msg  # gain-0 prototypes are gone from the slices
    for i in want:
      assert abs(got[i] - want[i]) < 1e-4, msg
    assert abs(sum(got.values()) + t["residual"] - t["logit"]) < 1e-4, msg
    top1 = int(np.argmax(ref["steered"][j]))
    if np.sort(ref["steered"][j])[-2] < ref["steered"][j, top1] - 1e-3:  # no near tie
      assert t["prediction"] == top1, msg
      pg = ref["proto_g"][j]
      if np.sort(pg)[-2] < pg.max() - 1e-3:
        assert t["agrees"] == (int(np.argmax(pg)) == top1), msg


def test_generate_stream_matches_the_library_sampler_and_a_plain_forward(srv):
  seed = secrets.randbits(31)
  text = serve_fixture.random_text(seed, 3)
  body = {"prompt": text, "max_new_tokens": 12, "seed": seed % 1000}
  c_ids = srv["tok"].encode(text)
  r = _call(srv["app"], "POST", "/api/generate", json=body)
  assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
  gen = client_lib._lines(r.text)  # pylint: disable=protected-access
  ids = gen["done"]["ids"]
  assert ids[:len(c_ids)] == c_ids and len(gen["tokens"]) == gen["done"]["new_tokens"]
  lib = library_generate(srv["model"], np.asarray(c_ids)[None], max_new_tokens=12,
                         temperature=0.8, top_k=40, seed=seed % 1000,
                         eos_id=srv["tok"].eos_id)
  n = int(lib.lengths_B[0])
  assert ids[len(c_ids):] == lib.tokens_BxL[0, :n].tolist(), f"seed {seed}"
  ref = _reference(srv["model"], ids[:-1], np.ones(16))
  for t in gen["tokens"]:
    j = t["i"] - 1  # the prediction of token i is read at position i - 1
    want = ref["full"][j, t["id"]]
    assert abs(t["logit"] - want) < 1e-3 * max(1, abs(want)), f"seed {seed} token {t['i']}"
    assert abs(sum(s["contrib"] for s in t["slices"]) + t["residual"] - t["logit"]) < 1e-4
    assert sorted(s["id"] for s in t["slices"]) == sorted(ref["idx"][j].tolist())
  again = client_lib._lines(_call(srv["app"], "POST", "/api/generate", json=body).text)  # pylint: disable=protected-access
  assert again["done"]["ids"] == ids  # same seed, same text


def test_steered_generation_applies_the_gains_to_every_step(srv):
  seed = secrets.randbits(31)
  text = serve_fixture.random_text(seed, 3)
  rng = np.random.default_rng(seed)
  off = [int(i) for i in rng.choice(16, 3, False)]
  body = {"prompt": text, "max_new_tokens": 10, "greedy": True,
          "gains": {str(i): 0 for i in off}}
  gen = client_lib._lines(_call(srv["app"], "POST", "/api/generate", json=body).text)  # pylint: disable=protected-access
  g_K = np.ones(16)
  g_K[off] = 0
  ids = gen["done"]["ids"]
  ref = _reference(srv["model"], ids[:-1], g_K)
  for t in gen["tokens"]:
    j = t["i"] - 1
    row = ref["steered"][j]
    assert abs(t["logit"] - row[t["id"]]) < 1e-3 * max(1, abs(row[t["id"]])), f"seed {seed}"
    assert not set(s["id"] for s in t["slices"]) & set(off)
    if np.sort(row)[-2] < row.max() - 1e-3:  # greedy = argmax of the steered logits
      assert t["id"] == int(np.argmax(row)), f"seed {seed} token {t['i']}"


def test_an_uploaded_suppression_set_equals_gains_of_zero(srv):
  from prism_jax.control.suppression import ProtoSet  # pylint: disable=g-import-not-at-top
  seed = secrets.randbits(32)
  text = serve_fixture.random_text(seed, 5)
  ids = [int(i) for i in np.random.default_rng(seed).choice(16, 3, False)]
  pset = json.loads(json.dumps({"format": "prism_jax.suppression_set/1",
                                **ProtoSet.create(srv["model"], ids).__dict__}))
  by_set = _call(srv["app"], "POST", "/api/decompose",
                 json={"prompt": text, "steering_set": pset}).json()
  by_gains = _call(srv["app"], "POST", "/api/decompose",
                   json={"prompt": text, "gains": {str(i): 0 for i in ids}}).json()
  assert by_set["tokens"] == by_gains["tokens"] and by_set["gains"] == by_gains["gains"]
  assert set(by_set["gains"]) == {str(i) for i in ids}


def test_attribution_ranks_match_the_caches_own_query(srv):
  seed = secrets.randbits(32)
  text = serve_fixture.random_text(seed, 4)
  ids = srv["tok"].encode(text)
  pos = int(np.random.default_rng(seed).integers(1, len(ids)))
  body = {"ids": ids, "position": pos, "top": 5}
  for _ in range(600):  # first use builds the cache in the background (202 + progress)
    r = _call(srv["app"], "POST", "/api/attribute", json=body)
    if r.status_code == 200:
      break
    assert r.status_code == 202 and r.json()["state"] == "building", r.text
    asyncio.run(asyncio.sleep(0.2))
  out = r.json()
  ex = srv["explorer"]
  cache = cache_lib.open_or_build(srv["model"], srv["cfg"], ex.packed(),
                                  f"{srv['run']}/attribution_cache")
  want = influence.attribute(srv["model"], cache, np.asarray(ids[:pos + 1]), [pos],
                             cfg=influence.InfluenceConfig(top=5), packed=ex.packed())
  assert [s["document"] for s in out["sequences"]] == want.example_ids.tolist()
  assert out["method"] == influence.METHOD_LABEL  # the explorer says which method ranked them
  np.testing.assert_allclose([s["score"] for s in out["sequences"]], want.scores, rtol=1e-6)
  for s, snip in zip(out["sequences"], want.snippets):
    assert f"{s['before']}[[{s['span']}]]{s['after']}" in snip


def test_prototype_page_usage_and_nearest_against_numpy(srv):
  pid = secrets.randbelow(16)
  r = _call(srv["app"], "GET", f"/api/prototype/{pid}")
  assert r.status_code == 200
  out = r.json()
  p = np.asarray(srv["model"].bank.protos[...], np.float64)
  u = p / np.linalg.norm(p, axis=1, keepdims=True)
  cos = u @ u[pid]
  cos[pid] = -np.inf
  assert [n["id"] for n in out["nearest"]][:3] == np.argsort(-cos, kind="stable")[:3].tolist()
  rows = np.asarray(srv["explorer"].packed().rows("val")["tokens"])[:64, :-1]
  idx = np.asarray(srv["model"](rows).protos.idx_Nxk)
  assert abs(out["usage_val"] - (idx == pid).sum() / rows.size) < 1e-9
  card = out["card"]
  assert card["contexts"] and all(c["trigger"] for c in card["contexts"])
  found = _call(srv["app"], "GET", "/api/search", params={"q": f"#{pid}"}).json()
  assert found["results"][0]["id"] == pid
  # by token: a prototype whose top context's trigger is a searchable token (not blank,
  # not a number, which searches by id) is found by it
  cards = srv["explorer"].cards
  for other in [pid] + [i for i in range(16) if i != pid]:
    trig = cards.card(other).contexts[0].trigger.strip()
    if trig and not trig.lstrip("#").isdigit():
      break
  r = _call(srv["app"], "GET", "/api/search", params={"q": trig})
  assert r.status_code == 200, r.text
  assert other in [h["id"] for h in r.json()["results"]]


@pytest.mark.long  # ~30-45 s: `make test-long`
def test_64_concurrent_requests_on_loopback_all_correct_and_nothing_recompiles(srv):
  ex = srv["explorer"]
  compiled = ex.engine.compiles()
  rng = np.random.default_rng(secrets.randbits(32))
  jobs = []
  context = srv["model"].cfg.max_len
  while len(jobs) < 64:  # fresh prompts each run, each one that fits the context (else a 400)
    text = " ".join(rng.choice(serve_fixture.WORDS, int(rng.integers(2, 9))))
    new = int(rng.integers(1, 8))
    if len(srv["tok"].encode(text)) + new > context:
      continue
    if len(jobs) % 2:
      jobs.append(("decompose", {"prompt": text}))
    else:
      jobs.append(("generate", {"prompt": text, "max_new_tokens": new,
                                "seed": int(rng.integers(1000))}))
  with server.running(srv["app"]) as url:
    answers = client_lib.load_test(url, jobs, concurrency=16)
  assert all(a["status"] == 200 for a in answers)
  for a in answers:
    if a["kind"] == "decompose":
      ids = srv["tok"].encode(a["body"]["prompt"])
      ref = _reference(srv["model"], ids[:-1], np.ones(16))
      got = [t["logit"] for t in a["answer"]["tokens"]]
      want = [ref["full"][j, ids[j + 1]] for j in range(len(ids) - 1)]
      np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
    else:
      assert len(a["answer"]["tokens"]) == a["answer"]["done"]["new_tokens"] >= 1
      ids = a["answer"]["done"]["ids"]
      ref = _reference(srv["model"], ids[:-1], np.ones(16))
      for t in a["answer"]["tokens"]:
        assert abs(t["logit"] - ref["full"][t["i"] - 1, t["id"]]) < 1e-3
  assert ex.engine.compiles() == compiled  # warm-up compiled every bucket
  print(json.dumps(client_lib.percentiles([a["ms"] for a in answers])))
