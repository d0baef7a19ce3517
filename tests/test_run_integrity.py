"""Issue 57, items 2-4 and the training half of 7: one writer per run, one source of truth for
a run's architecture, every damaged checkpoint one line.

Each test reproduces a defect found on 14df241 (where it failed) and checks the fix:
an edited config item inside a checkpoint was loaded silently (now the digest covers it); an
edited config.json was exported to Hugging Face beside unchanged weights (now refused) and
ignored silently by readers (now one warning); a truncated, missing or mis-shaped array file
gave a TensorStore traceback (now one CheckpointCorruptError line naming the checkpoint and
the steps that load instead, from `prism_jax.load` and from every command); two writers on one
run corrupted each other (now the second fails at once, naming the holder; a dead holder's
lock is taken over with a note); a data error left an empty checkpoints/ and, 2 runs in 3,
an orbax traceback at exit.
"""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

import prism_jax
from prism_jax import run_lock
from prism_jax.hf import convert
from prism_jax.hf.gpt2_config import HFFormatError
from prism_jax.train import Checkpointer, CheckpointCorruptError, load_params, train
from prism_jax.train import integrity
from test_faults import _copy, trained  # noqa: F401  (the same 4-step run, this module's own)

PRISM = [sys.executable, "-m", "prism_jax.cli.main"]


def _edit_json(path, edit):
  with open(path) as f:
    obj = json.load(f)
  edit(obj)
  with open(path, "w") as f:
    json.dump(obj, f)


def _one_line(message: str) -> bool:
  return "\n" not in message.strip()


def _cli(*args, timeout=240):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  return subprocess.run(PRISM + list(args), capture_output=True, text=True, timeout=timeout,
                        env=env)


def _errors(stderr: str) -> list[str]:
  return [ln for ln in stderr.splitlines() if ln.startswith("error:")]


# ------------------------------------------------ one source of truth for the architecture

def test_edited_config_item_in_checkpoint_is_refused(trained, tmp_path):
  """k 8 -> 4 in the checkpoint's own config item: every proto/residual split would change;
  14df241 loaded it silently (the digest covered the arrays only)."""
  _, workdir, _ = trained
  run = _copy(workdir, tmp_path)
  _edit_json(os.path.join(run, "checkpoints", "4", "config", "metadata"),
             lambda c: c["model"].update(k=c["model"]["k"] // 2))
  with pytest.raises(CheckpointCorruptError) as err:
    prism_jax.load(run)
  msg = str(err.value)
  assert _one_line(msg) and "checkpoint 4 is damaged" in msg and "config" in msg
  assert "step= one of [2]" in msg
  _, _, cfg2, step = load_params(run, step=2)  # the intact checkpoint still loads
  assert step == 2 and cfg2.model.k == trained[0].model.k


def test_data_state_is_read_checked_like_the_config(trained, tmp_path):
  """Checkpointer.read_data_state: the saved data item back, and an edited one refused by
  its digest (the same check as the config item's)."""
  _, workdir, _ = trained
  run = _copy(workdir, tmp_path)
  ck = Checkpointer(run, read_only=True)
  try:
    state = ck.read_data_state(4)
    assert state["step"] == 4  # the loader's position
    _edit_json(os.path.join(run, "checkpoints", "4", "data", "metadata"),
               lambda d: d.update(step=d["step"] + 1))
    with pytest.raises(CheckpointCorruptError) as err:
      ck.read_data_state(4)
    assert _one_line(str(err.value)) and "data" in str(err.value)
    assert ck.read_data_state(2)["step"] == 2  # the intact checkpoint still reads
  finally:
    ck.close()


def test_edited_config_json_warns_readers_and_export_refuses(trained, tmp_path, caplog):
  """n_heads edited in config.json: 14df241's export-hf wrote it beside unchanged weights
  (exit 0) and its readers ignored the edit silently."""
  cfg, workdir, _ = trained
  run = _copy(workdir, tmp_path)
  _edit_json(os.path.join(run, "config.json"),
             lambda c: c["model"].update(n_heads=c["model"]["n_heads"] // 2))
  with caplog.at_level(logging.WARNING):
    _, _, got, _ = load_params(run)
  assert got.model.n_heads == cfg.model.n_heads  # the checkpoint's architecture
  warned = [r.getMessage() for r in caplog.records if "disagrees" in r.getMessage()]
  assert len(warned) == 1 and "model.n_heads" in warned[0] and _one_line(warned[0])
  with pytest.raises(HFFormatError, match=r"disagrees with checkpoint 4.*model\.n_heads"):
    convert.export_hf(run, str(tmp_path / "hf"))
  assert not os.path.exists(tmp_path / "hf") or not os.listdir(tmp_path / "hf")
  convert.export_hf(workdir, str(tmp_path / "hf_ok"))  # the untouched run still exports
  assert os.path.isfile(tmp_path / "hf_ok" / "config.json")


# ------------------------------------------------ damaged checkpoints: one line each

def _largest_file(root):
  files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
  return max(files, key=os.path.getsize)


def _truncate(run):
  big = _largest_file(os.path.join(run, "checkpoints", "4", "params"))
  with open(big, "r+b") as f:
    f.truncate(os.path.getsize(big) // 3)
  return big


def _missing_item(run):
  shutil.rmtree(os.path.join(run, "checkpoints", "4", "params"))


def _wrong_shape(run):
  """A consistent edit (config item and its digest agree) whose bank size no longer matches
  the saved arrays: the restore itself must fail, in one line."""
  step_dir = os.path.join(run, "checkpoints", "4")
  meta = os.path.join(step_dir, "config", "metadata")
  _edit_json(meta, lambda c: c["model"].update(num_prototypes=c["model"]["num_prototypes"] * 2))
  with open(meta) as f:
    new = json.load(f)
  _edit_json(os.path.join(step_dir, "digest", "metadata"),
             lambda d: d.update(config=integrity.json_digest(new)))


@pytest.mark.parametrize("damage", [_truncate, _missing_item, _wrong_shape])
def test_damaged_checkpoint_is_one_typed_line(trained, tmp_path, damage):
  _, workdir, _ = trained
  run = _copy(workdir, tmp_path)
  damage(run)
  with pytest.raises(CheckpointCorruptError) as err:
    prism_jax.load(run)
  msg = str(err.value)
  assert _one_line(msg), msg
  assert msg.startswith("checkpoint 4 is damaged") and "step= one of [2]" in msg, msg
  assert os.path.join(run, "checkpoints", "4") in msg


def test_truncated_checkpoint_from_commands(trained, tmp_path):
  """14df241: a 160-line TensorStore traceback and rc 1 from generate (and report, load)."""
  _, workdir, _ = trained
  run = _copy(workdir, tmp_path)
  _truncate(run)
  out = _cli("generate", f"--workdir={run}", "--prompt=alpha beta", "--max_new_tokens=2")
  assert out.returncode == 2, out.stderr[-2000:]
  assert "Traceback" not in out.stderr, out.stderr[-2000:]
  errs = _errors(out.stderr)
  assert len(errs) == 1 and "checkpoint 4 is damaged" in errs[0] and "[2]" in errs[0]


# ------------------------------------------------ one writer per run

def _holder(workdir, tmp_path):
  """A process holding the run's lock until killed (its pid)."""
  script = (f"import sys, time; from prism_jax import run_lock\n"
            f"with run_lock.hold({workdir!r}, 'the holder'):\n"
            f"  print('held', flush=True); time.sleep(600)\n")
  proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
  assert proc.stdout.readline().strip() == "held"
  return proc


def test_second_writer_refused_naming_holder(trained, tmp_path, caplog):
  cfg, workdir, _ = trained
  run = _copy(workdir, tmp_path)
  before = sorted(os.listdir(os.path.join(run, "checkpoints")))
  proc = _holder(run, tmp_path)
  try:
    with pytest.raises(run_lock.RunLockedError) as err:
      train(cfg, run)
    msg = str(err.value)
    assert _one_line(msg) and "'the holder'" in msg and f"pid {proc.pid}" in msg
    out = _cli("train", f"--workdir={run}", "--config=tiny")  # the command: one line, at once
    assert out.returncode == 2 and len(_errors(out.stderr)) == 1
    assert f"pid {proc.pid}" in _errors(out.stderr)[0]
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == before
  finally:
    proc.kill()
    proc.wait()
  # its holder died: the lock is taken over with one note naming it
  with caplog.at_level(logging.WARNING):
    with run_lock.hold(run, "next"):
      with run_lock.hold(run, "nested"):  # reentrant within a process
        pass
  notes = [r.getMessage() for r in caplog.records if "taking over" in r.getMessage()]
  assert len(notes) == 1 and f"pid {proc.pid}" in notes[0] and "no longer running" in notes[0]
  with open(os.path.join(run, run_lock.LOCK_FILE)) as f:
    assert f.read() == ""  # released cleanly: nothing to take over next time


def test_data_error_leaves_no_checkpoints_nor_traceback(tmp_path):
  """14df241: after the one-line data error, 2 runs in 3 printed a 40-line orbax traceback
  ("cannot schedule new futures") and every run left an empty checkpoints/."""
  empty = tmp_path / "empty.txt"
  empty.write_text("")
  for i in range(3):
    run = tmp_path / f"run{i}"
    out = _cli("train", "--config=tiny", f"--data={empty}", f"--workdir={run}",
               "--set=train.steps=4", "--set=train.proto_init_step=2")
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and "cannot schedule" not in out.stderr, out.stderr
    assert len(_errors(out.stderr)) == 1 and "empty" in _errors(out.stderr)[0]
    assert not (run / "checkpoints").exists()


def test_a_refused_writer_waits_for_the_holders_identity(tmp_path):
  """The holder writes its identity just after taking the flock: a writer refused in that
  window read an empty file and named "another process" (seen once in 20 races)."""
  import fcntl  # pylint: disable=import-outside-toplevel
  import threading  # pylint: disable=import-outside-toplevel
  run = tmp_path / "run"
  run.mkdir()
  fd = os.open(run / run_lock.LOCK_FILE, os.O_RDWR | os.O_CREAT)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)  # taken; the identity comes 0.2 s later
    who = {"host": "h", "pid": 4242, "command": "late writer", "since": "now"}
    timer = threading.Timer(0.2, lambda: os.write(fd, json.dumps(who).encode()))
    timer.start()
    with pytest.raises(run_lock.RunLockedError, match="'late writer' \\(pid 4242"):
      with run_lock.hold(str(run)):
        pass
    timer.join()
  finally:
    os.close(fd)
