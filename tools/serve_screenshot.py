"""The README's picture of the explorer: `prism serve` on a run, driven in headless Chromium.

  python tools/serve_screenshot.py [runs/demo] [docs/serve_screenshot.png]

Generates from "The for statement" with the sampling defaults, clicks generated
tokens 3-5 in turn and sets each one's top prototype's gain to 0, regenerates (the
side-by-side view) and clicks the first changed token, then saves the page.
"""

import sys

from prism_jax.analysis import browser
from prism_jax.serve import server


def main(workdir: str = "runs/demo", out: str = "docs/serve_screenshot.png") -> None:
  app, _ = server.build(workdir)
  with server.running(app) as url, browser.open_url(url + "/", width=1500, height=980) as view:
    page = view.page
    page.fill("#prompt", "The for statement")
    page.fill("#max_new", "40")
    page.click("#generate")
    page.wait_for_function("document.getElementById('genmsg').textContent.includes('tokens')")
    for i in (2, 3, 4):  # remove the top prototype of three tokens
      page.query_selector_all("#output .tok:not(.prompt)")[i].click()
      page.click("#slices a.p")
      page.wait_for_selector("#proto:not([hidden])")
      page.fill("#gain", "0")
      page.click("#setgain")
    page.click("#regen")
    page.wait_for_selector("#nchanged")
    changed = page.query_selector_all("#steered .tok.changed")
    (changed or page.query_selector_all("#steered .tok:not(.prompt)"))[0].click()
    page.screenshot(path=out)
    if view.errors or view.requests:
      raise SystemExit(f"page errors {view.errors} or outside requests {view.requests}")
  print(out)


if __name__ == "__main__":
  main(*sys.argv[1:])
