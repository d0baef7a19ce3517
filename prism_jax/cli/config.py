"""Print the resolved config of a preset or a config file with overrides, as JSON.

  prism config --config=small --set train.steps=200
  prism config --config=runs/x/config.json --set train.lr=1e-3 > pod.json

What `prism train` with the same --config and --set would train (--data / --model as
there). An unknown key or a bad value is one `error:` line naming it.
"""

from absl import flags

from prism_jax.cli import launcher

# The library and jax are imported inside main(): a bad flag or --help is answered before jax loads
# (~0.9 s).

flags.DEFINE_string("config", "tiny", "a preset name or a config file (.json, .yaml, .yml)")
flags.DEFINE_string("data", None, "comma-separated data files or globs (data.sources)")
flags.DEFINE_enum("model", None, ["prism", "dense"], "shorthand for --set model.kind=...")
flags.DEFINE_multi_string("set", [], "dotted config override KEY=VALUE (repeatable)")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  from prism_jax.config import build_config, to_json  # pylint: disable=g-import-not-at-top
  print(to_json(build_config(FLAGS.config, FLAGS.data, FLAGS.model, FLAGS.set)))


if __name__ == "__main__":
  launcher.run(main)
