"""The explorer refuses bad input with a 4xx and one line, and keeps serving: every kind of
bad request, the access token on a non-loopback bind (and its cookie), a client that leaves
mid-stream; requests under another Host name (DNS rebinding) or from another Origin are
refused before they reach the model (issue 57)."""

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
    # issue 57: each of these was a 500 (RecursionError, int-string limit, OverflowError)
    ("JSON nested 60 KB deep", "POST", "/api/decompose",
     {"content": b'{"prompt": ' + b"[" * 30000 + b"]" * 30000 + b"}"}, 400),
    ("a 5000-digit integer", "POST", "/api/generate",
     {"content": b'{"prompt": "for", "seed": ' + b"9" * 5000 + b"}"}, 400),
    ("a 400-digit integer as a number", "POST", "/api/generate",
     {"content": b'{"prompt": "for", "temperature": 1' + b"0" * 400 + b"}"}, 400),
    ("a duplicate JSON key", "POST", "/api/decompose",
     {"content": b'{"prompt": "x", "prompt": "for the"}'}, 400),  # was: the last one, silently
    ("a duplicate key in gains", "POST", "/api/decompose",
     {"content": b'{"prompt": "for the", "gains": {"5": 0, "5": 1}}'}, 400),
    ("a prototype id in Arabic-Indic digits", "POST", "/api/decompose",  # int("\u0665") == 5
     {"json": {"prompt": "for the", "steering_set": {"gains": {"\u0665": 0}}}}, 400),
    ("a prototype id with an underscore", "POST", "/api/decompose",  # int("1_5") == 15
     {"json": {"prompt": "for the", "gains": {"1_5": 0}}}, 400),
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


def _refused(r, status: int) -> str:
  assert r.status_code == status, (r.status_code, r.text)
  msg = r.json()["error"]
  assert msg and "\n" not in msg and len(msg) < 300, msg
  assert not any(h.startswith("access-control-") for h in r.headers), r.headers  # no CORS
  return msg


@pytest.mark.parametrize("keys", [("5", "05"), ("5", " 5"), ("+5", "5")])
def test_gains_naming_one_prototype_twice_are_refused_by_name(srv, keys):
  # issue 57: {"5": 0, "05": 2} was taken, one gain silently winning
  body = {"prompt": "for the", "gains": {keys[0]: 0, keys[1]: 2}}
  for path in ("/api/decompose", "/api/generate"):
    msg = _refused(_send(srv["app"], "POST", path, json={**body, "max_new_tokens": 1}
                         if path == "/api/generate" else body), 400)
    assert "prototype 5 twice" in msg, msg
  msg = _refused(_send(srv["app"], "POST", "/api/decompose",
                       content=b'{"prompt": "for", "prompt": "the"}'), 400)
  assert msg == "duplicate key 'prompt' in a JSON object"


ENDPOINTS = [  # every route, with a body that a same-origin client gets a 200 for
    ("GET", "/", {}), ("GET", "/static/app.js", {}), ("GET", "/api/status", {}),
    ("GET", "/api/prototype/5", {}), ("GET", "/api/search", {"params": {"q": "for"}}),
    ("POST", "/api/generate", {"json": {"prompt": "for the", "max_new_tokens": 2}}),
    ("POST", "/api/decompose", {"json": {"prompt": "for the"}}),
    ("POST", "/api/attribute", {"json": {"prompt": "for the"}}),
]


def test_a_page_under_another_host_name_is_refused_on_every_route(srv):
  # issue 57: DNS rebinding. A page at evil.example:PORT whose name now resolves to 127.0.0.1
  # sends Host: evil.example:PORT; it read /api/attribute and /api/prototype/5 with a 200
  jobs = srv["explorer"].engine.submitted
  for method, path, kw in ENDPOINTS:
    for host in ("evil.example:8000", "evil.example", "localhost.evil.example",
                 "127.0.0.1.nip.io:8000", "[::2]:8000"):
      msg = _refused(_send(srv["app"], method, path, headers={"Host": host}, **kw), 403)
      assert "is not this explorer's name" in msg, msg
  assert srv["explorer"].engine.submitted == jobs  # the model ran for none of them
  for host in ("localhost:1234", "127.0.0.1", "[::1]:8000", "LocalHost:9"):
    assert _send(srv["app"], "GET", "/api/status", headers={"Host": host}).status_code == 200
  _refused(_send(srv["app"], "GET", "/api/status", headers={"Host": "a@b"}), 400)


def test_allow_host_and_the_bind_decide_which_names_are_answered(srv):
  ex, token = srv["explorer"], "t0ken-" * 4

  def code(app, host, **kw):
    return _send(app, "GET", "/api/status", headers={"Host": host, **kw}).status_code
  named = create_app(ex, allow_hosts=["Box.Lan", "[fd00::1]"])
  assert [code(named, h) for h in ("box.lan:8000", "[fd00::1]:80", "localhost", "evil.example")
          ] == [200, 200, 200, 403]
  auth = {"Authorization": f"Bearer {token}"}
  anyname = create_app(ex, token=token, host="0.0.0.0")  # a wildcard with a token: any name
  assert code(anyname, "whatever.example:8000", **auth) == 200
  assert code(anyname, "whatever.example:8000") == 401
  listed = create_app(ex, token=token, host="::", allow_hosts=["box.lan"])
  assert [code(listed, h, **auth) for h in ("box.lan", "localhost:1", "whatever.example")
          ] == [200, 200, 403]
  bound = create_app(ex, token=token, host="10.1.2.3")
  assert [code(bound, h, **auth) for h in ("10.1.2.3:8000", "evil.example")] == [200, 403]
  for bad in ("http://box.lan", "box.lan:8000", "box.lan/x", "", "*"):
    with pytest.raises(ValueError, match="--allow_host: .* is not a host name"):
      server.host_names("127.0.0.1", None, [bad])


def test_another_origin_can_neither_read_nor_generate(srv):
  # issue 57: a page on another origin POSTed text/plain (no CORS preflight) to
  # /api/generate, decompose, attribute and they ran; Origin is now checked on every route
  jobs = srv["explorer"].engine.submitted
  for origin in ("http://evil.example", "http://127.0.0.1:9999", "http://localhost",
                 "https://127.0.0.1", "null", "file://", "http://127.0.0.1/x"):
    for method, path, kw in ENDPOINTS:
      if "json" in kw:
        kw = {"content": json.dumps(kw["json"]), "headers": {"Content-Type": "text/plain"}}
      headers = {**kw.get("headers", {}), "Origin": origin}
      r = _send(srv["app"], method, path, **{**kw, "headers": headers})
      assert "cross-origin request refused" in _refused(r, 403)
  for site in ("cross-site", "same-site"):  # a no-cors GET sends no Origin; Chromium says so
    _refused(_send(srv["app"], "GET", "/api/status", headers={"Sec-Fetch-Site": site}), 403)
  assert srv["explorer"].engine.submitted == jobs
  for origin in ("http://127.0.0.1", "http://127.0.0.1:80"):  # the page's own POSTs work
    r = _send(srv["app"], "POST", "/api/decompose", json={"prompt": "for the"},
              headers={"Origin": origin, "Sec-Fetch-Site": "same-origin"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


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
  # issue 57: a non-ASCII header was a 500 (hmac.compare_digest of non-ASCII str)
  for bad in ("Bearer \u00f1" + token[1:], "Bearer \u2603"):
    r = _send(app, "GET", "/api/status", headers={"Authorization": bad.encode()})
    assert r.status_code == 401, r.text


def test_the_token_page_loads_its_assets_by_a_cookie(srv):
  # issue 57: /?token=T loaded static/app.js and style.css without the token: 401
  token = server.access_token("0.0.0.0", None)
  app = create_app(srv["explorer"], token=token, host="0.0.0.0")
  r = _send(app, "GET", "/", params={"token": token})
  assert r.status_code == 200
  cookie = r.headers["set-cookie"]
  name_value, *attrs = [a.strip() for a in cookie.split(";")]
  assert name_value == f"prism_token_80={token}"
  assert {"HttpOnly", "SameSite=Strict", "Path=/"} <= set(attrs), cookie
  for path in ("/static/app.js", "/static/style.css", "/api/status", "/"):
    assert _send(app, "GET", path).status_code == 401  # no credential at all
    assert _send(app, "GET", path, headers={"Cookie": name_value}).status_code == 200, path
    assert _send(app, "GET", path,
                 headers={"Cookie": f"prism_token_80=x{token}"}).status_code == 401
  assert _send(app, "GET", "/static/app.js", headers={"Cookie": f"prism_token_81={token}"}
               ).status_code == 401  # another port's explorer has its own cookie
  r = _send(app, "GET", "/api/status", headers={"Authorization": f"Bearer {token}"})
  assert r.status_code == 200 and "set-cookie" not in r.headers  # only ?token= sets it


def test_a_client_leaving_mid_stream_has_its_work_dropped_and_the_next_is_served(srv):
  ex = srv["explorer"]
  with server.running(srv["app"]) as url:
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "for the", "max_new_tokens": 56, "greedy": True}).encode()
    before = ex.dropped
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /api/generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
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
