"""Export a run as a Hugging Face directory (prism export-hf): GPT2LMHeadModel for
model.arch=gpt2, LlamaForCausalLM (Qwen2ForCausalLM with q/k/v biases) for arch=llama.

  prism export-hf --workdir=runs/x --out=x_hf [--step=N]

`transformers.AutoModelForCausalLM.from_pretrained(out)` loads it: the dense twin, or a PRISM
run's backbone (its README says the prototype head is not part of the architecture). User
errors print one `error: ...` line.
"""

from absl import flags

from prism_jax.cli import launcher

# The library and jax are imported inside the command's function: a bad flag or --help is answered
# before jax loads (~1.5 s).

flags.DEFINE_string("workdir", None, "the run to export")
flags.DEFINE_string("out", None, "new (or empty) directory to write")
flags.DEFINE_integer("step", None, "checkpoint step (default: the newest)")
flags.mark_flags_as_required(["workdir", "out"])
FLAGS = flags.FLAGS


def run_export(workdir: str, out: str, step=None) -> str:
  """The command's work (also for `prism export-hf`): returns a one-line summary."""
  from prism_jax import hf  # pylint: disable=g-import-not-at-top
  return f"exported {workdir} to {hf.export_hf(workdir, out, step)}"


def main(argv):
  del argv
  print(run_export(FLAGS.workdir, FLAGS.out, FLAGS.step))


if __name__ == "__main__":
  launcher.run(main)
