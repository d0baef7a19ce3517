"""The tiny model on the local multiple-choice task through lm-evaluation-harness and through
the offline scorer, side by side (issue 46, item 4).

  nice python -m experiments.lm_eval_local --workdir=runs/demo \
      --results_json=docs/results/lm_eval_local.json

lm-eval (lm_eval.simple_evaluate, offline) runs the task of --task_dir named --task on the
adapter registered as its model "prism" (prism_jax/evaluation/lm_eval_adapter.py, model_args
workdir=...); the offline scorer (prism_jax/evaluation/scoring.py) reads the task's JSONL
(the YAML's data_files) as a user task. Written: both paths' acc and acc_norm, the largest
|Δ loglikelihood| over every choice, is_greedy disagreements, and rows in
experiments/reproduce.py's schema. Run from the repository root (the YAML's data path is
relative to it). Needs the lm-eval extra.
"""

import os

from absl import flags, logging

from prism_jax.cli import launcher as cli
from prism_jax.cli import provenance

flags.DEFINE_string("workdir", None, "the trained run (e.g. runs/demo)")
flags.DEFINE_string("task_dir", "tests/lm_eval_task", "lm-eval --include_path: the task YAML")
flags.DEFINE_string("task", "prism_python_docs_mc", "the task's name in its YAML")
flags.DEFINE_integer("batch_size", 32, "rows per compiled batch")
flags.DEFINE_string("results_json", None, "write the results here")
flags.mark_flag_as_required("workdir")
FLAGS = flags.FLAGS


def task_data(task_dir: str, task: str) -> tuple[str, str]:
  """(YAML path, JSONL path) of the local multiple-choice task `task` in `task_dir`."""
  import yaml  # pylint: disable=g-import-not-at-top
  if not os.path.isdir(task_dir):
    raise FileNotFoundError(f"--task_dir {task_dir} is not a directory")
  for name in sorted(os.listdir(task_dir)):
    if name.endswith((".yaml", ".yml")):
      with open(os.path.join(task_dir, name), encoding="utf-8") as f:
        spec = yaml.safe_load(f)
      if isinstance(spec, dict) and spec.get("task") == task:
        break
  else:
    raise ValueError(f"--task={task}: no YAML in {task_dir} defines it")
  if spec.get("output_type") != "multiple_choice" or spec.get("dataset_path") != "json":
    raise ValueError(f"{name}: expected a local multiple_choice task (dataset_path json)")
  data = spec["dataset_kwargs"]["data_files"][spec["test_split"]]
  if not os.path.isfile(data):
    raise FileNotFoundError(f"{name}'s data file {data} does not exist (run from the "
                            "repository root)")
  return os.path.join(task_dir, name), data


def through_lm_eval(workdir: str, task_dir: str, task: str, batch_size: int) -> dict:
  """lm-eval's results for the task on the registered adapter: acc, acc_norm, per choice
  (loglikelihood, is_greedy) in doc order, and its version."""
  import lm_eval  # pylint: disable=g-import-not-at-top
  from lm_eval.tasks import TaskManager  # pylint: disable=g-import-not-at-top
  from prism_jax.cli.lm_eval_cli import load_run  # pylint: disable=g-import-not-at-top
  from prism_jax.evaluation import lm_eval_adapter  # pylint: disable=g-import-not-at-top
  lm_eval_adapter.register(load_run)
  res = lm_eval.simple_evaluate(
      model="prism", model_args={"workdir": workdir}, tasks=[task], batch_size=batch_size,
      task_manager=TaskManager(include_path=task_dir, include_defaults=False),
      log_samples=True, bootstrap_iters=0)
  docs = sorted(res["samples"][task], key=lambda d: d["doc_id"])
  choices = [(float(ll), bool(g)) for d in docs for ll, g in d["filtered_resps"]]
  metrics = res["results"][task]
  return {"acc": metrics["acc,none"], "acc_norm": metrics["acc_norm,none"],
          "choices": choices, "version": res.get("lm_eval_version", lm_eval.__version__)}


def through_offline_scorer(workdir: str, data: str, task: str, batch_size: int) -> dict:
  """The offline scorer on the same JSONL: acc, acc_norm, per choice (logprob, greedy)."""
  import prism_jax  # pylint: disable=g-import-not-at-top
  from prism_jax.evaluation import scoring, tasks  # pylint: disable=g-import-not-at-top
  run = prism_jax.load(workdir)
  items = tasks.load_jsonl_task(data, task)
  enc = scoring.encode_items(items, run.tokenizer, run.config.model.max_len)
  sc = scoring.score_options(run.model, enc, batch_rows=batch_size)
  return {"acc": float(scoring.correct(items, sc.logprob_O).mean()),
          "acc_norm": float(scoring.correct(items, sc.logprob_O, norm=True).mean()),
          "choices": list(zip(sc.logprob_O.tolist(), sc.greedy_O.tolist())),
          "items": len(items)}


def markdown(data: dict) -> str:
  lines = ["| task | items | scored through | acc | acc_norm |", "| --- | --- | --- | --- | --- |"]
  for key, label in (("lm_eval", f"lm-eval {data['lm_eval_version']} (model \"prism\")"),
                     ("offline", "offline scorer (prism_jax.evaluation.scoring)")):
    lines.append(f"| {data['task']} | {data['items']} | {label} | "
                 f"{100 * data[key]['acc']:.1f}% | {100 * data[key]['acc_norm']:.1f}% |")
  lines.append(f"\nmax |Δ loglikelihood| over {data['choices']} choices: "
               f"{data['max_abs_delta_loglikelihood']:.3g}; is_greedy disagreements: "
               f"{data['greedy_disagreements']}")
  return "\n".join(lines)


def main(argv):
  del argv
  if FLAGS.batch_size < 1:
    raise ValueError(f"--batch_size={FLAGS.batch_size}: must be >= 1")
  if not os.path.isfile(os.path.join(FLAGS.workdir, "config.json")):
    raise FileNotFoundError(f"--workdir {FLAGS.workdir} holds no trained run (config.json)")
  yaml_path, data = task_data(FLAGS.task_dir, FLAGS.task)
  logging.set_verbosity(logging.WARNING)  # checkpoint-restore chatter
  os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"  # before datasets
  import numpy as np  # pylint: disable=g-import-not-at-top
  ours = through_lm_eval(FLAGS.workdir, FLAGS.task_dir, FLAGS.task, FLAGS.batch_size)
  ref = through_offline_scorer(FLAGS.workdir, data, FLAGS.task, FLAGS.batch_size)
  if len(ours["choices"]) != len(ref["choices"]):
    raise AssertionError(f"lm-eval scored {len(ours['choices'])} choices, the offline "
                         f"scorer {len(ref['choices'])}")
  got, want = np.asarray(ours.pop("choices")), np.asarray(ref.pop("choices"))
  data = {**provenance.record("experiments.lm_eval_local"), "workdir": FLAGS.workdir,
          "task": FLAGS.task, "task_yaml": yaml_path, "data": data, "items": ref.pop("items"),
          "choices": len(got), "lm_eval_version": ours.pop("version"),
          "lm_eval": ours, "offline": ref,
          "max_abs_delta_loglikelihood": float(np.abs(got[:, 0] - want[:, 0]).max()),
          "greedy_disagreements": int((got[:, 1] != want[:, 1]).sum())}
  note = (f"{data['items']} items; acc_norm {100 * ours['acc_norm']:.1f}% vs "
          f"{100 * ref['acc_norm']:.1f}%; max |Δ loglikelihood| "
          f"{data['max_abs_delta_loglikelihood']:.2g} over {data['choices']} choices")
  data["rows"] = [{"metric": f"lm-eval adapter vs offline scorer, acc on the local task "
                             f"({FLAGS.task}), {os.path.basename(FLAGS.workdir.rstrip('/'))}",
                   "paper": "not reported",
                   "ours": f"{100 * ours['acc']:.1f}% vs {100 * ref['acc']:.1f}%",
                   "note": note, "command": data["command"]}]
  print(markdown(data))
  if FLAGS.results_json:
    provenance.write_results(FLAGS.results_json, data)


if __name__ == "__main__":
  cli.run(main)
