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
With `token` set (any bind that is not loopback), every request must carry it
(`Authorization: Bearer <token>` or `?token=`).
"""

from __future__ import annotations

import hmac
import importlib.resources
import json
import logging
import time

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from prism_jax.serve import requests as rq
from prism_jax.serve.state import Explorer

ASSETS = {"app.js": "text/javascript", "style.css": "text/css"}
log = logging.getLogger("prism_jax.serve")


def _asset(name: str) -> bytes:
  return importlib.resources.files("prism_jax.serve").joinpath("static", name).read_bytes()


def _error(message: str, status: int) -> JSONResponse:
  return JSONResponse({"error": message}, status_code=status)


class Guard:
  """Pure ASGI middleware: the access token, the body-size bound, one-line errors."""

  def __init__(self, app, token: str | None):
    self.app, self.token = app, token

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    if self.token is not None and not self._authorised(scope):
      return await _error("missing or wrong access token", 401)(scope, receive, send)
    length = dict(scope.get("headers") or []).get(b"content-length")
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

  def _authorised(self, scope) -> bool:
    headers = dict(scope.get("headers") or [])
    got = headers.get(b"authorization", b"").decode("latin-1")
    if got.startswith("Bearer "):
      return hmac.compare_digest(got[7:], self.token)
    query = scope.get("query_string", b"").decode("latin-1")
    for part in query.split("&"):
      if part.startswith("token="):
        return hmac.compare_digest(part[6:], self.token)
    return False


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


def create_app(explorer: Explorer, *, token: str | None = None) -> Starlette:
  """The application over a prepared Explorer (prism_jax/serve/state.py)."""

  async def page(request: Request):
    html = _asset("index.html").decode()
    return Response(html, media_type="text/html; charset=utf-8",
                    headers={"Content-Security-Policy": "default-src 'self'; style-src 'self' "
                             "'unsafe-inline'; img-src 'self' data:"})

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
  app = Starlette(routes=routes, middleware=[Middleware(Guard, token=token)],
                  exception_handlers={404: not_found, 405: not_found})
  app.state.explorer = explorer
  app.state.started = time.time()
  return app
