"""`--set` overrides: typed parsing, clear errors, config <-> dict round trip, the CLI."""

import dataclasses
import os
import subprocess
import sys

import pytest

from prism_jax.config import Config, preset, to_dict
from prism_jax.train import overrides

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_typed_overrides_apply():
  cfg = overrides.apply_overrides(preset("tiny"), [
      "model.k=4", "train.lr=1e-3", "model.remat=true", "model.mixture=normalized",
      "data.sources=a.txt, b/*.jsonl", "model.implementation=xla", "loss.lambda_r1=0",
      "mesh.data=2"])
  assert cfg.model.k == 4 and isinstance(cfg.model.k, int)
  assert cfg.train.lr == 1e-3 and cfg.model.remat is True
  assert cfg.model.mixture == "normalized"
  assert cfg.data.sources == ("a.txt", "b/*.jsonl")
  assert cfg.model.implementation == "xla" and cfg.loss.lambda_r1 == 0.0
  assert cfg.mesh.data == 2
  back = overrides.apply_overrides(cfg, ["model.implementation=none"])
  assert back.model.implementation is None
  # untouched fields keep the preset's values
  assert cfg.model.d_model == preset("tiny").model.d_model


def test_mapping_overrides_accept_typed_values():
  cfg = overrides.apply_overrides(Config(), {"model.k": 4, "train.lr": 1, "data.sources":
                                             ["x.txt"]})
  assert cfg.model.k == 4 and cfg.train.lr == 1.0 and cfg.data.sources == ("x.txt",)
  with pytest.raises(ValueError, match="model.k"):
    overrides.apply_overrides(Config(), {"model.k": 2.5})


def test_unknown_key_lists_valid_keys():
  with pytest.raises(ValueError) as e:
    overrides.apply_overrides(Config(), ["model.kk=3"])
  msg = str(e.value)
  assert "unknown config key 'model.kk'" in msg and "did you mean model.k" in msg
  assert "train.lr" in msg and "mesh.fsdp" in msg  # the valid keys are listed
  with pytest.raises(ValueError, match="unknown config key 'nosection'"):
    overrides.apply_overrides(Config(), ["nosection=1"])


@pytest.mark.parametrize("item, fragment", [
    ("model.k=eight", "expected int"),
    ("train.lr=fast", "expected float"),
    ("model.remat=maybe", "expected a bool"),
    ("model.mixture=convex", "expected one of 'raw', 'normalized'"),
    ("model.k", "expected KEY=VALUE"),
])
def test_ill_typed_values_are_clear_errors(item, fragment):
  with pytest.raises(ValueError, match=fragment):
    overrides.apply_overrides(Config(), [item])


def test_validation_still_runs_after_override():
  with pytest.raises(ValueError, match="k <= K"):
    overrides.apply_overrides(preset("tiny"), ["model.k=999"])


def test_config_dict_round_trip_and_diff():
  cfg = overrides.apply_overrides(preset("tiny"), ["data.sources=a.txt,b.txt", "model.k=3"])
  back = overrides.config_from_dict(to_dict(cfg))
  assert back == cfg
  diffs = overrides.config_diff(to_dict(cfg), dataclasses.replace(
      cfg, model=dataclasses.replace(cfg.model, k=5)))
  assert diffs == [("model.k", 3, 5)]
  with pytest.raises(ValueError, match="unknown to this version"):
    overrides.config_from_dict({**to_dict(cfg), "model": {**to_dict(cfg)["model"],
                                                          "bogus": 1}})


def test_cli_rejects_bad_set_before_training(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  for item, fragment in (("model.kk=3", "unknown config key 'model.kk'"),
                         ("train.steps=ten", "expected int")):
    proc = subprocess.run(
        [sys.executable, "-m", "prism_jax.cli", "train", f"--workdir={tmp_path}/w",
         f"--set={item}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert fragment in proc.stderr, proc.stderr[-2000:]
  assert not os.path.exists(tmp_path / "w")  # nothing was created
