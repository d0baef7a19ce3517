"""`--config=` as a preset name or a config file, then `--set` overrides on top.

  cfg = resolve_config("tiny", ["train.steps=100"])                 # a preset
  cfg = resolve_config("runs/x/config.json", ["train.lr=1e-3"])     # a run's own config
  cfg = resolve_config("exp/pod.yaml", [])                           # a YAML file

A file (a path ending in .json, .yaml or .yml) holds the nested config dict that
`prism_jax.config.to_dict` writes (every run's config.json is one): unknown keys are an
error naming them, keys it leaves out take their defaults (so a short YAML file holds only
what differs from the defaults). A preset is built for the step count of a train.steps
override, as `preset(name, steps)` places a GPT-2 recipe's warm-up, bank init, evals and
checkpoints in that run; a file's values stand as written (its train.steps override
changes train.steps alone). Paths may be local or gs://.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from prism_jax import paths
from prism_jax.config import Config, preset
from prism_jax.config.overrides import apply_overrides, config_from_dict, parse_override

FILE_SUFFIXES = (".json", ".yaml", ".yml")


def is_config_file(name: str) -> bool:
  return name.lower().endswith(FILE_SUFFIXES)


def load_config_file(path: str) -> Config:
  """The Config a JSON or YAML file describes; a clear one-line error for a bad file."""
  p = paths.path(path)
  if not p.is_file():
    raise FileNotFoundError(f"--config={path}: no such config file")
  text = p.read_text()
  try:
    if path.lower().endswith(".json"):
      data = json.loads(text)
    else:
      import yaml  # pylint: disable=g-import-not-at-top  (deferred: a YAML file only)
      data = yaml.safe_load(text)
  except ValueError as e:  # json.JSONDecodeError and yaml.YAMLError's parse errors
    raise ValueError(f"--config={path}: not valid {'JSON' if path.endswith('.json') else 'YAML'}"
                     f": {str(e).splitlines()[0]}") from None
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f"--config={path}: not valid YAML: {str(e).splitlines()[0]}") from None
  if not isinstance(data, dict):
    raise ValueError(f"--config={path}: the file must hold a mapping of sections "
                     f"(model, loss, data, train, mesh), got {type(data).__name__}")
  try:
    return config_from_dict(data)
  except ValueError as e:
    raise ValueError(f"--config={path}: {e}") from None


def resolve_config(name_or_path: str, sets: Sequence[str] = ()) -> Config:
  """A preset name or a config file (see the module doc), then the overrides."""
  if is_config_file(name_or_path):
    return apply_overrides(load_config_file(name_or_path), list(sets))
  steps = None
  for item in sets:
    key, value = parse_override(item)
    if key == "train.steps" and value.isdigit() and int(value) > 0:
      steps = int(value)  # anything else: apply_overrides names the bad value
  return apply_overrides(preset(name_or_path, steps), list(sets))


def build_config(name_or_path: str, data: str | None = None, model: str | None = None,
                 sets: Sequence[str] = ()) -> Config:
  """What `prism train` / `prism config` build from --config, --data, --model and --set
  (an explicit --set wins over --data / --model)."""
  items = []
  if data:
    items.append(f"data.sources={data}")
  if model:
    items.append(f"model.kind={model}")
  return resolve_config(name_or_path, items + list(sets))
