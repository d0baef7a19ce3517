"""Export a run (prism export): --format=hub, a directory ready to upload as a Hugging Face
Hub model repository (prism_jax/hf/hub.py: the backbone in transformers' layout, the bank,
the config, the tokenizer, the cards and a model card), which `prism_jax.load` opens again;
--format=hf, the backbone alone as a transformers directory (as `prism export-hf`).

  prism export --format=hub --workdir=runs/x --out=x_hub [--step=N]

User errors print one `error: ...` line.
"""

from absl import flags

from prism_jax.cli import launcher

# The library and jax are imported inside the command's function: a bad flag or --help is answered
# before jax loads (~1.5 s).

flags.DEFINE_string("workdir", None, "the run to export")
flags.DEFINE_string("out", None, "new (or empty) directory to write")
flags.DEFINE_enum("format", "hub", ["hub", "hf"], "hub: the whole PRISM model in the Hub's "
                  "layout; hf: the backbone as a transformers directory")
flags.DEFINE_integer("step", None, "checkpoint step (default: the newest)")
flags.mark_flags_as_required(["workdir", "out"])
FLAGS = flags.FLAGS


def run_export(workdir: str, out: str, fmt: str = "hub", step=None) -> str:
  """The command's work: returns a one-line summary."""
  from prism_jax import hf  # pylint: disable=g-import-not-at-top
  from prism_jax.hf import hub  # pylint: disable=g-import-not-at-top
  written = hub.export_hub(workdir, out, step) if fmt == "hub" else hf.export_hf(
      workdir, out, step)
  return f"exported {workdir} to {written} ({fmt})"


def main(argv):
  del argv
  print(run_export(FLAGS.workdir, FLAGS.out, FLAGS.format, FLAGS.step))


if __name__ == "__main__":
  launcher.run(main)
