"""Headless Chromium on a report file: Debian's chromium-headless-shell driven by playwright.

    with open_page("runs/x/report/index.html") as view:
      view.page.click("span.tok"); view.page.screenshot(path="shot.png")
    assert not view.errors and not view.requests

No browser download: playwright (the `test` extra) launches the system binary by
`executable_path` (apt package chromium-headless-shell; the Makefile installs it). Every
request is routed: file:// ones continue, any other is aborted and recorded in
`view.requests`; console errors and page errors are recorded in `view.errors`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil

INSTALL_HINT = ("install it with `apt-get update && apt-get install -y "
                "chromium-headless-shell` (make test does), or set PRISM_CHROMIUM to a "
                "Chromium binary")
CANDIDATES = ("/usr/bin/chromium-headless-shell", "/usr/lib/chromium/chromium-headless-shell",
              "/usr/bin/chromium")


def chromium_path() -> str:
  """The Chromium binary: $PRISM_CHROMIUM, else Debian's headless shell; a clear error."""
  env = os.environ.get("PRISM_CHROMIUM")
  if env:
    if not os.access(env, os.X_OK):
      raise FileNotFoundError(f"PRISM_CHROMIUM={env} is not an executable file")
    return env
  for path in CANDIDATES + tuple(filter(None, [shutil.which("chromium-headless-shell")])):
    if os.access(path, os.X_OK):
      return path
  raise FileNotFoundError(f"no headless Chromium found ({', '.join(CANDIDATES)}): "
                          + INSTALL_HINT)


@dataclasses.dataclass
class PageView:
  page: object  # playwright.sync_api.Page
  errors: list  # console errors and uncaught page errors
  requests: list  # non-file URLs the page tried to fetch (all aborted)


@contextlib.contextmanager
def open_page(html_path: str, *, width: int = 1400, height: int = 1000):
  """Opens html_path from disk in headless Chromium; yields a PageView."""
  if not os.path.isfile(html_path):
    raise FileNotFoundError(f"no report at {html_path}")
  with _browse("file://" + os.path.abspath(html_path), "file://", width, height) as view:
    yield view


@contextlib.contextmanager
def open_url(url: str, *, width: int = 1400, height: int = 1000):
  """Opens a page served at `url` (e.g. `prism serve`); requests to other origins are
  aborted and recorded in view.requests. The page's Content-Security-Policy is bypassed
  (playwright evaluates its waits as strings, which a strict policy forbids)."""
  origin = "/".join(url.split("/")[:3]) + "/"
  with _browse(url, origin, width, height, bypass_csp=True) as view:
    yield view


@contextlib.contextmanager
def _browse(url: str, allowed_prefix: str, width: int, height: int, bypass_csp: bool = False):
  try:
    from playwright.sync_api import sync_playwright  # pylint: disable=import-outside-toplevel  (deferred: playwright, optional, for screenshots only)
  except ImportError:
    raise ImportError("the browser needs playwright: pip install -e '.[test]'") from None
  exe = chromium_path()
  with sync_playwright() as pw:
    browser = pw.chromium.launch(executable_path=exe, args=["--no-sandbox"])
    try:
      ctx = browser.new_context(viewport={"width": width, "height": height},
                                bypass_csp=bypass_csp)
      page = ctx.new_page()
      view = PageView(page, [], [])

      def route(r):
        if r.request.url.startswith(allowed_prefix):
          r.continue_()
        else:
          view.requests.append(r.request.url)
          r.abort()

      ctx.route("**/*", route)
      page.on("console", lambda m: view.errors.append(m.text) if m.type == "error" else None)
      page.on("pageerror", lambda e: view.errors.append(str(e)))
      page.goto(url, wait_until="load")
      yield view
    finally:
      browser.close()
