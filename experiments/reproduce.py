"""The paper-vs-ours table, generated from recorded results into docs/RESULTS.md.

  python -m experiments.reproduce [--results_dir=docs/results] [--results_md=docs/RESULTS.md]

Rows: every headline claim of PRISM.md §7 (HEADLINES, the paper's column), then every other
recorded row (LDS, faithfulness, ...). "ours" comes from, in order:
  1. a row of a JSON file under --results_dir whose "claim" is the headline's key;
  2. else the headline's row of the summary table at the top of --results_md (FALLBACK:
     claim prefix there), its command = the first code block of the section that row names;
  3. else "not measured".
The table replaces what lies between the markers `<!-- reproduce:begin -->` and
`<!-- reproduce:end -->` in --results_md (a section with the markers is appended when
they are missing): regenerate it, never edit it by hand.

Results JSON schema (docs/results/<topic>.json, written by the experiment that measured it):

  {"rows": [{"metric": "LDS (prism)",       # the row's name in the table (required)
             "ours": 0.12,                  # number or text (required)
             "command": "python -m ...",   # the exact command that wrote it (required)
             "paper": "not reported",       # optional: the paper's number or text
             "claim": "suppression",        # optional: a HEADLINES key this row answers
             "ci": [0.05, 0.19],            # optional: shown as [lo, hi] after ours
             "note": "..."}],               # optional: shown after ours, in brackets
   ...}                                     # any other keys are ignored here

Files are read in name order; rows without a "claim" follow the headlines in that order.
Experiments that write their own shape (suppression, mc_eval, throughput, cards,
cache_scale) are read through experiments/reproduce_sources.py's READERS.
"""

import glob
import json
import os
import re

from absl import flags

from prism_jax.cli import launcher
from experiments import reproduce_sources

flags.DEFINE_string("results_dir", "docs/results", "directory of results JSON files")
flags.DEFINE_string("results_md", "docs/RESULTS.md", "the markdown file to write into")
FLAGS = flags.FLAGS

BEGIN, END = "<!-- reproduce:begin -->", "<!-- reproduce:end -->"

# PRISM.md §7, "Headline numbers to beat (paper)": (key, claim, paper).
HEADLINES = (
    ("scale", "scale", "130M–1.6B params, FineWeb / Nemotron-CC, up to 50B tokens"),
    ("quality", "quality vs dense", "within 2.5 points average downstream accuracy "
     "(matches dense at 1.6B/10B tokens)"),
    ("overhead", "parameter overhead", "1.7% at XL"),
    ("throughput", "training throughput", "97.3% of dense (H200)"),
    ("grounding", "grounding", "R̄_1, R_2 in 0.94–1.00"),
    ("attribution_speed", "attribution speed", "~470× EK-FAC at equal memory (124M)"),
    ("attribution_signal", "attribution signal", "~80% of top-ranked sequences kept vs full "
     "prototype-space gradients"),
    ("controllers", "controllers", "+2.72 points (SAE controller +0.32)"),
    ("suppression", "suppression", "NSFW 0.668 → 0.154 with 86 prototypes"),
)
# Headline key -> the start of its row in RESULTS.md's summary table (recorded before
# the results JSON files existed), plus rows beyond §7 that the table always shows.
FALLBACK = {
    "overhead": "`xl` prototype overhead",
    "quality": "tiny PRISM val loss vs dense",
    "throughput": "PRISM/dense train tokens/s at `small`",
    "grounding": "tiny R̄1 / R̄2",
    "attribution_speed": "cached attribution vs EK-FAC per query",
    "attribution_signal": "top-100 retention",
    "faithfulness": "faithfulness, tiny",
}
EXTRA = (("faithfulness", "faithfulness (W ẑ alone vs the full model)", "not reported"),)
REQUIRED = ("metric", "ours", "command")


def load_rows(results_dir: str) -> list[dict]:
  """Every row of every JSON under results_dir (name order), each with its "file"."""
  rows = []
  for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
    with open(path) as f:
      try:
        data = json.load(f)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    stem = os.path.splitext(os.path.basename(path))[0]
    reader = reproduce_sources.READERS.get(stem)
    if reader is None and stem.startswith(reproduce_sources.DETAIL_PREFIXES):
      continue  # a variant of a headline file: its detail stays in RESULTS.md
    if reader is not None:
      try:
        data = {"rows": reader(data)}
      except (KeyError, IndexError, TypeError, StopIteration, ZeroDivisionError) as e:
        raise ValueError(f"{path}: not the shape its reader expects ({e!r})") from e
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
      raise ValueError(f"{path}: needs a top-level {{\"rows\": [...]}} (see reproduce.py)")
    for i, row in enumerate(data["rows"]):
      missing = [k for k in REQUIRED if not isinstance(row, dict) or k not in row]
      if missing:
        raise ValueError(f"{path}: row {i} lacks {', '.join(missing)}")
      rows.append(dict(row, file=os.path.basename(path)))
  return rows


def _split_fences(md: str):
  """(line, inside a code fence) for each line."""
  inside = False
  for line in md.splitlines():
    if line.startswith("```"):
      inside = not inside
      yield line, True
    else:
      yield line, inside


def summary_rows(md: str) -> list[list[str]]:
  """Cells of the first table under '## Summary' (header and rule dropped)."""
  out, in_summary = [], False
  for line, fenced in _split_fences(md):
    if fenced:
      continue
    if line.startswith("## "):
      if in_summary:
        break
      in_summary = line.startswith("## Summary")
    elif in_summary and line.startswith("|"):
      cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
      if cells and not set(cells[0]) <= set("-: ") and cells[0] != "claim":
        out.append(cells)
  return out


def section_command(md: str, title_start: str) -> str | None:
  """The first code block after the first heading that starts with `title_start`."""
  lines = list(_split_fences(md))
  start = next((i for i, (line, fenced) in enumerate(lines) if not fenced
                and re.match(r"#+ " + re.escape(title_start), line)), None)
  if start is None:
    return None
  block, inside = [], False
  for line, _ in lines[start + 1:]:
    if line.startswith("```"):
      if inside:
        return _commands(block)
      inside = True
    elif inside:
      block.append(line)
  return None


def _commands(block: list[str]) -> str | None:
  """The commands of a code block (comments dropped, continuations joined): up to two
  joined by ' ; ', else the last one and how many came before it."""
  cmds, cur = [], ""
  for line in block:
    line = line.strip()
    if not line or line.startswith("#"):
      continue
    cur += (" " if cur else "") + line.rstrip("\\").strip()
    if not line.endswith("\\"):
      cmds.append(cur)
      cur = ""
  if cur:
    cmds.append(cur)
  if len(cmds) > 2:
    return f"{cmds[-1]} (and {len(cmds) - 1} earlier commands in that section)"
  return " ; ".join(cmds) or None


def _cell(text) -> str:
  return str(text).replace("|", "\\|").replace("\n", " ")


def _ours(row: dict) -> str:
  v = row["ours"]
  text = f"{v:.4g}" if isinstance(v, float) else str(v)
  if "ci" in row:
    text += f" [{row['ci'][0]:.4g}, {row['ci'][1]:.4g}]"
  if row.get("note"):
    text += f" ({row['note']})"
  return text


def build_table(rows: list[dict], md: str) -> str:
  by_claim = {r["claim"]: r for r in rows if "claim" in r}
  summary = summary_rows(md)
  lines = ["| claim | paper | ours | source | command |", "|---|---|---|---|---|"]

  def add(key, claim, paper):
    if key in by_claim:
      r = by_claim[key]
      lines.append(f"| {_cell(claim)} | {_cell(r.get('paper', paper))} | {_cell(_ours(r))} | "
                   f"docs/results/{r['file']} | `{_cell(r['command'])}` |")
      return
    hit = next((c for c in summary if key in FALLBACK and c[0].startswith(FALLBACK[key])),
               None)
    if hit is not None:
      where = hit[3] if len(hit) > 3 else ""
      cmd = section_command(md, where) if where else None
      lines.append(f"| {_cell(claim)} | {_cell(paper)} | {_cell(hit[1])} ({_cell(hit[0])}) | "
                   f"RESULTS.md summary, section {_cell(where)} | "
                   + (f"`{_cell(cmd)}` |" if cmd else "see that section |"))
      return
    lines.append(f"| {_cell(claim)} | {_cell(paper)} | not measured | – | – |")

  for key, claim, paper in HEADLINES + EXTRA:
    add(key, claim, paper)
  for r in rows:
    if r.get("claim") in {k for k, _, _ in HEADLINES + EXTRA}:
      continue
    lines.append(f"| {_cell(r['metric'])} | {_cell(r.get('paper', '–'))} | {_cell(_ours(r))}"
                 f" | docs/results/{r['file']} | `{_cell(r['command'])}` |")
  return "\n".join(lines)


def write_between_markers(md: str, table: str, begin: str = BEGIN, end: str = END,
                          title: str = "Paper vs ours") -> str:
  block = f"{begin}\n{table}\n{end}"
  if (begin in md) != (end in md) or md.find(begin) > md.find(end):
    raise ValueError(f"RESULTS.md has one of {begin} / {end} without the other (or out of "
                     "order): fix the markers")
  if begin in md:
    return md[:md.index(begin)] + block + md[md.index(end) + len(end):]
  return md.rstrip("\n") + (f"\n\n## {title} (generated by experiments/reproduce.py)\n\n"
                            f"{block}\n")


def write_sections(md: str, results_dir: str) -> str:
  """Each reproduce_sources.SECTIONS file's own tables, between its markers."""
  for stem, (render, name) in reproduce_sources.SECTIONS.items():
    path = os.path.join(results_dir, stem + ".json")
    if os.path.isfile(path):
      with open(path) as f:
        md = write_between_markers(md, render(json.load(f)), f"<!-- {name}:begin -->",
                                   f"<!-- {name}:end -->", name.replace("_", " ").capitalize())
  return md


def main(argv):
  del argv
  if not os.path.isfile(FLAGS.results_md):
    raise FileNotFoundError(f"--results_md={FLAGS.results_md} does not exist")
  with open(FLAGS.results_md) as f:
    md = f.read()
  table = build_table(load_rows(FLAGS.results_dir), md)
  with open(FLAGS.results_md, "w") as f:
    f.write(write_sections(write_between_markers(md, table), FLAGS.results_dir))
  print(table)


if __name__ == "__main__":
  launcher.run(main)
