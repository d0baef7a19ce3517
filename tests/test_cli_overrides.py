"""`--set` overrides: typed parsing, clear errors, config <-> dict round trip, the CLI."""

import dataclasses
import os
import subprocess
import sys

import pytest

from prism_jax.config import Config, preset, to_dict
from prism_jax.config import overrides

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
    overrides.apply_overrides(preset("tiny"), ["model.k=4096"])


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


@pytest.mark.long  # make test-long (issue 56 item 7): two `prism train` runs
def test_a_run_started_from_a_runs_config_json_trains_like_the_original(tmp_path):
  from prism_jax.train import train  # pylint: disable=import-outside-toplevel
  from prism_jax.config import build_config  # pylint: disable=import-outside-toplevel
  from prism_jax.train.metrics import read_metrics  # pylint: disable=import-outside-toplevel
  sets = ["train.steps=4", "train.batch_size=8", "train.proto_init_step=2",
          "train.eval_every=4", "train.eval_batches=1", "train.log_every=1",
          "model.num_prototypes=32", "model.k=4", "data.seq_len=32"]
  first = build_config("tiny", None, None, sets)
  train(first, str(tmp_path / "a"))
  again = build_config(str(tmp_path / "a" / "config.json"))
  assert overrides.config_diff(first, again) == []
  train(again, str(tmp_path / "b"))
  losses = [{r["step"]: r["loss"] for r in read_metrics(str(tmp_path / d), "train")}
            for d in ("a", "b")]
  assert losses[0] == losses[1] and len(losses[0]) == 4  # bit for bit (JSON keeps float32)
  # a YAML file of the differences from the defaults, with --set on top
  (tmp_path / "c.yaml").write_text("model: {d_model: 64, n_heads: 2}\ntrain: {steps: 7}\n")
  cfg = build_config(str(tmp_path / "c.yaml"), sets=["train.lr=0.01"])
  assert (cfg.model.d_model, cfg.train.steps, cfg.train.lr) == (64, 7, 0.01)


@pytest.mark.parametrize("text,fragment", [
    ("model: {dmodel: 64}\n", "unknown to this version of prism_jax: ['model.dmodel']"),
    ("a: [\n", "not valid YAML"), ("- 1\n", "must hold a mapping"),
    ("model: {k: 2.5}\n", "model.k")])
def test_a_bad_config_file_is_one_line(tmp_path, text, fragment):
  path = tmp_path / "bad.yaml"
  path.write_text(text)
  r = subprocess.run([sys.executable, "-m", "prism_jax.cli", "config", f"--config={path}"],
                     capture_output=True, text=True, cwd=REPO, timeout=120,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
  assert r.stderr.startswith("error: ") and fragment in r.stderr, r.stderr
