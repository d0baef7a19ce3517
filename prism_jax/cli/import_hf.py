"""Import a Hugging Face directory (GPT-2, Llama, Qwen2, Mistral) as a prism_jax run
(prism import-hf).

  prism import-hf --hf_dir=gpt2/ --workdir=runs/gpt2 [--kind=dense|prism] [--max_len=N]

The run loads like any other (load_for_inference, generate, ...). --kind=prism gives a PRISM
model whose backbone is the checkpoint's and whose bank is not set yet: train it with
`--set train.init_from=runs/gpt2` (retrofit). User errors print one `error: ...` line.
"""

from absl import flags

from prism_jax.cli import launcher

# The library and jax are imported inside the command's function: a bad flag or --help is answered
# before jax loads (~1.5 s).

flags.DEFINE_string("hf_dir", None, "Hugging Face model directory (config.json, "
                    "model.safetensors, tokenizer files)")
flags.DEFINE_string("workdir", None, "new (or empty) run directory to write")
flags.DEFINE_enum("kind", "dense", ["dense", "prism"], "the dense twin, or PRISM with an "
                  "unset bank")
flags.DEFINE_integer("num_prototypes", None, "K of a --kind=prism import (default: "
                     "ModelConfig's)")
flags.DEFINE_integer("k", None, "active prototypes per token of a --kind=prism import")
flags.DEFINE_integer("max_len", None, "a Llama-family model's length (default: its "
                     "max_position_embeddings, at most 4096)")
flags.mark_flags_as_required(["hf_dir", "workdir"])
FLAGS = flags.FLAGS


def run_import(hf_dir: str, workdir: str, kind: str = "dense", num_prototypes=None,
               k=None, max_len=None) -> str:
  """The command's work (also for `prism import-hf`): returns a one-line summary."""
  from prism_jax import hf  # pylint: disable=g-import-not-at-top
  head = {key: v for key, v in (("num_prototypes", num_prototypes), ("k", k),
                                ("max_len", max_len)) if v is not None}
  cfg = hf.import_hf(hf_dir, workdir, kind, **head).model
  return (f"imported {hf_dir} into {workdir}: {cfg.kind} {cfg.arch}, d {cfg.d_model}, "
          f"{cfg.n_layers} "
          f"layers, vocab {cfg.num_token_ids} (rows {cfg.vocab_size}), {cfg.max_len} positions")


def main(argv):
  del argv
  print(run_import(FLAGS.hf_dir, FLAGS.workdir, FLAGS.kind, FLAGS.num_prototypes, FLAGS.k,
                   FLAGS.max_len))


if __name__ == "__main__":
  launcher.run(main)
