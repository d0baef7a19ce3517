"""Train (or resume) a PRISM model or its dense twin.

  prism train --config=tiny --data=PATH_OR_GLOB[,...] --workdir=DIR \
      --set model.k=8 --set train.steps=100 [--model=dense]

No --data: the embedded corpus (CPython's pydoc topics). Re-running with the same
--workdir resumes from its newest checkpoint; a different config is refused, except a
larger train.steps (train a finished run longer) and the fields named by --allow_change.
User errors print one `error: ...` line (prism_jax/cli/launcher.py; --debug for the traceback).

Preemption: SIGTERM or SIGINT (on several processes: to any of them) finishes the step,
saves it on every process and exits 0 with one line `preempted by ...: saved step N ...`;
the same command resumes (prism_jax/train/preemption.py). A process that dies makes the
others exit with an error naming it after --heartbeat_timeout_s.
"""

import json

from absl import flags, logging

from prism_jax.cli import launcher

# The training library (flax, optax, orbax) is imported inside main(): a bad flag or --help is
# answered before it loads (~0.6 s).

flags.DEFINE_string("config", "tiny", "preset: tiny, the GPT-2 recipes small/medium/large/xl "
                    "(prism_jax.config.preset; --set train.steps=N rescales warm-up, prototype "
                    "init, eval and checkpoints) or small_smoke ... xl_smoke (10 steps); or a "
                    "config file (.json, .yaml, .yml: a run's own config.json, or the keys "
                    "that differ from the defaults); --set applies on top")
flags.DEFINE_string("data", None, "comma-separated .txt/.jsonl/.parquet files or globs; "
                    "default: the embedded corpus")
flags.DEFINE_string("workdir", None, "the run directory trained into or resumed "
                    "(checkpoints, metrics, config.json)")
flags.DEFINE_enum("model", None, ["prism", "dense"], "shorthand for --set model.kind=...")
flags.DEFINE_multi_string("set", [], "dotted config override KEY=VALUE (repeatable)")
flags.DEFINE_multi_string("allow_change", [], "a config field that may differ from the "
                          "checkpoint's on resume (repeatable), e.g. train.lr after a "
                          "divergence; see prism_jax.train.checkpoint.CHANGES_ON_REQUEST")
flags.DEFINE_bool("start_over", False, "train from step 0 when every checkpoint of --workdir "
                  "was quarantined as corrupt (refused otherwise)")
flags.mark_flag_as_required("workdir")
FLAGS = flags.FLAGS

from prism_jax import distributed  # noqa: E402  (registers the multi-host flags)

distributed.define_flags()


from prism_jax.config import build_config  # noqa: E402,F401  (tests import it here)


def main(argv, callbacks=()):
  """`callbacks(step, state)`: run after each step (tests pace a run with one)."""
  del argv
  distributed.initialize_from_flags()  # no-op for a single process
  distributed.configure_logging()
  launcher.retain_freed_host_memory()  # CPU runs: the allocator setting, process-wide, opt-in
  cfg = build_config(FLAGS.config, FLAGS.data, FLAGS.model, FLAGS.set)
  from prism_jax.train import train  # pylint: disable=g-import-not-at-top
  from prism_jax.train.metrics import quiet_library_logs  # pylint: disable=g-import-not-at-top
  from prism_jax.train import preemption  # pylint: disable=g-import-not-at-top
  quiet_library_logs()
  with preemption.install() as notice:
    result = train(cfg, FLAGS.workdir, start_over=FLAGS.start_over,
                   allow_config_change=FLAGS.allow_change, preemption=notice,
                   callbacks=callbacks)
  if result.preempted:
    print(f"preempted by {notice.describe()}: saved step {result.final_step} of "
          f"{cfg.train.steps} in {result.workdir}; the same command resumes", flush=True)
    return
  printable = result.summary()
  ev = printable["eval"]
  logging.info("done: steps %d..%d in %.0f s, val loss %s, steady tokens/s %s",
               result.start_step, result.final_step, result.wall_s,
               f"{ev['loss']:.4f}" if "loss" in ev else "-",
               f"{result.steady_tokens_per_s:,.0f}" if result.steady_tokens_per_s else "-")
  if distributed.is_main_process():
    print(json.dumps(printable, default=str, indent=1))


if __name__ == "__main__":
  launcher.run(main)
