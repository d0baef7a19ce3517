"""Writes the planted-behaviour corpus (prism_jax/control/planted.py) for training.

  python -m experiments.planted_corpus --out=/tmp/planted
  prism train --config=tiny --workdir=runs/planted \
      --data=/tmp/planted/train.jsonl --set data.val_sources=/tmp/planted/neutral.jsonl
"""

import json

from absl import flags

from prism_jax.cli import flag_checks as check
from prism_jax.cli import launcher

flags.DEFINE_string("out", None, "output directory (train.jsonl, neutral.jsonl, planted.json)")
flags.DEFINE_integer("num_docs", 160, "planted documents")
flags.DEFINE_integer("neutral_docs", 24, "embedded documents held out as neutral text")
flags.DEFINE_integer("seed", 0, "seed of the planted text and the neutral sample")
flags.mark_flag_as_required("out")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  # before anything is written (write_corpus checks --neutral_docs against the corpus)
  check.at_least(1, num_docs=FLAGS.num_docs)
  from prism_jax.control import planted  # pylint: disable=g-import-not-at-top
  info = planted.write_corpus(FLAGS.out, num_docs=FLAGS.num_docs,
                              neutral_docs=FLAGS.neutral_docs, seed=FLAGS.seed)
  print(json.dumps({k: v for k, v in info.items() if k != "templates"}, indent=2))


if __name__ == "__main__":
  launcher.run(main)
