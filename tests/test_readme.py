"""The README's Python snippets, then the user guide's (apidocs/guide.md, `make docs`), run
in order in one namespace (later snippets use what earlier ones built), on a tiny trained run standing in for the README's `runs/x`. A snippet
whose first line is `# not run: <reason>` is skipped (the Hugging Face one: it needs a GPT-2 directory)."""

import os
import re
import shutil

import pytest

import tiny_run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_blocks(text: str) -> list[str]:
  return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


@pytest.mark.long  # make test-long (issue 56 item 7): trains and attributes as the README does
def test_readme_python_snippets_run(tmp_path_factory, monkeypatch, capsys):
  blocks = []
  for doc in ("README.md", os.path.join("apidocs", "guide.md")):
    with open(os.path.join(REPO, doc), encoding="utf-8") as f:
      found = python_blocks(f.read())
    assert found, f"{doc} lost its Python snippets"
    blocks += found
  assert len(blocks) >= 3
  # a copy: the snippets write a cache and cards into the run, which other tests share
  here = tmp_path_factory.mktemp("readme")
  run = shutil.copytree(tiny_run.tiny_run(tmp_path_factory)["run"], str(here / "run"),
                        ignore=shutil.ignore_patterns("attribution_cache", "cards"))
  monkeypatch.chdir(here)  # anything relative lands here
  namespace = {"__name__": "readme"}
  ran, skipped = 0, 0
  for i, block in enumerate(blocks):
    if block.startswith("# not run:"):
      skipped += 1
      continue
    code = compile(block.replace('"runs/x', f'"{run}'), f"README/guide python block {i}",
                   "exec")
    exec(code, namespace)  # pylint: disable=exec-used
    ran += 1
  assert ran == len(blocks) - skipped and skipped <= 1  # only the Hugging Face one
  # what the snippets claim: the logit splits exactly, attribution and cards ran
  parts = namespace["parts"]
  import numpy as np  # pylint: disable=g-import-not-at-top
  np.testing.assert_allclose(np.asarray(parts.contrib_Nxk.sum(-1) + parts.residual_N),
                             np.asarray(parts.logit_N), rtol=1e-4, atol=1e-4)
  assert os.path.isfile(os.path.join(run, "cards", "cards.json"))
  assert capsys.readouterr().out.count("\n") >= 3  # the attribution and cards prints
