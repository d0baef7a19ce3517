"""Starting the explorer: load the run, warm its programs, serve on uvicorn.

Loopback (127.0.0.1, ::1, localhost) is the default and needs no token. Any other host is
served only with an access token (given, or generated and printed), checked on every request,
after a warning: the explorer runs the model for whoever can reach it.

Whatever the bind, the explorer answers only requests whose `Host` is a name of the address
it bound (`host_names`: on loopback localhost, 127.0.0.1, ::1; on a wildcard with a token, any
name unless --allow_host lists some) and whose `Origin`, when sent, is its own: a web page
elsewhere (DNS rebinding, another port of localhost) can neither read the run nor generate.
"""

from __future__ import annotations

import contextlib
import ipaddress
import secrets
import sys
import threading
import time
import urllib.parse

LOOPBACK_NAMES = ("localhost",)
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})  # a loopback bind's Host names
WILDCARDS = ("0.0.0.0", "::", "")


def is_loopback(host: str) -> bool:
  if host in LOOPBACK_NAMES:
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False


def access_token(host: str, token: str | None) -> str | None:
  """None on loopback unless one is given; elsewhere the given token or a fresh one."""
  if is_loopback(host):
    return token or None
  if token is not None and len(token) < 16:
    raise ValueError("--token must be at least 16 characters")
  return token or secrets.token_urlsafe(24)


def allowed_name(name: str) -> str:
  """A --allow_host entry as a Host header's hostname: lowercased, IPv6 without brackets."""
  n = name.strip().lower()
  bare = n[1:-1] if n.startswith("[") and n.endswith("]") else n
  ipv6 = ":" in bare and all(c in "0123456789abcdef:." for c in bare)
  if not bare or any(c in bare for c in "/@[]* \t") or (":" in bare and not ipv6):
    raise ValueError(f"--allow_host: {name[:60]!r} is not a host name (give names without "
                     "scheme, port or path)")
  return bare


def host_names(bind: str, token: str | None, allow=()) -> frozenset[str] | None:
  """The Host names the explorer answers to, None for any: loopback names always (a page
  served from another name never sends them), the bound address, the `allow` names; a
  wildcard bind with a token takes any name unless `allow` gives some."""
  names = frozenset(allowed_name(a) for a in allow)
  bind = bind.strip("[]").lower()
  if bind in WILDCARDS and token is not None and not names:
    return None  # reachable under any name of the machine; the token guards it
  return names | LOOPBACK_HOSTS | ({bind} if bind not in WILDCARDS else set())


def warm(explorer) -> float:
  """Compiles every length bucket's programs once (seconds spent); requests never compile."""
  t0 = time.perf_counter()
  eng = explorer.engine
  g = eng.gains({})
  for b in eng.buckets:
    ids = [1] * b  # fills bucket b exactly
    eng.next_token(ids, 0, temperature=1.0, top_k=1, seed=0, greedy=False, gains_K=g)
    eng.explain(ids, g)
  return time.perf_counter() - t0


def build(workdir: str, *, build_cache: bool = True, build_cards: bool = True,
          token: str | None = None, step: int | None = None, do_warm: bool = True,
          host: str = "127.0.0.1", allow_hosts=()):
  """(app, explorer): the loaded run behind a ready ASGI application bound to `host`."""
  from prism_jax.runs import load  # pylint: disable=g-import-not-at-top  (deferred: jax)
  from prism_jax.serve.app import create_app  # pylint: disable=g-import-not-at-top  (cycle: serve.app imports this module)
  from prism_jax.serve.state import Explorer  # pylint: disable=g-import-not-at-top  (deferred: jax)
  explorer = Explorer(load(workdir, step=step), build_cache=build_cache,
                      build_cards=build_cards)
  if do_warm:
    warm(explorer)
  return create_app(explorer, token=token, host=host, allow_hosts=allow_hosts), explorer


def serve(workdir: str, *, host: str = "127.0.0.1", port: int = 8000, token: str | None = None,
          build_cache: bool = True, build_cards: bool = True, step: int | None = None,
          allow_hosts=()) -> None:
  import uvicorn  # pylint: disable=g-import-not-at-top  (deferred: optional, the serve extra)
  token = access_token(host, token)
  host_names(host, token, allow_hosts)  # a bad --allow_host fails before the run loads
  if not is_loopback(host):
    print(f"warning: serving on {host}, reachable from other machines; every request must "
          f"carry the access token (Authorization: Bearer … or ?token=…)", file=sys.stderr)
  print(f"loading {workdir} (cards and programs are prepared before serving)…",
        file=sys.stderr)
  app, explorer = build(workdir, build_cache=build_cache, build_cards=build_cards,
                        token=token, step=step, host=host, allow_hosts=allow_hosts)
  shown = f"[{host}]" if ":" in host else host
  query = f"/?token={urllib.parse.quote(token, safe='')}" if token else "/"
  print(f"PRISM explorer: http://{shown}:{port}{query}  ({explorer.engine.compiles()} programs "
        f"compiled for buckets {list(explorer.engine.buckets)}; Ctrl-C stops)", file=sys.stderr)
  uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=2)


@contextlib.contextmanager
def running(app, host: str = "127.0.0.1", port: int = 0):
  """Serves `app` on uvicorn in a background thread (port 0: a free one); yields its URL.
  For notebooks and tests: `with running(app) as url: ...`; stopped on exit."""
  import uvicorn  # pylint: disable=g-import-not-at-top  (deferred: optional, the serve extra)
  srv = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                      timeout_graceful_shutdown=1))
  thread = threading.Thread(target=srv.run, daemon=True, name="prism-serve")
  thread.start()
  deadline = time.monotonic() + 30
  while not srv.started:
    if not thread.is_alive() or time.monotonic() > deadline:
      raise RuntimeError(f"the explorer did not start on {host}:{port}")
    time.sleep(0.02)
  bound = srv.servers[0].sockets[0].getsockname()[1]
  try:
    yield f"http://{host}:{bound}"
  finally:
    srv.should_exit = True
    thread.join(10)
