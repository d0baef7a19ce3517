"""The kernel op is self-contained: importing it (every one of its modules) in a fresh
interpreter loads no prism_jax module, so prism_jax may depend on it and never the reverse."""

import pathlib
import subprocess
import sys

MODULES = ["pallas_kernels.topk_reconstruct", "pallas_kernels.topk_reconstruct.reference",
           "pallas_kernels.topk_reconstruct.api", "pallas_kernels.topk_reconstruct.vjp",
           "pallas_kernels.topk_reconstruct.sharded", "pallas_kernels.topk_reconstruct.launch",
           "pallas_kernels.topk_reconstruct.options", "pallas_kernels.topk_reconstruct.cpu",
           "pallas_kernels.topk_reconstruct.topk_major"]


def test_importing_the_op_loads_no_prism_jax_module():
  code = (f"import sys, importlib; [importlib.import_module(m) for m in {MODULES!r}]; "
          "print(sorted(m for m in sys.modules if m.split('.')[0] == 'prism_jax'))")
  root = pathlib.Path(__file__).resolve().parents[1]
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True, env={"JAX_PLATFORMS": "cpu", "PATH": ""}, cwd=root)
  assert out.stdout.strip() == "[]", out.stdout
  # The check can fail: importing the model pulls prism_jax in (the op is a leaf).
  bad = code.replace(f"{MODULES!r}", "['prism_jax.model.prototypes']")
  out = subprocess.run([sys.executable, "-c", bad], capture_output=True, text=True,
                       check=True, env={"JAX_PLATFORMS": "cpu", "PATH": ""}, cwd=root)
  assert "prism_jax.model.prototypes" in out.stdout
