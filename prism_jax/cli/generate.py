"""Sample from a trained run and show, for PRISM, each token's top prototypes.

  prism generate --workdir=runs/tiny --prompt="The for statement" \
      [--max_new_tokens=48 --temperature=0.8 --top_k=40 --top_p=1.0 --seed=0 | --greedy] \
      [--suppress=12,40]   # zero these prototypes' share of the logits (PRISM.md §6)

Samples with the library's defaults (prism_jax.generate.SAMPLING); --greedy (or
temperature 0) decodes greedily. Generation stops at the tokenizer's EOS.
"""

from absl import flags, logging

from prism_jax.cli import launcher
from prism_jax.cli import sampling_flags

# The rest of the library (orbax, tensorstore) is imported inside main(): a bad flag or --help is
# answered before it loads (~0.3 s).

flags.DEFINE_string("workdir", None, "trained run directory (prism train)")
flags.DEFINE_string("prompt", "The ", "text to continue")
flags.DEFINE_integer("max_new_tokens", 48, "tokens to generate (prompt + this <= max_len)")
flags.DEFINE_float("top_p", 1.0, "nucleus sampling mass; 1 = off")
flags.DEFINE_integer("top_protos", 3, "prototypes listed per generated token")
flags.DEFINE_list("suppress", [], "prototype ids whose contributions are removed")
flags.DEFINE_integer("step", None, "checkpoint step (default: the newest)")
flags.mark_flag_as_required("workdir")
FLAGS = flags.FLAGS
sampling_flags.define()


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # keep checkpoint-restore chatter out of the sample
  from prism_jax.analysis.token_report import token_report  # pylint: disable=g-import-not-at-top
  from prism_jax.generate import generate  # pylint: disable=g-import-not-at-top
  from prism_jax.control import steering  # pylint: disable=g-import-not-at-top
  from prism_jax.loading import load_for_inference  # pylint: disable=g-import-not-at-top
  model, cfg, tokenizer = load_for_inference(FLAGS.workdir, step=FLAGS.step)
  prompt_ids = tokenizer.encode(FLAGS.prompt)
  if not prompt_ids:
    raise ValueError("the prompt encodes to no tokens; pass a non-empty --prompt")
  gains = None
  if FLAGS.suppress:
    if cfg.model.kind != "prism":
      raise ValueError("--suppress needs a PRISM model (this run is dense)")
    num = cfg.model.num_prototypes
    gains = steering.suppression_gains(num, [steering.proto_id(i, num) for i in FLAGS.suppress])
  out = generate(model, [prompt_ids], max_new_tokens=FLAGS.max_new_tokens,
                 top_p=FLAGS.top_p, eos_id=tokenizer.eos_id, **sampling_flags.kwargs(),
                 proto_gain_K=gains)
  n = int(out.lengths_B[0])
  print(f"prompt: {FLAGS.prompt!r}")
  print(f"sample ({sampling_flags.label()}): "
        f"{FLAGS.prompt + tokenizer.decode(out.tokens_BxL[0, :n].tolist())!r}\n")
  print(token_report(out, tokenizer.decode, top=FLAGS.top_protos))


if __name__ == "__main__":
  launcher.run(main)
