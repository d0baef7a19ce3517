"""The checks of tools/check_install.sh, run by the fresh venv's Python from outside the
repository (so the installed package is what is imported): argv = [scratch dir, mode]."""

import os
import subprocess
import sys

TINY = ["--set=model.d_model=16", "--set=model.n_layers=1", "--set=model.n_heads=2",
        "--set=model.num_prototypes=16", "--set=model.k=2", "--set=model.vocab_size=258",
        "--set=data.tokenizer=byte", "--set=data.seq_len=16", "--set=model.max_len=16",
        "--set=train.batch_size=2", "--set=train.steps=2", "--set=train.proto_init_step=1",
        "--set=train.eval_every=2", "--set=train.ckpt_every=2", "--set=train.eval_batches=1"]


def prism(*args):
  exe = os.path.join(os.path.dirname(sys.executable), "prism")
  return subprocess.run([exe, *args], capture_output=True, text=True, timeout=1200)


def main(scratch: str, mode: str) -> None:
  import prism_jax  # pylint: disable=g-import-not-at-top
  assert os.path.realpath(prism_jax.__file__).startswith(os.path.realpath(sys.prefix)), (
      f"imported {prism_jax.__file__}, not the installed package")
  r = prism("--help")
  assert r.returncode == 0 and "serve" in r.stdout, r.stderr[-2000:]
  print(f"[{mode}] prism --help: ok")

  from prism_jax.data.tokenizers import make_tokenizer  # pylint: disable=g-import-not-at-top
  ids = make_tokenizer("gpt2", 50257).encode("Hello world")
  assert ids == [15496, 995], ids
  print(f"[{mode}] gpt2 BPE 'Hello world' -> {ids}: ok")

  r = prism("generate", "--workdir=gs://prism-install-check/run")
  errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
  assert r.returncode == 2 and len(errors) == 1 and "gcs extra" in errors[0], r.stderr[-2000:]
  print(f"[{mode}] gs:// without the gcs extra: {errors[0]}")

  workdir = os.path.join(scratch, "demo")
  r = prism("demo", f"--workdir={workdir}", "--max_new_tokens=4", "--prompt=The", *TINY)
  assert r.returncode == 0, r.stderr[-3000:]
  print(f"[{mode}] prism demo (tiny overrides): ok")

  dec = prism_jax.load(workdir).decompose("The for")
  assert len(dec.tokens) == len("The for") - 1
  total = sum(c for _, _, c in dec.tokens[0].prototypes) + dec.tokens[0].residual
  assert abs(total - dec.tokens[0].logit) < 1e-4
  print(f"[{mode}] prism_jax.load(...).decompose(...): ok ({len(dec.tokens)} tokens)")
  import jax, numpy  # pylint: disable=g-import-not-at-top,multiple-imports
  print(f"[{mode}] all checks passed with jax {jax.__version__}, numpy {numpy.__version__}")


if __name__ == "__main__":
  main(*sys.argv[1:3])
