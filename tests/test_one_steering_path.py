"""One steering path (issue 56): gains are built and checked in prism_jax/control/steering.py
only, every caller delegates to it, the explorer samples and explains through generate.py,
and no module outside prism_jax/serve imports the server.

The source checks read the code with `ast` (in-function imports included), so a second
implementation (a `np.ones` gains vector filled elsewhere, a copy of the set format, a
sampler in the server) fails here. The behaviour checks draw fresh random gains, ids and
banks and compare every entry point with a NumPy reference written out below.
"""

import ast
import json
import pathlib
import secrets
import types

import jax.numpy as jnp
import numpy as np
import pytest

from prism_jax.cli import lm_eval_cli
from prism_jax.config import model_preset
from prism_jax.control import steering
from prism_jax.control.suppression import ProtoSet, model_fingerprint
from prism_jax.model.lm import build_model
from prism_jax.runs import Run
from prism_jax.serve import requests as rq
from prism_jax.serve.engine import Engine

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIB = ROOT / "prism_jax"
HOME = LIB / "control" / "steering.py"
# The one command that starts the server (`prism serve`) is its only importer outside it.
SERVE_IMPORTERS = {LIB / "cli" / "serve.py"}
# Names that only the one steering module may spell: the set formats and the refusals.
OWNED_TEXT = ("prism_jax.steering/1", "prism_jax.suppression_set/1", "prototype ids must",
              "gains must be", "must be finite and", "names prototype")
# Each caller and the steering functions it must call (by name through its imports).
CALLERS = {
    ("prism_jax/runs.py", "Run._steered"): {"gains_vector"},
    ("prism_jax/serve/requests.py", "gains"): {"gain_map"},
    ("prism_jax/serve/requests.py", "proto_id"): {"proto_id"},
    ("prism_jax/serve/engine.py", "Engine.gains"): {"gains_vector"},
    ("prism_jax/cli/lm_eval_cli.py", "read_gains"): {"gain_map", "read_set"},
    ("prism_jax/cli/generate.py", "main"): {"suppression_gains", "proto_id"},
    ("prism_jax/control/suppression.py", "check_ids"): {"check_ids"},
    ("prism_jax/control/suppression.py", "edit_args"): {"suppression_gains"},
    ("prism_jax/control/suppression.py", "suppressed_logits"): {"suppression_gains"},
    ("prism_jax/control/suppression.py", "ProtoSet.load"): {"check_fingerprint"},
}


def _modules():
  return sorted(p for p in LIB.rglob("*.py") if "__pycache__" not in p.parts)


def _tree(path: pathlib.Path) -> ast.Module:
  return ast.parse(path.read_text(), str(path))


def _name(node) -> str:
  """`a.b.c` of a Name/Attribute chain ('' for anything else)."""
  if isinstance(node, ast.Name):
    return node.id
  if isinstance(node, ast.Attribute):
    inner = _name(node.value)
    return f"{inner}.{node.attr}" if inner else ""
  return ""


def _gainish(node) -> bool:
  base = node.value if isinstance(node, ast.Subscript) else node
  name = _name(base).rsplit(".", 1)[-1].lower()
  return "gain" in name or name == "g"


def test_gains_are_built_and_checked_in_one_module():
  found = []
  for path in _modules():
    if path == HOME:
      continue
    rel, tree = path.relative_to(ROOT), _tree(path)
    docs = {id(n.body[0].value) for n in ast.walk(tree)  # prose may name the formats
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
      if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
        found += [f"{rel}:{node.lineno} spells {t!r}" for t in OWNED_TEXT if t in node.value]
      if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for t in targets:
          if not _gainish(t):
            continue
          if isinstance(t, ast.Subscript):  # g[i] = v: a vector filled by hand
            found.append(f"{rel}:{node.lineno} fills gains by index")
          calls = {_name(c.func).rsplit(".", 1)[-1] for c in ast.walk(node.value)
                   if isinstance(c, ast.Call)} if node.value is not None else set()
          if calls & {"ones", "ones_like", "full", "full_like"}:
            found.append(f"{rel}:{node.lineno} builds a gains vector")
  assert not found, "gains built or checked outside control/steering.py:\n" + "\n".join(found)
  # and the home does hold them (the scan would pass vacuously on a renamed module)
  home = HOME.read_text()
  assert all(t in home for t in OWNED_TEXT[:3]) and "np.ones(num_prototypes" in home


def _steering_names(tree: ast.Module) -> tuple[set[str], set[str]]:
  """(names bound to steering's functions, names bound to the steering module)."""
  funcs, mods = set(), set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module == "prism_jax.control.steering":
      funcs |= {a.asname or a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module == "prism_jax.control":
      mods |= {a.asname or a.name for a in node.names if a.name == "steering"}
  return funcs, mods


def _function(tree: ast.Module, qualname: str):
  scope = tree.body
  for part in qualname.split("."):
    node = next(n for n in scope if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                and n.name == part)
    scope = node.body
  return node


@pytest.mark.parametrize("where,wanted", CALLERS.items(), ids=[":".join(k) for k in CALLERS])
def test_each_caller_delegates_to_control_steering(where, wanted):
  path, qualname = where
  tree = _tree(ROOT / path)
  funcs, mods = _steering_names(tree)
  called = set()
  for node in ast.walk(_function(tree, qualname)):
    if isinstance(node, ast.Call):
      name = _name(node.func)
      head, _, attr = name.rpartition(".")
      if name in funcs:
        called.add(name)
      elif head.rsplit(".", 1)[-1] in mods:  # steering.f(...)
        called.add(attr)
  assert wanted <= called, f"{path}:{qualname} calls {sorted(called)}, not {sorted(wanted)}"


def test_the_server_is_imported_by_no_module_outside_it():
  importers = []
  for path in _modules():
    if LIB / "serve" in path.parents:
      continue
    for node in ast.walk(_tree(path)):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
               if isinstance(node, ast.ImportFrom) else [])
      if any(n == "prism_jax.serve" or n.startswith("prism_jax.serve.") for n in names):
        importers.append(path)
  assert set(importers) <= SERVE_IMPORTERS, sorted(map(str, set(importers) - SERVE_IMPORTERS))


def test_the_engine_samples_and_explains_through_generate():
  tree = _tree(LIB / "serve" / "engine.py")
  calls = {_name(n.func).rsplit(".", 1)[-1] for n in ast.walk(tree) if isinstance(n, ast.Call)}
  own = calls & {"categorical", "top_k", "sort", "decompose", "edited_trust",
                 "token_trust", "filter_logits", "top_k_filter", "gumbel"}
  assert not own, f"serve/engine.py samples or explains by itself: {sorted(own)}"
  assert {"sample_tokens", "explain_tokens", "controlled_logits"} <= calls


# ---- behaviour: every entry point gives the reference gains, and one refusal --------------

def _bank(num_protos: int, seed: int):
  cfg = model_preset("tiny", vocab_size=32, max_len=8, d_model=16, n_layers=1, n_heads=2,
                     num_prototypes=num_protos, k=2)
  return build_model(cfg, seed=seed)


def _case():
  seed = secrets.randbits(32)
  rng = np.random.default_rng(seed)
  num = int(rng.integers(8, 40))
  named = rng.choice(num, int(rng.integers(1, num // 2)), replace=False)
  gains = {int(i): float(np.round(rng.uniform(0, 3), 3)) for i in named}
  ids = rng.choice(num, int(rng.integers(1, 5))).tolist()  # repeats allowed
  return seed, rng, num, gains, ids


def _reference(num, gains=None, ids=(), base=None):
  """Float64 NumPy: ones (or base), times each named gain, zero on ids."""
  want = np.ones(num) if base is None else np.asarray(base, np.float64).copy()
  for i, g in (gains or {}).items():
    want[i] *= g
  want[list(ids)] = 0.0
  return want


def test_every_entry_point_builds_the_reference_gains(tmp_path):
  seed, rng, num, gains, ids = _case()
  msg = f"seed {seed}"
  model = _bank(num, seed % 2**16)
  fp = model_fingerprint(model)
  config = types.SimpleNamespace(model=types.SimpleNamespace(kind="prism", num_prototypes=num))
  run = Run(str(tmp_path), model, config, None)
  want = _reference(num, gains)
  np.testing.assert_allclose(steering.gains_vector(num, gains), want, rtol=1e-6, err_msg=msg)
  np.testing.assert_allclose(run.steer(gains).gains_K, want, rtol=1e-6, err_msg=msg)
  arr = rng.uniform(0, 2, num).astype(np.float32)
  np.testing.assert_allclose(run.steer(gains).steer(arr).gains_K, want * arr, rtol=1e-6,
                             err_msg=msg)
  np.testing.assert_allclose(run.suppress(ids).gains_K, _reference(num, ids=ids), err_msg=msg)
  np.testing.assert_array_equal(np.asarray(steering.suppression_gains(num, ids)),
                                _reference(num, ids=ids), err_msg=msg)
  # the explorer: string keys (JSON), zero-padded, and a saved set multiplying them
  body = {"gains": {f"{i:03d}": g for i, g in gains.items()},
          "steering_set": {"format": steering.SUPPRESSION_FORMAT, "ids": ids,
                           "fingerprint": fp}}
  served = rq.gains(body, num, fp)
  engine = types.SimpleNamespace(cfg=config.model)
  np.testing.assert_allclose(np.asarray(Engine.gains(engine, served)),
                             _reference(num, gains, ids), rtol=1e-6, err_msg=msg)
  # the files: the explorer's format written here, `prism suppress`'s by ProtoSet
  explorer_file = steering.save_set(str(tmp_path / "set.json"), gains, num, note="n")
  assert json.loads(open(explorer_file).read())["format"] == "prism_jax.steering/1"
  suppress_file = ProtoSet.create(model, sorted(set(ids))).save(str(tmp_path / "s.json"))
  for path, ref in ((explorer_file, want), (suppress_file, _reference(num, ids=ids))):
    got = lm_eval_cli.read_gains(path, run)
    np.testing.assert_allclose(steering.gains_vector(num, got), ref, rtol=1e-6, err_msg=msg)
    set_run = run.steer(steering_set=steering.read_set(path))
    np.testing.assert_allclose(set_run.gains_K, ref, rtol=1e-6, err_msg=msg)


@pytest.mark.parametrize("bad,message", [
    ({"K": 1.0}, r"prototype ids must be in \[0, K\), got \[K\]"),
    ({"x": 1.0}, "prototype ids must be integers"),
    ({1: -0.5}, r"gains must be finite and .*: prototype 1 has -0.5"),
    ({1: float("nan")}, "gains must be finite and"),
    ({1: "2"}, "the gain of prototype 1 must be a number"),
    ({"1": 1.0, "01": 2.0}, "gains names prototype 1 twice"),
])
def test_one_refusal_at_every_entry_point(tmp_path, bad, message):
  num = int(np.random.default_rng(secrets.randbits(32)).integers(4, 30))
  bad = {(num if k == "K" else k): v for k, v in bad.items()}
  message = message.replace("K", str(num))
  config = types.SimpleNamespace(model=types.SimpleNamespace(kind="prism", num_prototypes=num))
  run = Run(str(tmp_path), _bank(num, secrets.randbits(16)), config, None)
  with pytest.raises(ValueError, match=message):
    steering.gains_vector(num, bad)
  if all(isinstance(k, int) for k in bad):  # Python callers pass integer ids
    with pytest.raises(ValueError, match=message):
      run.steer(bad)
  json_keys = {str(k): v for k, v in bad.items()}
  if not any(isinstance(v, float) and np.isnan(v) for v in bad.values()):  # JSON has no NaN
    with pytest.raises(rq.BadRequest, match=message) as e:
      rq.gains({"gains": json_keys}, num, {})
    assert e.value.status == 400 and "\n" not in str(e.value)
    path = tmp_path / "set.json"
    path.write_text(json.dumps({"format": steering.FORMAT, "gains": json_keys}))
    with pytest.raises(ValueError, match=f"--gains={path}: {message}"):
      lm_eval_cli.read_gains(str(path), run)


def test_sets_are_checked_against_the_bank_and_their_format(tmp_path):
  seed = secrets.randbits(16)
  model, other = _bank(12, seed), _bank(12, seed + 1)
  saved = {"format": steering.SUPPRESSION_FORMAT, "ids": [1, 2],
           "fingerprint": model_fingerprint(model)}
  assert steering.gain_map(12, steering_set=saved, fingerprint=model_fingerprint(model)) == {
      1: 0.0, 2: 0.0}
  with pytest.raises(steering.ForeignSetError, match="saved for another model: bank_sha256"):
    steering.gain_map(12, steering_set=saved, fingerprint=model_fingerprint(other))
  with pytest.raises(rq.BadRequest) as e:
    rq.gains({"steering_set": saved}, 12, model_fingerprint(other))
  assert e.value.status == 409
  for bad, message in (("/etc/passwd", "not a path"), ([1], "must be a JSON object"),
                       ({"format": "other/9"}, "unknown steering set format"),
                       ({"gains": {}, "path": "x"}, "unknown field 'path'")):
    with pytest.raises(ValueError, match=message):
      steering.gain_map(12, steering_set=bad, fingerprint={})
  with pytest.raises(rq.BadRequest, match="steering_set must be a JSON object, got null"):
    rq.gains({"steering_set": None}, 12, {})
  with pytest.raises(FileNotFoundError, match="does not exist"):
    steering.read_set(str(tmp_path / "missing.json"))
  np.testing.assert_array_equal(  # a traced gains vector is accepted as an array form
      steering.gains_vector(3, jnp.asarray([0.0, 1.0, 2.0])), [0.0, 1.0, 2.0])
