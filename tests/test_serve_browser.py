"""The explorer in a real browser (Debian's chromium-headless-shell via playwright): type a
prompt, generate, click a token (its slices sum to W z of a plain forward pass, computed
here), open its top prototype, set its gain to 0, regenerate: the side-by-side diff, and the
prototype gone from the steered tokens' slices. A screenshot of each view
($PRISM_SCREENSHOTS=<dir> keeps them: docs/images/serve_*.png were made so). Also (issue 57):
a page of another origin on localhost reads nothing and starts no generation; the token
page (a non-loopback bind) loads fully with its cookie."""

import os
import secrets
import shutil

import numpy as np
import pytest

from prism_jax.analysis import browser
from prism_jax.serve import server
from prism_jax.serve.app import create_app

import serve_fixture

pytest.importorskip("starlette")


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
  return serve_fixture.served(tmp_path_factory)


def _w_z(model, ids):
  """float64 W z at every position of ids (position j scores token j + 1)."""
  z = np.asarray(model.backbone(np.asarray(ids)[None])[0][0], np.float64)
  return z @ np.asarray(model.backbone.wte[...], np.float64)[:model.cfg.vocab_size].T


def _shot(view, tmp_path, name):
  path = str(tmp_path / f"serve_{name}.png")
  view.page.screenshot(path=path, full_page=True)
  keep = os.environ.get("PRISM_SCREENSHOTS")
  if keep:
    shutil.copy(path, os.path.join(keep, os.path.basename(path)))
  assert os.path.getsize(path) > 10_000  # a rendered page, not a blank one
  return path


def test_generate_explain_steer_in_the_browser(srv, tmp_path):
  seed = secrets.randbits(16)
  text = serve_fixture.random_text(seed, 3)
  with server.running(srv["app"]) as url, browser.open_url(url + "/") as view:
    page = view.page
    page.wait_for_function("document.getElementById('runinfo').textContent.includes('K 16')")
    page.fill("#prompt", text)
    page.fill("#max_new", "14")
    page.fill("#seed", str(seed % 100))
    page.click("#generate")
    page.wait_for_function("document.getElementById('genmsg').textContent.includes('tokens')")
    ids = page.evaluate("S.gen.ids")
    toks = page.query_selector_all("#output .tok:not(.prompt)")
    assert len(toks) == len(ids) - len(srv["tok"].encode(text)) >= 1
    _shot(view, tmp_path, "generate")

    # A token of white space alone can sit at a line's end under pre-wrap with no width,
    # where no one can click it (nor can playwright: "element is not visible"): the tokens
    # clicked here are ones with a glyph.
    pick = secrets.choice([j for j, t in enumerate(toks) if t.inner_text().strip()])
    toks[pick].click()
    page.wait_for_selector("#why:not([hidden])")
    i = int(toks[pick].get_attribute("data-i"))
    slices = page.eval_on_selector_all("#slices tr.slice", "rs => rs.map(r => +r.dataset.v)")
    want = _w_z(srv["model"], ids[:-1])[i - 1, ids[i]]
    assert abs(sum(slices) - want) < 1e-4, (seed, i, sum(slices), want)
    _shot(view, tmp_path, "why")

    top = int(page.get_attribute("#slices a.p", "data-p"))
    page.click("#slices a.p")
    page.wait_for_selector("#proto:not([hidden])")
    page.wait_for_function(f"document.getElementById('pid').dataset.id == '{top}'")
    assert "fired in this generation" in page.inner_text("#pfired")
    assert page.query_selector_all("#pctx li")  # its top training contexts
    _shot(view, tmp_path, "prototype")

    page.fill("#gain", "0")
    page.click("#setgain")
    assert f"#{top} ×0" in page.inner_text("#gainlist")
    page.click("#regen")
    page.wait_for_selector("#nchanged")
    steered_ids = page.evaluate("S.steeredGen.tokens.flatMap(t => t.slices.map(s => s.id))")
    assert top not in steered_ids
    assert page.evaluate("S.steeredGen.ids.slice(0, %d)" % len(srv["tok"].encode(text))) == \
        srv["tok"].encode(text)
    base, steered = page.evaluate("[S.gen.ids, S.steeredGen.ids]")
    changed = sum(a != b for a, b in zip(base, steered)) + abs(len(base) - len(steered))
    marked = len(page.query_selector_all("#steered .tok.changed"))
    assert int(page.inner_text("#nchanged")) == marked
    assert (marked > 0) == (changed > 0)
    first = next(t for t in page.query_selector_all("#steered .tok:not(.prompt)")
                 if t.inner_text().strip())
    first.click()
    page.wait_for_selector("#why:not([hidden])")
    assert f'data-p="{top}"' not in page.inner_html("#slices")
    _shot(view, tmp_path, "steer")
    assert not view.errors, view.errors
    assert not view.requests, view.requests  # nothing but the explorer's own origin


def _recording(app, seen: list):
  """`app` with each answer's (method, path, status) appended to `seen`."""
  async def wrapped(scope, receive, send):
    async def sending(message):
      if message["type"] == "http.response.start":
        seen.append((scope["method"], scope["path"], message["status"]))
      await send(message)
    await app(scope, receive, sending)
  return wrapped


_ATTACKER = """<!doctype html><title>another origin</title><script>
// What any page the user visits could do against the explorer on another port of localhost.
async function probe(name, url, opts) {
  try {
    const r = await fetch(url, opts);
    return [name, r.status, r.type, await r.text()];
  } catch (e) { return [name, "failed", String(e)]; }
}
const post = (mode) => ({ method: "POST", mode, headers: { "Content-Type": "text/plain" },
  body: JSON.stringify({ prompt: "for the", max_new_tokens: 3 }) });
window.attack = (E) => Promise.all([
  probe("status", E + "/api/status"), probe("prototype", E + "/api/prototype/0"),
  probe("generate", E + "/api/generate", post("cors")),
  probe("generate no-cors", E + "/api/generate", post("no-cors")),
  probe("decompose no-cors", E + "/api/decompose", { ...post("no-cors"),
    body: JSON.stringify({ prompt: "for the" }) }),
  probe("status no-cors", E + "/api/status", { mode: "no-cors" })]);
</script>"""


def test_a_page_of_another_origin_can_neither_read_nor_generate(srv):
  # issue 57: cross-origin text/plain POSTs ran generations; nothing checked Origin
  from starlette.applications import Starlette  # pylint: disable=g-import-not-at-top
  from starlette.responses import HTMLResponse  # pylint: disable=g-import-not-at-top
  from starlette.routing import Route  # pylint: disable=g-import-not-at-top
  attacker = Starlette(routes=[Route("/", lambda request: HTMLResponse(_ATTACKER))])
  seen, jobs = [], srv["explorer"].engine.submitted
  with server.running(_recording(srv["app"], seen)) as url, \
       server.running(attacker) as evil, browser.open_url(evil + "/") as view:
    view.page.route("**/*", lambda r: r.continue_())  # over open_url's: let it reach us
    got = view.page.evaluate("E => attack(E)", url)
  readable = [g for g in got if g[1] not in ("failed", 0)]
  assert not readable, got  # no answer reached the page: failed, or opaque (no-cors)
  assert all(g[3] == "" for g in got if g[1] == 0), got
  assert srv["explorer"].engine.submitted == jobs  # the model never ran
  assert {p for _, p, _ in seen} >= {"/api/status", "/api/prototype/0", "/api/generate",
                                     "/api/decompose"}, seen
  assert all(status == 403 for _, _, status in seen), seen  # refused at the door


def test_the_token_page_loads_fully_in_the_browser(srv):
  # issue 57: on --host=0.0.0.0, /?token=T fetched static/app.js and style.css without the
  # token: 401, a page with no script. The token's cookie now carries them
  token = server.access_token("0.0.0.0", None)
  seen = []
  app = _recording(create_app(srv["explorer"], token=token, host="0.0.0.0"), seen)
  with server.running(app) as url, browser.open_url(f"{url}/?token={token}") as view:
    page = view.page
    page.wait_for_function("document.getElementById('runinfo').textContent.includes('K 16')",
                           timeout=20_000)
    assert token not in page.url  # out of the address bar and history
    cookies = view.page.context.cookies()
    assert [(c["httpOnly"], c["sameSite"]) for c in cookies] == [(True, "Strict")], cookies
    assert page.evaluate("document.cookie") == ""  # HttpOnly: no script reads it
    page.fill("#prompt", "for the")
    page.fill("#max_new", "3")
    page.click("#generate")
    page.wait_for_function("document.getElementById('genmsg').textContent.includes('tokens')")
    page.reload()  # no ?token= now: the cookie alone
    page.wait_for_function("document.getElementById('runinfo').textContent.includes('K 16')",
                           timeout=20_000)
    assert not view.errors, view.errors
    assert not view.requests, view.requests
  assert {p for _, p, _ in seen} >= {"/", "/static/app.js", "/static/style.css",
                                     "/api/status", "/api/generate"}, seen
  assert all(status == 200 for _, _, status in seen), seen
