"""Error paths that were noisy or uncaught (issue 57 item 7): a full disk at an atomic write
(no temp file left; one `error:` line naming the file), a malformed tokenizer.json (a
ValueError naming the file), `prism <command> --help` (that command's flags, exit 0), and a
copied run's attribution cache (reused: keyed on the data's content, not its path)."""
# pylint: disable=import-outside-toplevel,protected-access

import errno
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from prism_jax import paths
from prism_jax.cli import launcher

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)

# ------------------------------------------------------------------ a full disk


class FullDisk:
  """A file that open() creates (0 bytes, as on a full disk) and whose writes fail with
  ENOSPC; installed as `paths.open` (the module global shadows the builtin)."""

  def __init__(self, path, mode="r", *args, **kwargs):
    self._f = open(path, mode, *args, **kwargs)  # pylint: disable=unspecified-encoding

  def write(self, data):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self._f.close()


def test_full_disk_at_config_json_leaves_no_temp_file_and_names_the_file(tmp_path,
                                                                          monkeypatch):
  from prism_jax.config import preset
  from prism_jax.train import checkpoint
  monkeypatch.setattr(paths, "open", FullDisk, raising=False)
  with pytest.raises(OSError) as info:
    checkpoint.write_config(str(tmp_path), preset("tiny"))
  assert info.value.errno == errno.ENOSPC
  assert info.value.filename == str(tmp_path / "config.json")
  assert os.listdir(tmp_path) == []  # neither a 0-byte temp file nor a config.json


# A main whose write meets a full disk, run by the launcher as every `prism` command is.
FULL_DISK_SCRIPT = """
import os, sys
sys.path.insert(0, {tests!r})
from test_fault_paths import FullDisk
from prism_jax import paths
from prism_jax.cli import launcher
paths.open = FullDisk
def main(argv):
  paths.write_text_atomic(os.path.join(sys.argv[1], "config.json"), "{{}}")
launcher.run(main, ["prism train"])
"""


def test_launcher_reports_a_full_disk_as_one_line(tmp_path):
  script = FULL_DISK_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__)))
  res = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=REPO, env=ENV,
                       capture_output=True, text=True, timeout=120)
  errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
  assert res.returncode == 2 and len(errors) == 1, res.stderr[-3000:]
  assert "Traceback" not in res.stderr
  assert str(tmp_path / "config.json") in errors[0]
  assert "no space left on device" in errors[0]
  assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EROFS])
def test_disk_errors_are_user_errors_others_are_not(code):
  e = OSError(code, os.strerror(code), "/runs/x/config.json")
  assert launcher._is_user_error(e)
  assert launcher.one_line(e) == ("error: cannot write /runs/x/config.json: "
                                  + os.strerror(code).lower())
  assert not launcher._is_user_error(OSError(errno.EIO, "I/O error"))


# ------------------------------------------------------------------ tokenizer files


def _bpe_json() -> str:
  from prism_jax.data import tokenizers as tok_lib
  tok = tok_lib.train_bpe(["the for statement", "a while loop", "the token"] * 20, 300)
  return tok.hf_tokenizer.to_str()


@pytest.mark.parametrize("case", ["garbage", "truncated", "bad_model", "array"])
def test_a_malformed_tokenizer_file_is_one_line_naming_it(case, tmp_path):
  from prism_jax.data import tokenizers as tok_lib
  path = tmp_path / "tokenizer.json"
  if case == "garbage":
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff not json")
  elif case == "truncated":
    text = _bpe_json()
    path.write_text(text[:len(text) // 2])
  elif case == "bad_model":  # valid JSON that the tokenizers library refuses
    path.write_text(json.dumps({"model": {"type": "BPE", "vocab": 5}}))
  else:
    path.write_text("[1, 2]")
  with pytest.raises(ValueError) as info:
    tok_lib.load_tokenizer(str(tmp_path))
  msg = str(info.value)
  assert "\n" not in msg and len(msg) < 400, msg
  assert msg.startswith(f"{path}: not a valid tokenizer file"), msg


def test_a_runs_garbage_tokenizer_names_the_file(tmp_path):
  from prism_jax.data import run_tokenizer
  (tmp_path / "data").mkdir()
  (tmp_path / "data" / "tokenizer.json").write_text('{"prism_tokenizer": "byte", ')
  with pytest.raises(ValueError, match=re.escape(
      f"{tmp_path / 'data' / 'tokenizer.json'}: not a valid tokenizer file")):
    run_tokenizer(str(tmp_path), "")


def test_a_truncated_gpt2_vocab_in_the_hf_cache_names_the_file(tmp_path, monkeypatch):
  from prism_jax.data import pretrained
  snap = tmp_path / "hub" / "models--openai-community--gpt2" / "snapshots" / "abc123"
  snap.mkdir(parents=True)
  (snap / "vocab.json").write_text('{"!": 0, "\\"": 1, "#"')
  (snap / "merges.txt").write_text("#version: 0.2\n")
  monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
  with pytest.raises(ValueError, match=re.escape(
      f"{snap / 'vocab.json'}: not a valid tokenizer file (JSONDecodeError: ")):
    pretrained.hf_cache_files()


# ------------------------------------------------------------------ prism <command> --help

# Every command's --help in one process: absl flags are process-wide, so the flags a command
# defined are deleted before the next is imported. Prints {command: [code, stdout, own
# flags]}.
HELP_DRIVER = """
import contextlib, io, json
from absl import flags
from prism_jax.cli import main
out = {}
for name, (module, _) in main.COMMANDS.items():
  before = set(flags.FLAGS)
  runs = []
  for arg in ("--help", "-h"):
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
      try:
        main.main(["prism", name, "--workdir=x", arg])
        code = None
      except SystemExit as e:
        code = e.code
    runs.append((code, text.getvalue()))
  own = [f.name for f in flags.FLAGS.flags_by_module_dict().get(f"prism_jax.cli.{module}", [])]
  out[name] = [runs, own]
  for flag in set(flags.FLAGS) - before:
    delattr(flags.FLAGS, flag)
print("RESULTS " + json.dumps(out))
"""


def test_every_command_help_lists_its_own_flags():
  from prism_jax.cli import main as prism_main
  res = subprocess.run([sys.executable, "-c", HELP_DRIVER], cwd=REPO, env=ENV,
                       capture_output=True, text=True, timeout=300)
  line = [l for l in res.stdout.splitlines() if l.startswith("RESULTS ")]
  assert line, res.stderr[-3000:]
  results = json.loads(line[0][len("RESULTS "):])
  assert set(results) == set(prism_main.COMMANDS)
  for name, (runs, own) in results.items():
    assert own, name  # every command defines flags of its own
    for code, text in runs:
      assert code == 0, (name, text)
      assert text.startswith(f"usage: prism {name}"), (name, text[:300])
      missing = [f for f in own if not re.search(rf"--(\[no\])?{f}:", text)]
      assert not missing, (name, missing, text)
      assert "--debug" in text or "--[no]debug" in text, name


def test_prism_help_is_still_the_command_index():
  res = subprocess.run([sys.executable, "-m", "prism_jax.cli", "--help"], cwd=REPO, env=ENV,
                       capture_output=True, text=True, timeout=120)
  assert res.returncode == 0 and "commands:" in res.stdout and "train" in res.stdout


def test_help_after_double_dash_is_the_other_programs():
  assert launcher._wants_help(["prism lm-eval", "--workdir=x", "-h"])
  assert not launcher._wants_help(["prism lm-eval", "--workdir=x", "--", "--help"])


# ------------------------------------------------------------------ a copied run's cache


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
  import tiny_run
  return tiny_run.tiny_run(tmp_path_factory)


def _mtimes(directory) -> dict:
  return {os.path.relpath(os.path.join(root, f), directory):
          os.stat(os.path.join(root, f)).st_mtime_ns
          for root, _, files in os.walk(directory) for f in files}


def test_a_copied_run_reuses_its_attribution_cache(shared, tmp_path, monkeypatch):
  from prism_jax.attribution.caching import cache as cache_lib
  from prism_jax.attribution.scoring import influence
  from prism_jax.data import PackedData, prepare_data
  model, cfg = shared["model"], shared["cfg"]
  # The shared run with its cache where `prism attribute` keeps it, then copied elsewhere.
  first = tmp_path / "first"
  shutil.copytree(shared["run"], first)
  shutil.copytree(shared["root"] / "cache", first / "attribution_cache")
  second = tmp_path / "moved" / "second"
  shutil.copytree(first, second)
  cache_dir = second / "attribution_cache"
  before = _mtimes(cache_dir)

  def no_build(*args, **kwargs):
    raise AssertionError("the copied run's cache was rebuilt")
  monkeypatch.setattr(cache_lib, "build_cache", no_build)
  packed = prepare_data(cfg.data, cfg.model.vocab_size, str(second))
  assert packed.path == str(second / "data")
  cache = cache_lib.open_or_build(model, cfg, packed, str(cache_dir))
  assert _mtimes(cache_dir) == before
  ids = shared["tok"].encode("the for statement of the token")
  want = influence.attribute(model, shared["cache"], ids, [len(ids) - 1],
                             packed=shared["packed"])
  got = influence.attribute(model, cache, ids, [len(ids) - 1], packed=packed)
  np.testing.assert_array_equal(got.example_ids, want.example_ids)
  np.testing.assert_array_equal(got.scores, want.scores)

  # Data whose content changed (re-packed from other text: another source hash) is not
  # served the old cache.
  built = []
  monkeypatch.setattr(cache_lib, "build_cache", lambda *a, **k: built.append(a[3]))
  meta_path = second / "data" / "metadata.json"
  meta = json.loads(meta_path.read_text())
  meta["source_hash"] = "0" * 64
  meta_path.write_text(json.dumps(meta))
  cache_lib.open_or_build(model, cfg, PackedData(str(second / "data")), str(cache_dir))
  assert built == [str(cache_dir)]


def test_a_cache_keyed_on_the_data_path_is_rebuilt_with_one_log_line(shared, tmp_path,
                                                                       caplog):
  from prism_jax.attribution.caching import cache_build, cache_format
  model, cfg, packed = shared["model"], shared["cfg"], shared["packed"]
  cache_dir = tmp_path / "cache"
  shutil.copytree(shared["root"] / "cache", cache_dir)
  meta_path = cache_dir / cache_format.METADATA
  meta = json.loads(meta_path.read_text())
  # as an older prism_jax wrote it: the data named by its path
  meta["identity"]["data"] = {"path": packed.path, "pack": packed.metadata["config"]}
  meta_path.write_text(json.dumps(meta))
  ident = cache_format.identity(model, cfg, cache_format.CacheConfig(batch_rows=8), packed)
  with caplog.at_level("INFO"):
    cache_build._claim(str(cache_dir), ident, False, False, str(meta_path))
  lines = [r.getMessage() for r in caplog.records if "names its data by path" in r.getMessage()]
  assert len(lines) == 1 and str(cache_dir) in lines[0]
  after = json.loads(meta_path.read_text())  # cleared, to be built afresh
  assert not after["complete"] and not cache_format.diff(after["identity"], ident)
  assert not (cache_dir / "g").exists()
  # a cache of another model keyed on the path is still refused, not silently replaced
  meta["identity"]["model_fingerprint"] = "f" * 64
  meta_path.write_text(json.dumps(meta))
  with pytest.raises(cache_format.CacheMismatchError, match="model_fingerprint"):
    cache_build._claim(str(cache_dir), ident, False, False, str(meta_path))
