"""Writes docs/RESULTS.md's generated parts from the recorded results in docs/results/*.json
(what is written, and the results JSON schema: results_md/document.py).

  python -m experiments.reproduce [--results_dir=docs/results] [--results_md=docs/RESULTS.md]
"""

import os

from absl import flags

from prism_jax.cli import launcher
from results_md import document

flags.DEFINE_string("results_dir", "docs/results", "directory of results JSON files")
flags.DEFINE_string("results_md", "docs/RESULTS.md", "the markdown file to write into")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  if not os.path.isfile(FLAGS.results_md):
    raise FileNotFoundError(f"--results_md={FLAGS.results_md} does not exist")
  with open(FLAGS.results_md) as f:
    md = f.read()
  out = document.regenerate(md, FLAGS.results_dir)
  with open(FLAGS.results_md, "w") as f:
    f.write(out)
  print(f"wrote {FLAGS.results_md}: {len(out.splitlines())} lines")


if __name__ == "__main__":
  launcher.run(main)
