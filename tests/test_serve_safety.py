"""The explorer refuses bad input with a 4xx and one line, and keeps serving: every kind of
bad request, the access token on a non-loopback bind, a client that leaves mid-stream."""

import json
import socket
import time

import httpx
import pytest

from prism_jax.serve import server
from prism_jax.serve.app import create_app

import serve_fixture

pytest.importorskip("starlette")


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
  return serve_fixture.served(tmp_path_factory)


BAD = [  # (what, method, path, kwargs, status)
    ("empty prompt", "POST", "/api/generate", {"json": {"prompt": "   "}}, 400),
    ("oversized prompt", "POST", "/api/generate", {"json": {"prompt": "for " * 1200}}, 400),
    ("prompt over the context", "POST", "/api/decompose", {"json": {"prompt": "x" * 65}}, 400),
    ("non-UTF-8 body", "POST", "/api/generate",
     {"content": b'{"prompt": "\xff\xfe"}', "headers": {"content-type": "application/json"}}, 400),
    ("unknown token id", "POST", "/api/decompose", {"json": {"ids": [1, 999999]}}, 400),
    ("unknown prototype id (page)", "GET", "/api/prototype/16", {}, 400),
    ("unknown prototype id (gains)", "POST", "/api/generate",
     {"json": {"prompt": "for", "gains": {"99": 0}}}, 400),
    ("negative gain", "POST", "/api/generate", {"json": {"prompt": "for", "gains": {"1": -1}}},
     400),
    ("huge gain", "POST", "/api/generate", {"json": {"prompt": "for", "gains": {"1": 1e9}}}, 400),
    ("top-k out of range", "POST", "/api/generate", {"json": {"prompt": "for", "top_k": 0}}, 400),
    ("new tokens out of range", "POST", "/api/generate",
     {"json": {"prompt": "for", "max_new_tokens": 100000}}, 400),
    ("malformed JSON", "POST", "/api/generate",
     {"content": b'{"prompt": "for",', "headers": {"content-type": "application/json"}}, 400),
    ("NaN in JSON", "POST", "/api/generate",
     {"content": b'{"prompt": "for", "temperature": NaN}'}, 400),
    ("a path in a field", "POST", "/api/generate",
     {"json": {"prompt": "for", "steering_set": "/etc/passwd"}}, 400),
    ("an unknown field naming a path", "POST", "/api/decompose",
     {"json": {"prompt": "for the", "cache_dir": "/tmp"}}, 400),
    ("oversized body", "POST", "/api/decompose", {"content": b"{" + b" " * 70000 + b"}"}, 413),
    ("path traversal in the URL", "GET", "/static/..%2F..%2Fsetup.cfg", {}, 404),
    ("path traversal, dotted", "GET", "/static/../../../etc/passwd", {}, 404),
    ("another model's suppression set", "POST", "/api/generate",
     {"json": {"prompt": "for", "steering_set": {"format": "prism_jax.suppression_set/1",
                                                  "ids": [1], "fingerprint": {"d_model": 1}}}},
     409),
    ("attribution position out of range", "POST", "/api/attribute",
     {"json": {"prompt": "for", "position": 9}}, 400),
    ("wrong method", "GET", "/api/generate", {}, 405),
]


_send = serve_fixture.call


@pytest.mark.parametrize("what,method,path,kw,status", BAD, ids=[b[0] for b in BAD])
def test_bad_request_is_a_4xx_with_one_line_and_the_server_keeps_serving(
    srv, what, method, path, kw, status):
  r = _send(srv["app"], method, path, **kw)
  assert r.status_code == status, (what, r.status_code, r.text)
  msg = r.json()["error"]
  assert msg and "\n" not in msg and len(msg) < 300 and "Traceback" not in msg, (what, msg)
  ok = _send(srv["app"], "POST", "/api/decompose", json={"prompt": "for the"})
  assert ok.status_code == 200


def test_a_non_loopback_bind_needs_its_token_on_every_request(srv):
  assert server.access_token("127.0.0.1", None) is None
  token = server.access_token("0.0.0.0", None)
  assert token and len(token) >= 16
  with pytest.raises(ValueError, match="at least 16"):
    server.access_token("0.0.0.0", "short")
  app = create_app(srv["explorer"], token=token)
  for headers, params in [({}, {}), ({"Authorization": "Bearer wrong-token-wrong-token"}, {}),
                          ({}, {"token": "nope"})]:
    r = _send(app, "GET", "/api/status", headers=headers, params=params)
    assert r.status_code == 401 and r.json()["error"] == "missing or wrong access token"
    r = _send(app, "GET", "/", headers=headers, params=params)
    assert r.status_code == 401
  assert _send(app, "GET", "/api/status",
               headers={"Authorization": f"Bearer {token}"}).status_code == 200
  assert _send(app, "GET", "/", params={"token": token}).status_code == 200


def test_a_client_leaving_mid_stream_has_its_work_dropped_and_the_next_is_served(srv):
  ex = srv["explorer"]
  with server.running(srv["app"]) as url:
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "for the", "max_new_tokens": 56, "greedy": True}).encode()
    before = ex.dropped
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /api/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    got = b""
    while b'{"i": ' not in got:  # a first token line arrived (chunked NDJSON)
      chunk = sock.recv(4096)
      assert chunk, got  # the server must not close a 56-token stream this early
      got += chunk
    assert not got.endswith(b"0\r\n\r\n")
    sock.close()
    deadline = time.monotonic() + 20
    while ex.dropped == before and time.monotonic() < deadline:
      time.sleep(0.05)
    assert ex.dropped == before + 1  # the stream stopped before its 56 tokens
    r = httpx.post(f"{url}/api/generate", json={"prompt": "while", "max_new_tokens": 3},
                   timeout=60)
    assert r.status_code == 200 and r.text.strip().splitlines()[-1].startswith('{"done"')


def test_attribution_without_a_cache_is_refused_when_building_is_off(srv, tmp_path):
  import shutil as sh  # pylint: disable=g-import-not-at-top
  from prism_jax.runs import load  # pylint: disable=g-import-not-at-top
  from prism_jax.serve.state import Explorer  # pylint: disable=g-import-not-at-top
  copy = tmp_path / "run"
  sh.copytree(srv["run"], copy, ignore=sh.ignore_patterns("attribution_cache"))
  app = create_app(Explorer(load(str(copy)), build_cache=False, build_cards=False))
  r = _send(app, "POST", "/api/attribute", json={"prompt": "for the"})
  assert r.status_code == 409 and "building is off" in r.json()["error"]
  assert not (copy / "attribution_cache").exists()  # nothing was built
  assert _send(app, "GET", "/api/status").json()["cache"]["state"] == "absent, building off"
