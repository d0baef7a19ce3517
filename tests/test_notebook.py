"""Executes experiments/notebooks/hessian_blocks.ipynb with the running interpreter's kernel."""

import json
import os
import pathlib
import sys

import nbformat
import pytest
from nbclient import NotebookClient

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


def test_hessian_blocks_notebook_runs(kernel_name, tmp_path, monkeypatch):
  out_dir = tmp_path / "figs"
  out_dir.mkdir()
  monkeypatch.setenv("HESSIAN_NB_OUT", str(out_dir))
  nb = nbformat.read(NOTEBOOK, as_version=4)
  client = NotebookClient(nb, kernel_name=kernel_name, timeout=240,
                          resources={"metadata": {"path": str(tmp_path)}})
  client.execute()  # raises CellExecutionError on any failing cell
  outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
  assert not [o for o in outputs if o.output_type == "error"]
  images = [o for o in outputs if "image/png" in o.get("data", {})]
  assert len(images) >= 2, "expected the block-norm heatmap and the spectrum figures"
  text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
  assert "off-block share" in text and "kappa bound" in text
  for name in ("hessian_block_norms.png", "hessian_spectrum.png"):
    assert os.path.getsize(out_dir / name) > 1000, name
