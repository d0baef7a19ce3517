"""A fuzz of the explorer's server (issue 57): hypothesis writes request bodies for
/api/generate, /api/decompose and /api/attribute (gains and steering sets inside them) as raw
JSON text, so that what json.dumps never writes is in it too: nesting tens of thousands deep,
integers of thousands of digits, NaN, lone surrogates, duplicate keys, "5" and "05" naming one
prototype, wrong types, non-UTF-8 bytes. Also the Guard's headers and the GET routes' path and
query. Every answer must be under 500, an error one JSON line. In process (serve_fixture.call),
derandomized (the same examples on every run), max_new_tokens kept to 1..3 where it is valid
so that the bodies that pass generate quickly."""

import json
import time
import urllib.parse

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import pytest

import serve_fixture

# `make test-long` (2,500 generated requests: ~35 s); .ci/run runs it after `make test`.
pytestmark = pytest.mark.long

pytest.importorskip("starlette")

FIELDS = {
    "generate": ["prompt", "ids", "max_new_tokens", "temperature", "top_k", "seed", "greedy",
                 "gains", "steering_set"],
    "decompose": ["prompt", "ids", "gains", "steering_set"],
    "attribute": ["prompt", "ids", "position", "top"],
}
# keys naming prototype 5 several ways, out-of-range ids, and what int() alone would take
PROTO_KEYS = ["0", "5", "05", " 5", "+5", "5 ", "-1", "15", "16", "99999999999", "1.5", "",
              "\u0665", "5_0", "0x5", "1e1", "true", "\ud800"]
SETTINGS = dict(deadline=None, derandomize=True, database=None, print_blob=True,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
  return serve_fixture.served(tmp_path_factory)


# --- JSON text, fragment by fragment --------------------------------------------------------

def _object(keys, values, max_size=5):
  return st.lists(st.tuples(keys, values), max_size=max_size).map(
      lambda kv: "{" + ", ".join(f"{k}: {v}" for k, v in kv) + "}")


def _json_list(items, min_size=0, max_size=5):
  return st.lists(items, min_size=min_size, max_size=max_size).map(
      lambda xs: "[" + ", ".join(xs) + "]")


# Built once: a strategy made inside a draw is validated anew each time (most of the run).
WORDS = st.lists(st.sampled_from(serve_fixture.WORDS), min_size=1, max_size=6).map(" ".join)
STRINGS = st.one_of(
    WORDS.map(json.dumps),
    st.text(max_size=30).map(json.dumps),  # \u escapes
    st.text(max_size=30).map(lambda t: json.dumps(t, ensure_ascii=False)),  # raw UTF-8
    st.sampled_from(['"\\ud800"', '"for \\udfff the"', '"a\\u0000b"', '"\\""', '"open',
                     '"\\x41"', '"\\u12"', '"   "', '"' + "for " * 1100 + '"', '"\u2028"']))
NUMBERS = st.one_of(
    st.integers(-300, 300).map(str), st.integers(-2**80, 2**80).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.integers(1, 6000).map(lambda n: "9" * n),  # Python's int-string limit is 4300 digits
    st.integers(1, 6000).map(lambda n: "-1" + "0" * n),
    st.integers(1, 6000).map(lambda n: "0." + "0" * n + "1"),
    st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1e-999", "0.5e",
                     "01", "+1", "1.", ".5", "0x10", "1_000", "-", "1" + "0" * 400]))
_SHAPES = {"list": lambda d: "[" * d + "]" * d, "object": lambda d: '{"a":' * d + "1" + "}" * d,
           "open": lambda d: "[" * d, "mixed": lambda d: '[{"b":' * d + "0" + "}]" * d}
DEEP = st.tuples(st.integers(1, 30000), st.sampled_from(sorted(_SHAPES))).map(
    lambda t: _SHAPES[t[1]](t[0]))
KEYS = st.one_of(st.sampled_from(PROTO_KEYS + sum(FIELDS.values(), [])).map(json.dumps), STRINGS)
TREES = st.recursive(st.one_of(STRINGS, NUMBERS, st.sampled_from(["true", "false", "null"])),
                     lambda c: st.one_of(_json_list(c), _object(KEYS, c)), max_leaves=12)
ANY = st.tuples(st.integers(0, 5), DEEP, TREES).map(  # one in six deep: its refusal is early
    lambda t: t[1] if t[0] == 0 else t[2])
WRONG = st.one_of(STRINGS, ANY, st.sampled_from(  # never a valid count or position
    ["true", "false", "null", "[]", "{}", "1.5", "2.0", "[1]", '{"a": 1}', "0", "-1", "257",
     "1e3", "9" * 5000, "NaN"]))
GOOD_GAINS = _object(st.integers(0, 15).map(lambda i: json.dumps(str(i))),
                     st.floats(0, 10).map(repr), max_size=4)
BAD_GAINS = st.one_of(_object(st.one_of(st.sampled_from(PROTO_KEYS).map(json.dumps), STRINGS),
                              st.one_of(st.sampled_from(["0", "1", "10.5", "-0", "-1", "1e9"]),
                                        NUMBERS, ANY), max_size=6), ANY)
GOOD = {  # valid values, so that the one malformed field of a body reaches deep
    "prompt": WORDS.map(json.dumps),
    "ids": st.lists(st.integers(0, 257), min_size=2, max_size=20).map(json.dumps),
    "max_new_tokens": st.sampled_from(["1", "2", "3"]),
    "temperature": st.floats(0, 5).map(repr), "top_k": st.integers(1, 258).map(str),
    "seed": st.integers(0, 2**31 - 1).map(str), "greedy": st.sampled_from(["true", "false"]),
    "gains": GOOD_GAINS, "position": st.just("1"),
    "top": st.integers(1, 20).map(str),
}
# Each body names these, valid or never-valid: an attribution compiles for each new prefix
# length (~3 s), position 1 keeps to one; a generation of 256 tokens would be slow.
MUST = {"generate": "max_new_tokens", "attribute": "position"}
BAD = {name: st.one_of(ANY, WRONG) for name in GOOD}
BAD.update(prompt=st.one_of(STRINGS, ANY), gains=BAD_GAINS, max_new_tokens=WRONG,
           position=WRONG,
           ids=st.one_of(_json_list(st.sampled_from(["-1", "258", "1.0", "true", '"1"', "null",
                                                     "9" * 30]), min_size=1), ANY))


def _steering(fingerprint):
  """(good, bad) steering sets: the explorer's own, `prism suppress`'s, anything."""
  fp = json.dumps(fingerprint)
  good = st.one_of(
      GOOD_GAINS.map(lambda g: '{"gains": %s, "format": "prism_jax.steering/1"}' % g),
      _json_list(st.integers(0, 15).map(str)).map(
          lambda ids: '{"format": "prism_jax.suppression_set/1", "ids": %s, '
          '"fingerprint": %s}' % (ids, fp)))
  ids = st.one_of(_json_list(st.sampled_from(["0", "5", "16", "-1", "1.7", "true", '"5"',
                                              '"05"', "null"])), ANY)
  bad = st.one_of(
      st.tuples(ids, st.sampled_from([fp, "{}", '{"d_model": 1}', "[]", '"x"', "null", "7"])
                ).map(lambda t: '{"format": "prism_jax.suppression_set/1", "ids": %s, '
                      '"fingerprint": %s}' % t),
      st.tuples(BAD_GAINS, st.sampled_from(['"prism_jax.steering/1"', '"other/9"', "1", "null"])
                ).map(lambda t: '{"gains": %s, "format": %s, "note": "n"}' % t),
      st.just('"/etc/passwd"'), ANY)
  return good, bad


def bodies(endpoint, fingerprint, bad_fields):
  """One request body as bytes: mostly an object of the endpoint's fields, `bad_fields` of
  them malformed (a list of counts to draw from), maybe one repeated or an unknown one added;
  else any JSON text, or bytes."""
  good, bad = dict(GOOD), dict(BAD)
  good["steering_set"], bad["steering_set"] = _steering(fingerprint)
  fields = FIELDS[endpoint]

  @st.composite
  def body(draw):
    kind = draw(st.sampled_from(["fields"] * 12 + ["object", "text", "bytes"]))
    if kind == "bytes":
      return draw(st.binary(max_size=300))
    if kind == "text":
      return draw(ANY).encode("utf-8", "surrogatepass")
    if kind == "object":
      return draw(_object(ANY, ANY)).encode("utf-8", "surrogatepass")
    source = draw(st.sampled_from(["prompt", "ids"]))  # the prompt one way, or both, or none
    wrong = set(draw(st.permutations(fields))[:draw(st.sampled_from(bad_fields))])
    pairs = [(json.dumps(n), draw(bad[n] if n in wrong else good[n])) for n in fields
             if n in wrong or n == source or n == MUST.get(endpoint) or
             (n not in ("prompt", "ids") and draw(st.booleans()))]
    if draw(st.integers(0, 5)) == 0:  # an unknown field, or one given twice
      pairs.append((draw(st.sampled_from(['"cache_dir"', '"Prompt"', '"path"'] + [
          json.dumps(n) for n in fields])), draw(ANY)))
    text = "{" + ", ".join(f"{k}: {v}" for k, v in draw(st.permutations(pairs))) + "}"
    return text.encode("utf-8", "surrogatepass")
  return body()


# --- the checks ------------------------------------------------------------------------------

def _answered(r) -> None:
  assert r.status_code < 500, (r.status_code, r.text[:300])
  assert not any(h.startswith("access-control-") for h in r.headers)
  if r.status_code >= 400:
    msg = r.json()["error"]
    assert msg and "\n" not in msg and len(msg) < 400, msg


def _fuzz(srv, endpoint, n, bad_fields):
  seen = []
  fingerprint = srv["explorer"].fingerprint
  content_type = st.sampled_from(["application/json", "text/plain", None,
                                  "application/x-www-form-urlencoded"])

  @settings(max_examples=n, **SETTINGS)
  @given(body=bodies(endpoint, fingerprint, bad_fields), ctype=content_type)
  def one(body, ctype):
    headers = {"Content-Type": ctype} if ctype else {}
    r = serve_fixture.call(srv["app"], "POST", f"/api/{endpoint}", content=body,
                           headers=headers)
    _answered(r)
    if endpoint == "generate" and r.status_code == 200:
      assert json.loads(r.text.strip().splitlines()[-1])["done"], r.text[-300:]
    seen.append(r.status_code)
  one()
  assert len(seen) >= n, len(seen)  # every example ran (none filtered away)
  assert {400, 413}.issubset(seen) and min(seen) < 300, sorted(set(seen))  # some were valid
  return seen


def test_fuzz_generate_never_answers_500(srv):
  _fuzz(srv, "generate", 900, [0, 1, 1, 1, 2, 9])


def test_fuzz_decompose_never_answers_500(srv):
  _fuzz(srv, "decompose", 800, [0, 1, 1, 1, 2, 9])


def test_fuzz_attribute_never_answers_500(srv):
  deadline = time.monotonic() + 180  # the cache ready first, so valid bodies reach scoring
  while serve_fixture.call(srv["app"], "POST", "/api/attribute",
                           json={"prompt": "for the", "position": 1}).status_code == 202:
    assert time.monotonic() < deadline, srv["explorer"].cache_state()
    time.sleep(0.5)
  _fuzz(srv, "attribute", 400, [0, 1, 1, 1, 2, 9])


def test_fuzz_guard_headers_and_get_routes_never_answer_500(srv):
  from prism_jax.serve.app import create_app  # pylint: disable=g-import-not-at-top
  token = "fuzz-token-0123456789"
  apps = [srv["app"], create_app(srv["explorer"], token=token, host="0.0.0.0")]
  header_bytes = st.one_of(
      st.binary(max_size=40).map(lambda b: bytes(c for c in b if c >= 0x20 and c != 0x7f)),
      st.sampled_from([b"Bearer " + token.encode(), b"Bearer \xc3\xb1", b"localhost:8000",
                       b"[::1]:99999", b"http://127.0.0.1", b"null", b"a@b", b"[::1",
                       f"prism_token_80={token}".encode(), b"prism_token_80=%ff%fe"]))
  names = st.sampled_from([b"host", b"origin", b"authorization", b"cookie", b"sec-fetch-site",
                           b"content-length"])
  paths = st.one_of(
      st.text(max_size=20).map(lambda t: "/api/prototype/" + urllib.parse.quote(
          t.encode("utf-8", "surrogatepass"), safe="")),
      st.text(max_size=60).map(lambda t: "/api/search?q=" + urllib.parse.quote(
          t.encode("utf-8", "surrogatepass"), safe="")),
      st.sampled_from(["/", "/static/app.js", "/api/status", "/?token=" + token,
                       "/?token=%ff", "/static/%2e%2e%2fsetup.cfg", "/api/prototype/%00"]))
  seen = []

  @settings(max_examples=400, **SETTINGS)
  @given(app=st.sampled_from([0, 1]), path=paths,
         headers=st.lists(st.tuples(names, header_bytes), max_size=4))
  def one(app, path, headers):
    r = serve_fixture.call(apps[app], "GET", path, headers=headers)
    _answered(r)
    seen.append(r.status_code)
  one()
  assert len(seen) >= 400 and {200, 403}.issubset(seen), sorted(set(seen))
