"""Executes a notebook in place with its outputs, as committed (experiments/notebooks/*.ipynb).

  .venv/bin/python tools/run_notebook.py experiments/notebooks/quickstart.ipynb

Runs with the `python3` kernel from experiments/notebooks (so runs/demo is found from the
repository root); an HTML output over 200 kB (the report's iframe) is replaced by a note.
"""

import sys

import nbformat
from nbclient import NotebookClient

KEEP_HTML = 200_000  # bytes of one HTML output kept in a committed notebook


def main(path: str) -> None:
  nb = nbformat.read(path, as_version=4)
  NotebookClient(nb, kernel_name="python3", timeout=600,
                 resources={"metadata": {"path": "experiments/notebooks"}}).execute()
  for cell in nb.cells:
    for out in cell.get("outputs", []):
      html = out.get("data", {}).get("text/html", "")
      if len(html) > KEEP_HTML:
        out["data"] = {"text/plain": f"(the report's inline iframe, {len(html) / 1e6:.1f} MB, "
                                     "is not kept in the committed notebook: run the cell to "
                                     "see it)"}
  nbformat.write(nb, path)
  print("ok", path)


if __name__ == "__main__":
  main(sys.argv[1])
