"""`make docs` (mkdocs --strict over mkdocs.yml): the API reference and the tutorials build
with no warning, and the reference carries the documented names."""

import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_docs_build_strict_without_warnings(tmp_path):
  out = tmp_path / "site"
  res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert res.returncode == 0, res.stderr[-3000:]
  assert "WARNING" not in res.stderr, res.stderr[-3000:]
  runs = (out / "api" / "runs" / "index.html").read_text()
  for name in ("load", "Run", "decompose", "hessian_block", "workdir"):
    assert name in runs, name
  assert (out / "tutorials" / "quickstart" / "index.html").stat().st_size > 10_000
