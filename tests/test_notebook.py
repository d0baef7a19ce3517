"""Executes experiments/notebooks/hessian_blocks.ipynb with the running interpreter's kernel,
its trained-run part on the tests' shared tiny run (tests/tiny_run.py: trained once)."""

import json
import os
import pathlib
import re
import shutil
import sys

import nbformat
import pytest
from nbclient import NotebookClient

import tiny_run

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "experiments" / "notebooks" / "hessian_blocks.ipynb"
KERNEL = "prism-jax-test"


@pytest.fixture
def kernel_name(tmp_path, monkeypatch):
  """A kernelspec whose argv is this interpreter (the venv's python), found via JUPYTER_PATH,
  so the notebook never runs under some other 'python3' on the machine."""
  spec_dir = tmp_path / "jupyter" / "kernels" / KERNEL
  spec_dir.mkdir(parents=True)
  spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
          "display_name": "prism_jax test kernel", "language": "python"}
  (spec_dir / "kernel.json").write_text(json.dumps(spec))
  monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  return KERNEL


@pytest.mark.long  # make test-long (issue 56 item 7): runs a notebook in a kernel end to end
def test_hessian_blocks_notebook_runs(kernel_name, tmp_path, tmp_path_factory, monkeypatch):
  out_dir = tmp_path / "figs"
  out_dir.mkdir()
  monkeypatch.setenv("HESSIAN_NB_OUT", str(out_dir))
  monkeypatch.setenv("HESSIAN_NB_RUN", tiny_run.tiny_run(tmp_path_factory)["run"])
  nb = nbformat.read(NOTEBOOK, as_version=4)
  client = NotebookClient(nb, kernel_name=kernel_name, timeout=240,
                          resources={"metadata": {"path": str(tmp_path)}})
  client.execute()  # raises CellExecutionError on any failing cell
  outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
  assert not [o for o in outputs if o.output_type == "error"]
  images = [o for o in outputs if "image/png" in o.get("data", {})]
  assert len(images) >= 3, "expected the block-norm heatmap, the spectrum and the blocks"
  text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
  assert "off-block share" in text and "kappa bound" in text
  assert "exact blocks:" in text and text.count("rel. difference") == 2
  for name in ("hessian_block_norms.png", "hessian_spectrum.png",
               "hessian_block_exact_vs_kfac.png"):
    assert os.path.getsize(out_dir / name) > 1000, name


QUICKSTART = REPO / "experiments" / "notebooks" / "quickstart.ipynb"


def _own_copy(tmp_path_factory, tmp_path) -> str:
  """A copy of the shared tiny run without its cache and cards: the notebooks build both
  inside the run, which must not leak into the other tests sharing it."""
  return shutil.copytree(tiny_run.tiny_run(tmp_path_factory)["run"], str(tmp_path / "run"),
                         ignore=shutil.ignore_patterns("attribution_cache", "cards"))


@pytest.mark.long  # make test-long (issue 56 item 7): runs a notebook in a kernel end to end
def test_quickstart_notebook_runs_and_displays_each_result_inline(kernel_name, tmp_path,
                                                                  tmp_path_factory, monkeypatch):
  """load, decompose, attribute, suppress, report: each cell runs and the results display
  as HTML (the report as a self-contained iframe)."""
  monkeypatch.setenv("PRISM_NB_RUN", _own_copy(tmp_path_factory, tmp_path))
  nb = nbformat.read(QUICKSTART, as_version=4)
  client = NotebookClient(nb, kernel_name=kernel_name, timeout=240,
                          resources={"metadata": {"path": str(tmp_path)}})
  client.execute()
  code = [c for c in nb.cells if c.cell_type == "code"]
  outputs = [o for c in code for o in c.get("outputs", [])]
  assert not [o for o in outputs if o.output_type == "error"]
  html = [o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {})]
  assert any("<table>" in h and "residual" in h for h in html)  # the decomposition
  assert any("score" in h and "snippet" in h for h in html)  # the attribution
  assert any(h.startswith("<iframe srcdoc=") for h in html)  # the report
  text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
  assert "suppressed prototypes:" in text and "the residual decided" in text
  assert "MB of self-contained HTML" in text


@pytest.mark.long  # make test-long (issue 56 item 7): runs a notebook in a kernel end to end
def test_attribution_and_steering_notebook_runs(kernel_name, tmp_path, tmp_path_factory,
                                                monkeypatch):
  """attribute a trusted token, read its prototype's card, find the prototypes carrying a
  token and suppress / amplify them over the same seeds."""
  monkeypatch.setenv("PRISM_NB_RUN", _own_copy(tmp_path_factory, tmp_path))
  nb = nbformat.read(REPO / "experiments" / "notebooks" / "attribution_and_steering.ipynb",
                     as_version=4)
  NotebookClient(nb, kernel_name=kernel_name, timeout=300,
                 resources={"metadata": {"path": str(tmp_path)}}).execute()
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
  assert not [o for o in outputs if o.output_type == "error"]
  text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
  assert "top prototypes" in text and "promotes:" in text and "search 'for':" in text
  rates = {name: float(v) for name, v in
           re.findall(r"(unedited|suppressed|amplified x4): rate\s+([\d.]+)%", text)}
  assert set(rates) == {"unedited", "suppressed", "amplified x4"}
  assert all(0 <= r <= 100 for r in rates.values()) and rates["unedited"] > 0  # it was written
  assert "the prototypes that carried it:" in text


HEAD_ON_YOUR_MODEL = REPO / "experiments" / "notebooks" / "head_on_your_model.ipynb"


@pytest.mark.long  # trains the notebook's model and builds its cache and cards: ~70 s
def test_head_on_your_model_notebook_runs(kernel_name, tmp_path, monkeypatch):
  """A user's own NNX backbone (a causal convolutional LM, registered by the notebook)
  trained as PRISM by the library, loaded, decomposed exactly, attributed, with cards."""
  monkeypatch.setenv("HEAD_NB_RUN", str(tmp_path / "run"))
  nb = nbformat.read(HEAD_ON_YOUR_MODEL, as_version=4)
  client = NotebookClient(nb, kernel_name=kernel_name, timeout=400,
                          resources={"metadata": {"path": str(tmp_path)}})
  client.execute()
  text = "".join(o.get("text", "") for cell in nb.cells if cell.cell_type == "code"
                 for o in cell.get("outputs", []) if o.output_type == "stream")
  assert "CausalConvLM under PrismLM" in text
  worst = float(re.search(r"largest \|logit - \(sum of slices \+ residual\)\|: (\S+)",
                          text).group(1))
  assert worst < 1e-4
  assert re.search(r"1\. score \+\d+", text) and "prototype #" in text
  agreement = float(re.search(r"agreement argmax W z_hat = argmax W z: ([\d.]+)%", text)
                    .group(1))
  assert 0 < agreement <= 100
