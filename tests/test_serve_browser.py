"""The explorer in a real browser (Debian's chromium-headless-shell via playwright): type a
prompt, generate, click a token (its slices sum to W z of a plain forward pass, computed
here), open its top prototype, set its gain to 0, regenerate: the side-by-side diff, and the
prototype gone from the steered tokens' slices. A screenshot of each view
($PRISM_SCREENSHOTS=<dir> keeps them: docs/images/serve_*.png were made so)."""

import os
import secrets
import shutil

import numpy as np
import pytest

from prism_jax.analysis import browser
from prism_jax.serve import server

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

    pick = secrets.randbelow(len(toks))
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
    first = page.query_selector("#steered .tok:not(.prompt)")
    first.click()
    page.wait_for_selector("#why:not([hidden])")
    assert f'data-p="{top}"' not in page.inner_html("#slices")
    _shot(view, tmp_path, "steer")
    assert not view.errors, view.errors
    assert not view.requests, view.requests  # nothing but the explorer's own origin
