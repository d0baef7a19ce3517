"""`prism serve`'s ASGI application (Starlette): a JSON API over one run, and its page.

  GET  /                       the explorer page (assets from the package; no network)
  GET  /static/<asset>         app.js, style.css (a fixed list: no path reaches the disk)
  GET  /api/status             the run, compile count, cache and cards state
  POST /api/generate           NDJSON stream: the prompt, then one line per token, then done
  POST /api/decompose          every token's logit as prototype slices + residual, with trust
  POST /api/attribute          a token's top training sequences (the attribution cache)
  GET  /api/prototype/<id>     card, contexts, usage (validation split), nearest prototypes
  GET  /api/search?q=          prototypes by id, token or text

Bad requests get a 4xx whose JSON body is {"error": "<one line>"}; the server keeps serving.
Before any route, the Guard checks, in order (the explorer answers its own page only):
  - `Host` names the bound address (any port): on loopback localhost, 127.0.0.1 or [::1];
    plus the names given with --allow_host; on a wildcard bind with a token, any name unless
    names were given. Else 403: a DNS-rebinding page reaches us under its own name.
  - `Origin`, when sent, is this server's own (scheme://Host; `null` is not); on /api also
    `Sec-Fetch-Site` is not same-site or cross-site. Else 403: no other page, another port
    of localhost included, may drive the model or read the run. No CORS headers, ever.
  - With `token` set (any bind that is not loopback), every request carries it:
    `Authorization: Bearer <token>`, `?token=`, or the cookie that an authorised `?token=`
    request sets (HttpOnly, SameSite=Strict, named by port), so the page's own assets load.
    Cookies are not port-scoped: another server on the same host name sees it.
"""

from __future__ import annotations

import hmac
import importlib.resources
import json
import logging
import re
import time
import urllib.parse

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from prism_jax.serve import requests as rq
from prism_jax.serve.server import host_names
from prism_jax.serve.state import Explorer

ASSETS = {"app.js": "text/javascript", "style.css": "text/css"}
log = logging.getLogger("prism_jax.serve")
# host[:port] of a Host header or an origin; an IPv6 address in brackets; no userinfo or path
_AUTHORITY = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[^\[\]:/@\s]+)(?::([0-9]{1,5}))?")
_ORIGIN = re.compile(r"(https?)://(.+)")
_DEFAULT_PORT = {"http": 80, "https": 443}


def _asset(name: str) -> bytes:
  return importlib.resources.files("prism_jax.serve").joinpath("static", name).read_bytes()


def _error(message: str, status: int) -> JSONResponse:
  return JSONResponse({"error": message}, status_code=status)


def _authority(text: str, scheme: str) -> tuple[str, int] | None:
  """(hostname, port) of "host[:port]", lowercased, brackets off; None when malformed."""
  m = _AUTHORITY.fullmatch(text)
  if m is None:
    return None
  port = int(m.group(2)) if m.group(2) else _DEFAULT_PORT.get(scheme, 80)
  return m.group(1).strip("[]").lower(), port


class Guard:
  """Pure ASGI middleware: Host and Origin, the access token, the body-size bound, one-line
  errors. `hosts`: the Host names answered (None: any; prism_jax/serve/server.host_names)."""

  def __init__(self, app, token: str | None, hosts: frozenset[str] | None):
    self.app, self.hosts = app, hosts
    self.token = token.encode() if token is not None else None  # compared as bytes

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    headers = dict(scope.get("headers") or [])
    host = _authority(headers.get(b"host", b"").decode("latin-1"), scope.get("scheme", "http"))
    refused = self._refusal(scope, headers, host)
    if refused is not None:
      return await _error(*refused)(scope, receive, send)
    if self.token is not None:
      how = self._credential(scope, headers, host[1])
      if how is None:
        return await _error("missing or wrong access token", 401)(scope, receive, send)
      if how == "query":  # the page's assets and calls carry no ?token=: the cookie does
        send = _with_cookie(send, self._cookie_header(scope, host[1]))
    length = headers.get(b"content-length")
    if length is not None and (not length.isdigit() or int(length) > rq.LIMITS["body_bytes"]):
      return await _error(f"request body over {rq.LIMITS['body_bytes']} bytes", 413)(
          scope, receive, send)
    try:
      await self.app(scope, receive, send)
    except Exception as e:  # pylint: disable=broad-except
      log.exception("request failed")  # the server survives; the client gets one line
      try:
        await _error(f"internal error: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}",
                     500)(scope, receive, send)
      except RuntimeError:
        pass  # the response had started: nothing more can be sent

  def _refusal(self, scope, headers, host) -> tuple[str, int] | None:
    """(one line, status) when Host, Origin or Sec-Fetch-Site say another page sent it."""
    if host is None:
      return "missing or malformed Host header", 400
    if self.hosts is not None and host[0] not in self.hosts:
      return (f"Host {host[0][:60]!r} is not this explorer's name (prism serve "
              f"--allow_host={host[0][:60]} adds it)", 403)
    origin = headers.get(b"origin")
    if origin is not None:
      m = _ORIGIN.fullmatch(origin.decode("latin-1"))
      scheme = scope.get("scheme", "http")
      if m is None or m.group(1) != scheme or _authority(m.group(2), scheme) != host:
        return f"cross-origin request refused (Origin {origin.decode('latin-1')[:60]!r})", 403
    site = headers.get(b"sec-fetch-site", b"")
    if scope.get("path", "").startswith("/api/") and site in (b"same-site", b"cross-site"):
      return "cross-origin request refused (Sec-Fetch-Site)", 403  # no-cors fetches too
    return None

  def _credential(self, scope, headers, port: int) -> str | None:
    """How the token came ("bearer", "query", "cookie"), None when missing or wrong."""
    got = headers.get(b"authorization", b"")
    if got.startswith(b"Bearer "):
      return "bearer" if hmac.compare_digest(got[7:], self.token) else None
    for part in scope.get("query_string", b"").split(b"&"):
      if part.startswith(b"token="):
        given = urllib.parse.unquote_to_bytes(part[6:].replace(b"+", b" "))
        return "query" if hmac.compare_digest(given, self.token) else None
    name = f"prism_token_{port}".encode()
    for part in headers.get(b"cookie", b"").split(b";"):
      key, _, value = part.strip().partition(b"=")
      if key == name:
        return ("cookie" if hmac.compare_digest(urllib.parse.unquote_to_bytes(value),
                                                self.token) else None)
    return None

  def _cookie_header(self, scope, port: int) -> bytes:
    # named by port: two explorers on one host keep their own; Strict: no other site sends it
    value = urllib.parse.quote_from_bytes(self.token, safe="")
    secure = "; Secure" if scope.get("scheme") == "https" else ""
    return (f"prism_token_{port}={value}; Path=/; HttpOnly; SameSite=Strict{secure}"
            .encode("latin-1"))


def _with_cookie(send, cookie: bytes):
  async def sending(message):
    if message["type"] == "http.response.start":
      message = {**message, "headers": [*message.get("headers", []), (b"set-cookie", cookie)]}
    await send(message)
  return sending


async def _body(request: Request) -> dict:
  raw = bytearray()
  async for chunk in request.stream():  # bounded even without a content-length
    raw += chunk
    if len(raw) > rq.LIMITS["body_bytes"]:
      raise rq.BadRequest(f"request body over {rq.LIMITS['body_bytes']} bytes", 413)
  return rq.parse_body(bytes(raw))


def _handles_bad_requests(fn):
  async def wrapped(request: Request):
    try:
      return await fn(request)
    except rq.BadRequest as e:
      return _error(str(e), e.status)
  return wrapped


def create_app(explorer: Explorer, *, token: str | None = None, host: str = "127.0.0.1",
               allow_hosts=()) -> Starlette:
  """The application over a prepared Explorer (prism_jax/serve/state.py). `host`: the
  address bound; `allow_hosts`: more Host names to answer (server.host_names)."""
  hosts = host_names(host, token, allow_hosts)

  async def page(request: Request):
    html = _asset("index.html").decode()
    return Response(html, media_type="text/html; charset=utf-8",
                    headers={"Content-Security-Policy": "default-src 'self'; style-src 'self' "
                             "'unsafe-inline'; img-src 'self' data:",
                             "Referrer-Policy": "no-referrer"})  # the URL may hold ?token=

  async def static(request: Request):
    name = request.path_params["name"]
    if name not in ASSETS:
      return _error("no such asset", 404)
    return Response(_asset(name), media_type=ASSETS[name])

  async def status(request: Request):
    return JSONResponse(explorer.status())

  async def generate(request: Request):
    job = explorer.generation(await _body(request))
    first = await explorer.run_on_model(job.start)

    async def lines():
      yield json.dumps(first) + "\n"
      done = False
      try:
        while not job.finished:
          if await request.is_disconnected():
            break
          yield json.dumps(await explorer.run_on_model(job.step)) + "\n"
        done = job.finished
        if done:
          yield json.dumps(job.summary()) + "\n"
      finally:
        if not done:  # the client went away: its remaining tokens are never computed
          explorer.dropped += 1
    return StreamingResponse(lines(), media_type="application/x-ndjson")

  async def decompose(request: Request):
    body = await _body(request)
    return JSONResponse(await explorer.run_on_model(explorer.decompose, body))

  async def attribute(request: Request):
    body = await _body(request)
    out, code = await explorer.attribute(body)
    return JSONResponse(out, status_code=code)

  async def prototype(request: Request):
    return JSONResponse(explorer.prototype(request.path_params["pid"]))

  async def search(request: Request):
    return JSONResponse(explorer.search(request.query_params.get("q", "")))

  async def not_found(request: Request, exc):
    return _error(f"no such page: {request.url.path[:100]}", getattr(exc, "status_code", 404))

  routes = [
      Route("/", page), Route("/static/{name}", static),
      Route("/api/status", status),
      Route("/api/generate", _handles_bad_requests(generate), methods=["POST"]),
      Route("/api/decompose", _handles_bad_requests(decompose), methods=["POST"]),
      Route("/api/attribute", _handles_bad_requests(attribute), methods=["POST"]),
      Route("/api/prototype/{pid}", _handles_bad_requests(prototype)),
      Route("/api/search", _handles_bad_requests(search)),
  ]
  app = Starlette(routes=routes, middleware=[Middleware(Guard, token=token, hosts=hosts)],
                  exception_handlers={404: not_found, 405: not_found})
  app.state.explorer = explorer
  app.state.started = time.time()
  return app
