"""lm-evaluation-harness on a trained run (prism_jax/evaluation/lm_eval_adapter.py).

  prism lm-eval --workdir=runs/demo [--gains=steering.json] [--nooffline] -- \
      --tasks prism_python_docs_mc --include_path tests/lm_eval_task \
      [--limit 10] [--output_path out/] [--log_samples] [--gen_kwargs max_gen_toks=32]

Registers the adapter as lm-eval's model "prism", then runs lm-eval's own command line with
`--model prism --model_args {"workdir": ..., "gains": ...}` and the arguments after `--`
(lm-eval's `run` arguments; `--batch_size` defaults to 32 rows, `--model_args` may add the
adapter's max_gen_toks and seed). `--gains`: a steering set file, the one `prism suppress`
saves or the explorer's {"gains": {id: g}} JSON, checked against the run's bank; every
score and sample then uses the edited logits. With --offline (the default) HF datasets and
the Hub are not contacted: tasks must read local files (or the datasets cache). Needs the
`lm-eval` extra (pip install 'prism_jax[lm-eval]').
"""

import json
import os
import sys

from absl import flags, logging

import prism_jax
from prism_jax.cli import launcher

# The library, jax and lm_eval are imported where used: a bad flag or --help is answered before jax
# loads (~1.6 s).

FLAGS = flags.FLAGS
# lm-eval's flags that name the model: this command sets them
MODEL_FLAGS = ("--model", "-M")


def define_flags() -> None:
  """Called by `prism lm-eval` only: the experiment and the tests import load_run beside
  flags of their own (absl flags are process-global)."""
  if "gains" in FLAGS:
    return
  flags.DEFINE_string("workdir", None, "the trained run to evaluate (prism train)")
  flags.DEFINE_string("gains", None, "a steering set file: `prism suppress`'s saved set or "
                      "the explorer's {\"gains\": {id: g}} JSON")
  flags.DEFINE_bool("offline", True, "set HF_DATASETS_OFFLINE=1 and HF_HUB_OFFLINE=1: tasks "
                    "read local files only")
  flags.mark_flag_as_required("workdir")


def read_gains(path: str, run) -> dict[int, float]:
  """{prototype id: gain} of a steering set file, read and checked by control/steering.py
  (both formats, ids, bounds, a suppression set's bank fingerprint)."""
  from prism_jax.control import steering  # pylint: disable=g-import-not-at-top
  from prism_jax.control.suppression import model_fingerprint  # pylint: disable=g-import-not-at-top
  if run.config.model.kind != "prism":
    raise ValueError(f"--gains: {run.workdir} is a dense run: it has no prototypes to steer")
  try:
    return steering.gain_map(run.config.model.num_prototypes,
                             steering_set=steering.read_set(path),
                             fingerprint=model_fingerprint(run.model))
  except FileNotFoundError as e:
    raise FileNotFoundError(f"--gains: {e}") from None
  except ValueError as e:  # the set's checks and JSONDecodeError alike
    raise ValueError(f"--gains={path}: {e}") from None


def load_run(workdir: str, gains: str | None = None):
  """The run lm-eval's model_args name: `prism_jax.load(workdir)`, steered by the gains
  file when given (the adapter's loader)."""
  run = prism_jax.load(workdir)
  return run.steer(read_gains(gains, run)) if gains else run


def lm_eval_argv(workdir: str, gains: str | None, args: list[str]) -> list[str]:
  """lm-eval's command line: the model set here, the user's arguments after it."""
  if args[:1] == ["run"]:
    args = args[1:]
  if not args:
    raise ValueError("give lm-eval's arguments after --, e.g. prism lm-eval --workdir=RUN -- "
                     "--tasks NAME --include_path DIR")
  named = [a for a in args if a.split("=")[0] in MODEL_FLAGS]
  if named:
    raise ValueError(f"{named[0]}: prism lm-eval runs lm-eval's model 'prism' on --workdir; "
                     "leave --model out")
  model_args = {"workdir": workdir, **({"gains": gains} if gains else {})}
  # lm-eval's default batch of 1 would compile and run one row at a time: 32 unless given
  batch = [] if any(a.split("=")[0] in ("--batch_size", "-b") for a in args) else [
      "--batch_size", "32"]
  return ["lm-eval", "--model", "prism", "--model_args", json.dumps(model_args),
          *batch, *args]


def main(argv):
  argv = lm_eval_argv(FLAGS.workdir, FLAGS.gains, list(argv[1:]))
  logging.set_verbosity(logging.WARNING)  # checkpoint-restore chatter; lm-eval logs its own
  if FLAGS.offline:  # before datasets is imported: it reads them once
    os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"
  from prism_jax.evaluation import lm_eval_adapter  # pylint: disable=g-import-not-at-top
  from lm_eval.__main__ import cli_evaluate  # pylint: disable=g-import-not-at-top
  run = load_run(FLAGS.workdir, FLAGS.gains)  # bad runs and gains fail before lm-eval starts
  lm_eval_adapter.register(
      lambda workdir, gains: run if (workdir, gains) == (FLAGS.workdir, FLAGS.gains)
      else load_run(workdir, gains))
  sys.argv = argv
  cli_evaluate()


if __name__ == "__main__":
  define_flags()
  launcher.run(main)
