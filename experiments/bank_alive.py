"""Does the bank stay alive at the real shape? The `small` rehearsal's collapse, diagnosed
and fixed (issue 44, item 4).

  nice python -m experiments.bank_alive --root=/tmp/alive --steps=48 \
      --results_json=docs/results/bank_alive.json

The `small` model (d 768, 12 layers, K 8192, k 16, GPT-2 BPE) on the embedded corpus with
the rehearsal's cut (global batch 8 rows x 128 tokens, its recipe's learning rate and
schedule for --steps steps), val_fraction 0.1 so that the val split holds >= 8,192 tokens.
Runs at equal steps:
  unfixed    the bank set at step --init_step (the rehearsal's 6), nothing else
  late_init  the bank set at step --late_init_step: is a young backbone the cause?
  revive     as unfixed, with train.revive_every=--revive_every (prism_jax/train/revive.py)
  auto       the recipe's own defaults: train.proto_init_step=auto (the bank set at the
             first eval step where the states have spread), its eval and revival cadence
Per run, on the whole val split: alive = prototypes selected at least once (K - dead),
val CE, agreement of argmax W z_hat with argmax W z (all, decisive), R̄1/R̄2, and the mean
cosine of the val hidden states to their mean direction (a shared direction makes cosine
routing pick the same few prototypes for every token). Runs are resumable (train()). With --share_warmup, a run whose checkpoint directory is
empty starts from the first run's checkpoint at the shared init step (the dense warm-up is
the same computation for every run; only revive_every differs after it, resumed with
`allow_config_change`), so a fair test at a trained backbone pays for its warm-up once.
"""

import os
import shutil

import numpy as np
from absl import flags, logging

from prism_jax.cli import launcher as cli
from prism_jax.cli import provenance
from results_md.prototype_path import alive_markdown as markdown

flags.DEFINE_string("root", None, "directory of the runs (resumed / reused)")
flags.DEFINE_integer("steps", 48, "train.steps of every run")
flags.DEFINE_integer("init_step", 6, "the bank's init step of unfixed and revive")
flags.DEFINE_integer("late_init_step", 24, "the bank's init step of late_init")
flags.DEFINE_integer("revive_every", 6, "train.revive_every of the revive run")
flags.DEFINE_list("runs", ["unfixed", "late_init", "revive"], "runs to train and measure")
flags.DEFINE_bool("share_warmup", False, "later runs with the first run's init step start "
                  "from its checkpoint at that step")
flags.DEFINE_string("results_json", None, "write the rows here")
flags.mark_flag_as_required("root")
FLAGS = flags.FLAGS

RUNS = ("unfixed", "late_init", "revive", "auto")
AUTO_CKPT_EVERY = 50  # the auto run keeps checkpoints to resume from, not to share


def run_config(name: str, root: str):
  from prism_jax.config import preset  # pylint: disable=g-import-not-at-top
  from prism_jax.train import apply_overrides  # pylint: disable=g-import-not-at-top
  sets = ["train.batch_size=8", "data.seq_len=128", "data.val_fraction=0.1",
          "train.eval_at_start=false", "train.eval_batches=0", "train.log_every=1",
          "train.keep_checkpoints=2", f"data.packed_dir={os.path.join(root, 'data')}"]
  if name == "auto":  # the bank's timing, eval and revival cadence as the recipe sets them;
    # its 50 evaluations on one val batch each (the whole split takes minutes here), the
    # measurement on the whole split after the run (whole_val_eval)
    return apply_overrides(preset("small", FLAGS.steps),
                           sets + [f"train.ckpt_every={AUTO_CKPT_EVERY}",
                                   "train.eval_batches=1"])
  init = FLAGS.late_init_step if name == "late_init" else FLAGS.init_step
  sets += [f"train.proto_init_step={init}", f"train.eval_every={FLAGS.steps}",
           f"train.ckpt_every={FLAGS.init_step}",
           f"train.revive_every={FLAGS.revive_every if name == 'revive' else 0}"]
  return apply_overrides(preset("small", FLAGS.steps), sets)


def bank_set_at(workdir: str) -> int:
  """The step an "auto" run set its bank at, from its newest checkpoint's data state."""
  from prism_jax.train import Checkpointer  # pylint: disable=g-import-not-at-top
  from prism_jax.train.recipe import BANK_SET_AT  # pylint: disable=g-import-not-at-top
  ck = Checkpointer(workdir, read_only=True)
  try:
    return int(ck.read_data_state(ck.latest_step())[BANK_SET_AT])
  finally:
    ck.close()


def common_direction(workdir: str) -> float:
  """Mean cosine of the val hidden states to their mean direction (final parameters)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from prism_jax import data as data_lib  # pylint: disable=g-import-not-at-top
  from prism_jax.grounding import common_direction_cos  # pylint: disable=g-import-not-at-top
  from prism_jax.loading import load_for_inference  # pylint: disable=g-import-not-at-top
  model, cfg, _ = load_for_inference(workdir)
  packed = data_lib.prepare_data(cfg.data, cfg.model.vocab_size, workdir)
  b = data_lib.make_loader(packed, "val", 8, 0).batch_at(0)
  z = np.asarray(model.backbone(jnp.asarray(b["inputs"]))[0], np.float64)[b["mask"]]
  return common_direction_cos(z)


def whole_val_eval(workdir: str, cfg, result) -> dict:
  """The trained run's metrics on the whole val split (as the other runs' last eval)."""
  from prism_jax import data as data_lib  # pylint: disable=g-import-not-at-top
  from prism_jax.train import evaluate  # pylint: disable=g-import-not-at-top
  packed = data_lib.prepare_data(cfg.data, cfg.model.vocab_size, workdir)
  val = data_lib.make_loader(packed, "val", cfg.train.batch_size, cfg.data.seed)
  return evaluate(result.graphdef, result.state.params, cfg, val, num_batches=0)


def start_from_donor(workdir: str, donor: str, step: int) -> None:
  """Copies `donor`'s checkpoint at `step` into `workdir` unless it holds one already
  (then the run resumes from its own)."""
  src = os.path.join(donor, "checkpoints", str(step))
  dst = os.path.join(workdir, "checkpoints")
  if os.path.isdir(dst) and os.listdir(dst):
    return
  if not os.path.isdir(src):
    raise FileNotFoundError(f"--share_warmup: {src} is missing (the first run must keep "
                            "its checkpoint at the init step)")
  shutil.copytree(src, os.path.join(dst, str(step)))


def measure(name: str, donor: str | None) -> dict:
  from prism_jax.train import train  # pylint: disable=g-import-not-at-top
  workdir = os.path.join(FLAGS.root, name)
  cfg = run_config(name, FLAGS.root)
  allow = ()
  if donor is not None:
    start_from_donor(workdir, donor, cfg.train.proto_init_step)
    allow = ("train.revive_every",)
  result = train(cfg, workdir, allow_config_change=allow)
  ev = dict(result.eval) if name != "auto" else whole_val_eval(workdir, cfg, result)
  k = cfg.model.num_prototypes
  init = bank_set_at(workdir) if name == "auto" else cfg.train.proto_init_step
  return {"init_step": init, "revive_every": cfg.train.revive_every,
          "steps": cfg.train.steps, "val_tokens": ev["tokens"], "loss": ev["loss"],
          "alive": k - ev["dead_prototypes"], "alive_frac": 1 - ev["dead_prototypes"] / k,
          "agreement": ev["agreement"], "agreement_decisive": ev["agreement_decisive"],
          "r1_bar": ev["r1_bar"], "r2_bar": ev["r2_bar"],
          "common_direction_cos": common_direction(workdir)}


def main(argv):
  del argv
  bad = sorted(set(FLAGS.runs) - set(RUNS))
  if not FLAGS.runs:
    raise ValueError("--runs is empty: name at least one of " + ", ".join(RUNS))
  if FLAGS.revive_every < 1:
    raise ValueError(f"--revive_every={FLAGS.revive_every}: the revive run needs >= 1")
  out_dir = os.path.dirname(FLAGS.results_json or "") or "."
  if not os.path.isdir(out_dir):
    raise FileNotFoundError(f"--results_json: no directory {out_dir!r} to write it in")
  if bad:
    raise ValueError(f"--runs: unknown {bad}; choose from {list(RUNS)}")
  if not 0 < FLAGS.init_step < FLAGS.steps or not 0 < FLAGS.late_init_step < FLAGS.steps:
    raise ValueError("--init_step and --late_init_step must lie in (0, --steps)")
  from prism_jax.train.metrics import quiet_library_logs  # pylint: disable=g-import-not-at-top
  quiet_library_logs()
  runs, first = {}, {}
  for name in FLAGS.runs:
    init = FLAGS.late_init_step if name == "late_init" else FLAGS.init_step
    donor = first.get(init) if FLAGS.share_warmup and name != "auto" else None
    if name != "auto":  # its bank's step is its own: no donor for the others
      first.setdefault(init, os.path.join(FLAGS.root, name))
    runs[name] = measure(name, donor)
    logging.info("%s: %s", name, runs[name])
  data = {**provenance.record("experiments.bank_alive"), "runs": runs}
  print(markdown(data))
  if FLAGS.results_json:
    provenance.write_results(FLAGS.results_json, data)


if __name__ == "__main__":
  cli.run(main)
