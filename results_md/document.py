"""docs/RESULTS.md's generated parts, from the recorded results in docs/results/*.json
(`python -m experiments.reproduce` writes them: `regenerate`).

Writes, each between its markers `<!-- NAME:begin -->` / `<!-- NAME:end -->` (a section
with the markers is appended when they are missing; regenerate, never edit by hand):
  summary    the opening summary: PRISM.md §7's headline claims and the issues' targets,
             each from the results JSON that measured it (results_md/summary.py);
             a claim no JSON answers says so ("not measured", or where the hand-recorded
             number is) and shows no number.
  reproduce  the paper-vs-ours table: every headline claim of PRISM.md §7 (HEADLINES, the
             paper's column), then every other recorded row. "ours" comes from a row of a
             JSON whose "claim" is the headline's key, else NO_JSON's pointer, else "not
             measured".
  the sections of results_md/sources.py's SECTIONS (each file's own tables).
Every command shown is the recorded one as it is written today (provenance.today_command:
the module under its current name, `prism <subcommand>` for a prism_jax.cli module, renamed
flags under today's names), with the commit it ran on.

Results JSON schema (docs/results/<topic>.json, written by the experiment that measured it):

  {"rows": [{"metric": "LDS (prism)",       # the row's name in the table (required)
             "ours": 0.12,                  # number or text (required)
             "command": "python -m ...",   # the exact command that wrote it (required)
             "paper": "not reported",       # optional: the paper's number or text
             "claim": "suppression",        # optional: a HEADLINES key this row answers
             "ci": [0.05, 0.19],            # optional: shown as [lo, hi] after ours
             "note": "..."}],               # optional: shown after ours, in brackets
   "command": ..., "argv": [...], "commit": "..."}   # provenance (prism_jax/cli/provenance)

Files are read in name order; rows without a "claim" follow the headlines in that order.
Experiments that write their own shape are read through results_md/sources.py's
READERS.
"""

import glob
import json
import os

from prism_jax.cli import provenance
from results_md import sources
from results_md import summary

BEGIN, END = "<!-- reproduce:begin -->", "<!-- reproduce:end -->"

# PRISM.md §7, "Headline numbers to beat (paper)": (key, claim, paper).
HEADLINES = (
    ("scale", "scale", "130M–1.6B params, FineWeb / Nemotron-CC, up to 50B tokens"),
    ("quality", "quality vs dense", "within 2.5 points average downstream accuracy "
     "(matches dense at 1.6B/10B tokens)"),
    ("overhead", "parameter overhead", "1.7% at XL"),
    ("throughput", "training throughput", "97.3% of dense (measured on an H200, XL)"),
    ("grounding", "grounding", "R̄_1, R_2 in 0.94–1.00"),
    ("attribution_speed", "attribution speed", "~470× EK-FAC at equal memory (124M)"),
    ("attribution_signal", "attribution signal", "~80% of top-ranked sequences kept vs full "
     "prototype-space gradients"),
    ("controllers", "controllers", "+2.72 points (SAE controller +0.32)"),
    ("suppression", "suppression", "NSFW 0.668 → 0.154 with 86 prototypes"),
)
EXTRA = (("faithfulness", "faithfulness (W ẑ alone vs the full model)", "not reported"),)
# Claims no results JSON answers: where the number is instead (no number shown here).
NO_JSON = {
    "overhead": "no results JSON: an analytic count, printed by `prism model-card` "
                "(section 'Model card')",
}
REQUIRED = ("metric", "ours", "command")


def load_rows(results_dir: str) -> list[dict]:
  """Every row of every JSON under results_dir (name order), each with its "file" and,
  unless it records its own, the file's "commit"."""
  rows = []
  for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
    with open(path) as f:
      try:
        data = json.load(f)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    stem = os.path.splitext(os.path.basename(path))[0]
    reader = sources.READERS.get(stem)
    if reader is None and stem.startswith(sources.DETAIL_PREFIXES):
      continue  # a variant of a headline file: its detail stays in RESULTS.md
    commit = data.get("commit") if isinstance(data, dict) else None
    if reader is not None:
      try:
        data = {"rows": reader(data)}
      except (KeyError, IndexError, TypeError, StopIteration, ZeroDivisionError) as e:
        raise ValueError(f"{path}: not the shape its reader expects ({e!r})") from e
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
      raise ValueError(f"{path}: needs a top-level {{\"rows\": [...]}} "
                       "(see results_md/document.py)")
    for i, row in enumerate(data["rows"]):
      missing = [k for k in REQUIRED if not isinstance(row, dict) or k not in row]
      if missing:
        raise ValueError(f"{path}: row {i} lacks {', '.join(missing)}")
      row = dict(row, file=os.path.basename(path))
      if commit and "commit" not in row:
        row["commit"] = commit
      rows.append(row)
  return rows


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


def source(row: dict) -> str:
  """docs/results/FILE (commit `abc...`): where a row comes from."""
  commit = row.get("commit")
  if not commit:
    return f"docs/results/{row['file']}"
  short = commit[:12] + ("+dirty" if "+dirty" in commit else "")
  return f"docs/results/{row['file']} (commit `{short}`)"


def command(row: dict) -> str:
  """The row's recorded command as written today."""
  return provenance.today_command(row["command"])


def build_table(rows: list[dict]) -> str:
  by_claim = {r["claim"]: r for r in rows if "claim" in r}
  lines = ["| claim | paper | ours | source | command (today's spelling) |",
           "|---|---|---|---|---|"]
  for key, claim, paper in HEADLINES + EXTRA:
    if key in by_claim:
      r = by_claim[key]
      shown = r.get("paper") if r.get("paper") not in (None, "not reported", "–") else paper
      lines.append(f"| {_cell(claim)} | {_cell(shown)} | {_cell(_ours(r))} | "
                   f"{_cell(source(r))} | `{_cell(command(r))}` |")
    else:
      lines.append(f"| {_cell(claim)} | {_cell(paper)} | "
                   f"{_cell(NO_JSON.get(key, 'not measured'))} | – | – |")
  keys = {k for k, _, _ in HEADLINES + EXTRA}
  for r in rows:
    if r.get("claim") in keys:
      continue
    lines.append(f"| {_cell(r['metric'])} | {_cell(r.get('paper', '–'))} | {_cell(_ours(r))}"
                 f" | {_cell(source(r))} | `{_cell(command(r))}` |")
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


def today(data: dict) -> dict:
  """A results file with its recorded command as written today (for the renderers)."""
  if isinstance(data, dict) and "command" in data:
    return dict(data, command=provenance.today_command(data["command"]))
  return data


def write_sections(md: str, results_dir: str) -> str:
  """Each sources.SECTIONS file's own tables, between its markers; then the
  sections drawn from several files (sources.MULTI_SECTIONS)."""
  for stem, (render, name) in sources.SECTIONS.items():
    path = os.path.join(results_dir, stem + ".json")
    if os.path.isfile(path):
      with open(path) as f:
        md = write_between_markers(md, render(today(json.load(f))), f"<!-- {name}:begin -->",
                                   f"<!-- {name}:end -->", name.replace("_", " ").capitalize())
  for name, (patterns, render) in sources.MULTI_SECTIONS.items():
    files = {}
    for pattern in patterns:
      for path in sorted(glob.glob(os.path.join(results_dir, pattern))):
        with open(path) as f:
          files[os.path.relpath(path, results_dir)] = today(json.load(f))
    if files:
      md = write_between_markers(md, render(files), f"<!-- {name}:begin -->",
                                 f"<!-- {name}:end -->", name.replace("_", " ").capitalize())
  return md


def regenerate(md: str, results_dir: str) -> str:
  """RESULTS.md with every generated part rewritten from results_dir."""
  md = write_between_markers(md, build_table(load_rows(results_dir)))
  md = write_between_markers(md, summary.summary(results_dir),
                             summary.BEGIN, summary.END, "Summary")
  return write_sections(md, results_dir)
