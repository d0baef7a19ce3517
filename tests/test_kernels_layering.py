"""The kernel op is self-contained: importing it (and each of its modules) in a fresh
interpreter loads no prism_jax module, so prism_jax may depend on it and never the reverse."""

import subprocess
import sys

import pytest

MODULES = ["pallas_kernels.topk_reconstruct", "pallas_kernels.topk_reconstruct.reference",
           "pallas_kernels.topk_reconstruct.api", "pallas_kernels.topk_reconstruct.vjp",
           "pallas_kernels.topk_reconstruct.sharded", "pallas_kernels.topk_reconstruct.launch",
           "pallas_kernels.topk_reconstruct.options"]


@pytest.mark.parametrize("module", MODULES)
def test_importing_the_op_loads_no_prism_jax_module(module):
  code = (f"import sys, importlib; importlib.import_module({module!r}); "
          "print(sorted(m for m in sys.modules if m.split('.')[0] == 'prism_jax'))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True, env={"JAX_PLATFORMS": "cpu", "PATH": ""}, cwd=_root())
  assert out.stdout.strip() == "[]", out.stdout


def _root() -> str:
  import pathlib  # pylint: disable=import-outside-toplevel
  return str(pathlib.Path(__file__).resolve().parents[1])
