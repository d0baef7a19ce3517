"""The maps of the code name what exists, and list every module.

The docs checked: docs/DESIGN.md, WORKSPACE.md, README.md and every folder README
(prism_jax/**, pallas_kernels/**, experiments/**, benchmarks/, results_md/, tests/, tools/).

1. Every path they name exists. A path is a token with a known top folder
   (`prism_jax/model/lm.py`, `docs/results/*.json`: a glob must match), a file name with a
   source or doc extension (.py .ipynb .sh .md .cfg .toml), a folder name ending in `/`, a
   dotted module (`prism_jax.train.run`, `python -m experiments.lds`: a trailing attribute
   must be a name of the module's source), or a test module (`test_model`, `test_data_*`,
   tests/). A relative path or bare name resolves against the repository root, the doc's
   folder, prism_jax/, pallas_kernels/, docs/, a folder named earlier on the same line, or,
   inside a ```tree block, the folders of the entry the line belongs to (an entry itself
   must exist at exactly the place the tree gives it). URLs, absolute paths,
   `<placeholders>` and run outputs (runs/, build/, `<workdir>/...`) are not paths of the
   repository.
2. Every module is listed where its folder is mapped (one rule): a package folder (it has
   __init__.py) with a README of its own must name each of its modules (every .py but
   __init__.py, and its .sh scripts) in that README; every other package of prism_jax and
   pallas_kernels must have each module as an entry of DESIGN.md's ```tree (the Layout).

When this fails after a module moved: update the doc that names or maps it, in the same
commit; never loosen the rule to pass.
"""

import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
DESIGN = REPO / "docs" / "DESIGN.md"
TOP_FOLDERS = ("prism_jax", "pallas_kernels", "experiments", "benchmarks", "results_md", "tests",
               "tools", "docs", "apidocs", "requirements")
NOT_REPO = ("runs/", "build/", ".venv/", "site/")
BASES = ("", "prism_jax", "pallas_kernels", "docs")
SOURCE_EXT = {".py", ".ipynb", ".sh", ".md", ".cfg", ".toml"}
PACKAGE_ROOTS = ("prism_jax", "pallas_kernels", "experiments", "benchmarks", "results_md")

URL = re.compile(r"\w+://\S*")
PATH = re.compile(r"(?<![\w./<>$@-])((?:[\w.*<>{}-]+/)*[\w*<>{}-][\w.*<>{}-]*(?:/)?)")
DOTTED = re.compile(r"(?<![\w./-])((?:prism_jax|pallas_kernels|experiments|benchmarks|results_md)"
                    r"(?:\.[A-Za-z_]\w*)+)")
TEST_MODULE = re.compile(r"(?<![\w./-])(test_[a-z0-9_]+\*?)(?![\w(])")
FENCE = re.compile(r"^```(\w*)\s*$")
TREE_ENTRY_MAX_INDENT = 20


def docs() -> list[pathlib.Path]:
  out = [DESIGN, REPO / "WORKSPACE.md", REPO / "README.md"]
  for folder in ("prism_jax", "pallas_kernels", "experiments", "benchmarks", "results_md", "tests",
                 "tools"):
    out += sorted(p for p in (REPO / folder).rglob("README*") if "__pycache__" not in p.parts)
  return out


def _rel(path: pathlib.Path) -> str:
  return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else str(path)


# --- reading a doc ------------------------------------------------------------------------

def tree_entries(lines: list[str]) -> list[tuple[int, str, tuple[str, ...]]]:
  """The entries of a ```tree block: (line index, name, ancestor folders). An entry starts a
  line at an indent below TREE_ENTRY_MAX_INDENT and ends in `/` or has an extension; deeper
  lines continue the description above."""
  out, stack = [], []  # stack of (indent, folder)
  for i, line in enumerate(lines):
    stripped = line.lstrip(" ")
    indent = len(line) - len(stripped)
    if not stripped or indent >= TREE_ENTRY_MAX_INDENT:
      continue
    name = stripped.split()[0]
    if not (name.endswith("/") or pathlib.PurePosixPath(name).suffix):
      continue
    while stack and stack[-1][0] >= indent:
      stack.pop()
    out.append((i, name, tuple(folder for _, folder in stack)))
    if name.endswith("/"):
      stack.append((indent, name))
  return out


def doc_lines(doc: pathlib.Path):
  """(line number, text, folders, entry) for every line of a doc. Inside a ```tree block,
  folders are those of the entry the line belongs to (its parents, and itself if a folder),
  and entry is the entry's path from the tree's root on the entry's own line."""
  lines = doc.read_text(encoding="utf-8").splitlines()
  fence, block_start = None, 0
  folders: dict[int, tuple[str, ...]] = {}
  entry_at: dict[int, str] = {}
  for i, line in enumerate(lines):
    m = FENCE.match(line.strip())
    if m and fence is None:
      fence, block_start = m.group(1), i + 1
    elif line.strip() == "```" and fence is not None:
      if fence == "tree":
        entries = tree_entries(lines[block_start:i])
        for n, (j, name, ancestors) in enumerate(entries):
          end = entries[n + 1][0] if n + 1 < len(entries) else i - block_start
          own = ancestors + ((name,) if name.endswith("/") else ())
          for k in range(j, end):
            folders[block_start + k] = own
          entry_at[block_start + j] = "".join(ancestors) + name
      fence = None
  for i, line in enumerate(lines):
    yield i + 1, line, folders.get(i, ()), entry_at.get(i)


def design_tree() -> set[str]:
  """Every entry of DESIGN.md's ```tree blocks, as a path from the repository root."""
  return {entry.rstrip("/") for _, _, _, entry in doc_lines(DESIGN) if entry is not None}


# --- resolving a name ---------------------------------------------------------------------

def _exists(base: pathlib.Path, token: str) -> bool:
  if any(ch in token for ch in "*?["):
    return any(base.glob(token))
  if "{" in token:  # a{b,c}: every alternative
    head, rest = token.split("{", 1)
    alts, tail = rest.split("}", 1)
    return all(_exists(base, head + alt + tail) for alt in alts.split(","))
  return (base / token).exists()


def resolve(token: str, doc: pathlib.Path, context: list[str]) -> str | None:
  """The path (from the repository root) a token names, or None where nothing matches."""
  bases = [REPO / c for c in reversed(context)] + [REPO / b for b in BASES] + [doc.parent]
  for base in bases:
    if _exists(base, token.rstrip("/")):
      return _rel(base / token.rstrip("/"))
  return None


def is_checked_path(token: str) -> bool:
  if "<" in token or ">" in token or token.startswith(NOT_REPO) or token.startswith("."):
    return False
  if token.split("/")[0] in TOP_FOLDERS and "/" in token:
    return True
  if token.endswith("/"):
    return bool(re.fullmatch(r"[a-z_][\w./{},-]*/", token))
  suffix = pathlib.PurePosixPath(token).suffix
  stem = pathlib.PurePosixPath(token).stem
  return suffix in SOURCE_EXT and bool(stem) and not stem.startswith("*")


def dotted_resolves(name: str) -> bool:
  parts = name.split(".")
  path = REPO / parts[0]
  for i, part in enumerate(parts[1:], start=1):
    if (path / part).is_dir() and (path / part / "__init__.py").exists():
      path = path / part
    elif (path / f"{part}.py").exists():
      path = path / f"{part}.py"
    else:
      source = path / "__init__.py" if path.is_dir() else path
      return source.exists() and re.search(rf"\b{re.escape(part)}\b",
                                           source.read_text(encoding="utf-8")) is not None
  return True


def names_a_test_module(name: str) -> bool:
  if name.endswith("*"):
    return any((REPO / "tests").glob(f"{name}.py"))
  return (REPO / "tests" / f"{name}.py").exists()


def unresolved(doc: pathlib.Path) -> list[str]:
  bad = []
  for lineno, line, folders, entry in doc_lines(doc):
    text = URL.sub(" ", line)
    if entry is not None:  # a tree entry exists where the tree puts it, and nowhere else
      if not _exists(REPO, entry.rstrip("/")):
        bad.append(f"{_rel(doc)}:{lineno}: {entry.rstrip('/').rsplit('/', 1)[-1]}")
      text = text.replace(entry.rsplit("/", 2)[-2 if entry.endswith("/") else -1], " ", 1)
    context = ["".join(folders[:n + 1]).rstrip("/") for n in range(len(folders))]
    for m in PATH.finditer(text):
      token = m.group(1).rstrip(".,;:")
      token = re.sub(r"'s$", "", token)
      if not is_checked_path(token):
        if token.endswith("/") or "/" in token:
          context.append(token.rstrip("/"))
        continue
      found = resolve(token, doc, context)
      if found is None:
        bad.append(f"{_rel(doc)}:{lineno}: {token}")
        continue
      folder = found if token.endswith("/") else str(pathlib.PurePosixPath(found).parent)
      context.append(folder)
    for m in DOTTED.finditer(text):
      if not dotted_resolves(m.group(1)):
        bad.append(f"{_rel(doc)}:{lineno}: {m.group(1)}")
    for m in TEST_MODULE.finditer(text):
      if not names_a_test_module(m.group(1)):
        bad.append(f"{_rel(doc)}:{lineno}: {m.group(1)}")
  return bad


@pytest.mark.parametrize("doc", docs(), ids=_rel)
def test_every_named_path_exists(doc):
  bad = unresolved(doc)
  assert not bad, "named in the docs but not in the tree:\n" + "\n".join(bad)


# --- every module listed ------------------------------------------------------------------

def packages() -> list[pathlib.Path]:
  return sorted(p.parent for root in PACKAGE_ROOTS for p in (REPO / root).rglob("__init__.py")
                if "__pycache__" not in p.parts)


def test_every_module_is_listed():
  tree = design_tree()
  missing = []
  for package in packages():
    modules = sorted(p for p in package.iterdir()
                     if (p.suffix == ".py" and p.name != "__init__.py") or p.suffix == ".sh")
    readme = next(iter(sorted(package.glob("README*"))), None)
    if readme is not None:
      words = set(re.findall(r"[\w.-]+", readme.read_text(encoding="utf-8")))
      missing += [f"{_rel(m)} (not in {_rel(readme)})" for m in modules if m.name not in words]
    elif package.parts[len(REPO.parts)] in ("prism_jax", "pallas_kernels"):
      for entry in [package] + modules:
        if _rel(entry) not in tree:
          missing.append(f"{_rel(entry)} (not in docs/DESIGN.md's tree)")
    else:
      missing.append(f"{_rel(package)} (a package with no README to list its modules)")
  assert not missing, "modules not listed:\n" + "\n".join(missing)


def test_the_checks_can_fail(tmp_path):
  """The checker itself: a bogus path, module and test are caught; real ones pass."""
  doc = tmp_path / "README.md"
  doc.write_text("`prism_jax/model/lm.py`, `prism_jax/model/nope.py`, `x/nope.py`,\n"
                 "`prism_jax.train.run`, `prism_jax.train.nope`, `test_model`, `test_nope`\n"
                 "```tree\nprism_jax/\n  model/\n    lm.py\n    gone.py\n```\n")
  bad = {line.split(": ", 1)[1] for line in unresolved(doc)}
  assert bad == {"prism_jax/model/nope.py", "x/nope.py", "prism_jax.train.nope", "test_nope",
                 "gone.py"}, bad
