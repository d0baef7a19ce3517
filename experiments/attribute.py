"""Generate from a trained PRISM run and trace every generated token to training text.

  python -m experiments.attribute --workdir=DIR --prompt="The with statement" \
      [--max_new_tokens=16] [--top=3] [--rank=64] [--cache_dir=DIR/attribution_cache]

The first call builds the attribution cache (resumable: rerun after an interruption); later
calls reuse it, and refuse it if the checkpoint or config changed.
"""

import os
import sys

from absl import flags

from experiments import cli

flags.DEFINE_string("workdir", None, "trained run directory (see experiments.train)")
flags.DEFINE_string("prompt", None, "prompt text")
flags.DEFINE_integer("max_new_tokens", 16, "tokens to generate")
flags.DEFINE_float("temperature", 0.0, "0 = greedy")
flags.DEFINE_integer("top", 3, "training snippets per generated token")
flags.DEFINE_integer("rank", None, "eigenvectors of G kept in the cache (default: d_model)")
flags.DEFINE_string("cache_dir", None, "default: <workdir>/attribution_cache")
flags.DEFINE_enum("coupling", "block_diagonal", ["block_diagonal", "co_usage"],
                  "preconditioner of the prototype blocks")
flags.DEFINE_bool("rebuild", False, "rebuild the cache even if one exists (a cache of another "
                  "checkpoint/config is refused otherwise)")
flags.mark_flags_as_required(["workdir", "prompt"])
FLAGS = flags.FLAGS


def main(argv):
  del argv
  from prism_jax import io_guard  # pylint: disable=g-import-not-at-top
  from prism_jax.attribution import cache as cache_lib  # pylint: disable=g-import-not-at-top
  from prism_jax.attribution import influence  # pylint: disable=g-import-not-at-top
  from prism_jax.data import prepare_data  # pylint: disable=g-import-not-at-top
  from prism_jax.train import load_for_inference  # pylint: disable=g-import-not-at-top

  model, cfg, tokenizer = load_for_inference(FLAGS.workdir)
  if cfg.model.kind != "prism":
    sys.exit("error: attribution needs a PRISM run (model.kind='prism')")
  packed = prepare_data(cfg.data, cfg.model.vocab_size, FLAGS.workdir)
  cache_dir = FLAGS.cache_dir or os.path.join(FLAGS.workdir, "attribution_cache")
  try:
    cache = cache_lib.build_cache(model, cfg, packed, cache_dir,
                                  cache_lib.CacheConfig(rank=FLAGS.rank),
                                  overwrite=FLAGS.rebuild)
  except cache_lib.CacheMismatchError as e:
    sys.exit(f"error: {e}\n(rerun with --rebuild to replace it)")
  except io_guard.OutputDirError as e:
    sys.exit(f"error: {e}")
  prompt = tokenizer.encode(FLAGS.prompt)
  if not prompt:
    sys.exit("error: the prompt encodes to no tokens")
  icfg = influence.InfluenceConfig(coupling=FLAGS.coupling, top=FLAGS.top)
  print(f"prompt: {FLAGS.prompt!r}")
  for tok, att in influence.attribute_generation(
      model, cache, prompt, max_new_tokens=FLAGS.max_new_tokens, cfg=icfg, packed=packed,
      temperature=FLAGS.temperature, eos_id=tokenizer.eos_id):
    print(f"\n>> {tokenizer.decode([tok])!r}  (prototypes {att.query_protos.tolist()})")
    for rank, (e, s, snip) in enumerate(zip(att.example_ids, att.scores, att.snippets)):
      protos = ", ".join(f"{i}:{v:+.3g}" for i, v in list(att.breakdown[rank].items())[:3])
      print(f"   {rank + 1}. score {s:+.4g}  [{protos}]  {snip!r}")


if __name__ == "__main__":
  cli.run(main)
