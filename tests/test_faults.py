"""Fault injection (issue 13): each fault gives a clear error or a correct fallback, and no
good file is lost. Kill -9 during training and saves: tests/test_train_resume.py and
tests/test_attribution.py (unchanged).

Checkpoints: 64 flipped bytes in parameter / optimizer data (read silently by orbax, caught
by the digests), a truncated metadata file, a non-finite restored state, every checkpoint
corrupt (refused, then --start_over), an old checkpoint without digests. Output dirs: a cache
pointed at the run's data or the run itself (with and without --rebuild). Inputs: token ids
out of range, float64 into the kernel, a relative packed_dir used from another cwd, a
non-parquet file named .parquet.
"""

import filecmp
import hashlib
import logging
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from prism_jax import generate as gen_lib
from prism_jax import io_guard
from prism_jax.attribution.caching import cache as cache_lib
from prism_jax.attribution.scoring import influence
from prism_jax.config import LossConfig
from prism_jax.data import load_documents, prepare_data
from prism_jax.model.lm import decompose
from prism_jax.loading import load_for_inference
from prism_jax.train import (CheckpointCorruptError, Checkpointer, NoReadableCheckpointError,
                             load_params, read_metrics, train)
from prism_jax.train.optimizer import make_optimizer
from prism_jax.train.state import abstract_state, default_mesh
from test_checkpoint_bad_inputs import _cfg, _corpus

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  root = tmp_path_factory.mktemp("faults")
  data = _corpus(root / "corpus.txt")
  cfg = _cfg(data)
  assert train(cfg, str(root / "run")).final_step == 4
  return cfg, str(root / "run"), data


def _copy(src, tmp_path, name="copy"):
  dst = str(tmp_path / name)
  shutil.copytree(src, dst)
  return dst


def _tree_hash(path):
  """SHA-256 of every file under path (relative names + bytes): 'nothing changed'."""
  h = hashlib.sha256()
  for root, dirs, files in sorted(os.walk(path)):
    dirs.sort()
    for name in sorted(files):
      full = os.path.join(root, name)
      h.update(os.path.relpath(full, path).encode())
      with open(full, "rb") as f:
        h.update(f.read())
  return h.hexdigest()


def _readable(item_dir) -> bool:
  """Whether every array of an orbax item (OCDBT, zarr v2 or v3 arrays) decodes."""
  import tensorstore as ts  # pylint: disable=import-outside-toplevel
  base = {"driver": "ocdbt", "base": f"file://{item_dir}"}
  keys = [k.decode() for k in ts.KvStore.open(base).result().list().result()]
  arrays = [(k.rsplit("/", 1)[0], "zarr" if k.endswith("/.zarray") else "zarr3")
            for k in keys if k.endswith(("/.zarray", "/zarr.json"))]
  assert arrays, keys[:5]
  try:
    for name, driver in arrays:
      ts.open({"driver": driver, "kvstore": dict(base, path=name + "/")}).result().read(
          ).result()
  except ValueError:
    return False
  return True


def _flip(run, step, item, frac=0.5, n=64):
  """XORs n contiguous bytes near the middle (`frac`) of `item`'s largest data file of
  checkpoint `step`, where orbax reads them back without complaint. The file holds zstd
  frames, one per chunk: a flip inside one mostly decodes to other values, but now and then
  breaks the frame (an unreadable checkpoint, another fault); such a place is undone and
  the next one tried, so the fault is the same on every run."""
  item_dir = os.path.join(run, "checkpoints", str(step), item)
  d = os.path.join(item_dir, "ocdbt.process_0", "d")
  big = max((os.path.join(d, f) for f in os.listdir(d)), key=os.path.getsize)
  raw = bytes(open(big, "rb").read())
  mid = int(len(raw) * frac)
  for off in [mid] + [mid + s * 97 * i for i in range(1, 40) for s in (1, -1)]:
    flipped = bytearray(raw)
    for i in range(off, off + n):
      flipped[i] ^= 0x5A
    with open(big, "wb") as f:
      f.write(bytes(flipped))
    if _readable(item_dir):
      return
  raise AssertionError(f"no silent place for a flip in {big}")


def _errors(caplog):
  return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def _same_losses(a, b):
  return ({r["step"]: r["loss"] for r in read_metrics(a)}
          == {r["step"]: r["loss"] for r in read_metrics(b)})


# ------------------------------------------------------------------ checkpoints

def test_flipped_param_bytes_load_silently_without_digests(trained, tmp_path):
  """The fault of case 1 is real: orbax alone restores the damaged array without error."""
  cfg, workdir, _ = trained
  run = _copy(workdir, tmp_path)
  _flip(run, 4, "params")
  mesh = default_mesh(cfg)
  target = abstract_state(cfg, mesh).params
  ck = Checkpointer(run, read_only=True)
  try:
    with jax.set_mesh(mesh):
      raw = ck.manager.restore(4, args=ocp.args.Composite(
          params=ocp.args.StandardRestore(target)))["params"]
      with pytest.raises(CheckpointCorruptError, match="checksum mismatch in .*params"):
        ck.restore_params(4, target)
  finally:
    ck.manager.close()
  with pytest.raises(CheckpointCorruptError, match=r"checkpoint 4 is damaged: checksum "
                     r"mismatch .*params.* load another one \(step= one of \[2\]\)"):
    load_for_inference(run)
  _, good, _, _ = load_params(workdir, step=4)
  assert not all(np.array_equal(np.asarray(a), np.asarray(b))
                 for a, b in zip(jax.tree.leaves(raw), jax.tree.leaves(good)))


@pytest.mark.parametrize("item", ["params", "opt"])
def test_flipped_bytes_quarantined_and_fall_back(trained, tmp_path, caplog, item):
  cfg, workdir, _ = trained
  run = _copy(workdir, tmp_path)
  _flip(run, 4, item)
  flipped = _tree_hash(os.path.join(run, "checkpoints", "4"))
  with caplog.at_level(logging.ERROR):
    summary = train(cfg, run)
  assert summary.start_step == 2 and summary.final_step == 4
  msgs = _errors(caplog)
  assert any("checkpoint 4" in m and "is corrupt" in m and "checksum mismatch in" in m
             and f"/{item}:" in m and "falling back" in m for m in msgs), msgs
  moved = os.listdir(os.path.join(run, "corrupt_checkpoints"))
  assert len(moved) == 1 and moved[0].startswith("4-")
  # the damaged checkpoint is kept byte for byte; checkpoint 2 was not touched
  assert _tree_hash(os.path.join(run, "corrupt_checkpoints", moved[0])) == flipped
  assert not filecmp.dircmp(os.path.join(workdir, "checkpoints", "2"),
                            os.path.join(run, "checkpoints", "2")).diff_files
  assert _same_losses(workdir, run)  # steps 3..4 re-trained from 2 reproduce the run


@pytest.mark.parametrize("name", ["params/_METADATA", "digest/metadata"])
def test_truncated_metadata_falls_back(trained, tmp_path, caplog, name):
  cfg, workdir, _ = trained
  run = _copy(workdir, tmp_path)
  meta = os.path.join(run, "checkpoints", "4", name)
  with open(meta, "r+b") as f:
    f.truncate(os.path.getsize(meta) // 2)
  with caplog.at_level(logging.ERROR):
    summary = train(cfg, run)
  assert summary.start_step == 2
  assert any("checkpoint 4" in m and "unreadable" in m for m in _errors(caplog))
  assert os.listdir(os.path.join(run, "corrupt_checkpoints"))[0].startswith("4-")


def test_truncated_checkpoint_metadata_alone_still_verifies(trained, tmp_path):
  """orbax's _CHECKPOINT_METADATA is bookkeeping (handler names, timestamps): truncated, it
  is logged by orbax and the arrays, verified against their digests, are still used."""
  cfg, workdir, _ = trained
  run = _copy(workdir, tmp_path)
  meta = os.path.join(run, "checkpoints", "4", "_CHECKPOINT_METADATA")
  with open(meta, "r+b") as f:
    f.truncate(os.path.getsize(meta) // 2)
  assert train(cfg, run).start_step == 4
  assert not os.path.exists(os.path.join(run, "corrupt_checkpoints"))
  _, params, _, _ = load_params(run)
  _, good, _, _ = load_params(workdir)
  assert all(np.array_equal(np.asarray(a), np.asarray(b))
             for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(good)))


def test_non_finite_restored_state_is_corruption_not_divergence(trained, tmp_path, caplog):
  """A checkpoint holding a NaN (digest consistent with it: e.g. bad memory before the
  save) is quarantined as corrupt; training falls back, it does not report a divergence."""
  cfg, workdir, data = trained
  run = _copy(workdir, tmp_path)
  mesh = default_mesh(cfg)
  tx = make_optimizer(cfg.train)
  ck = Checkpointer(run, async_save=False)
  with jax.set_mesh(mesh):
    state, data_state = ck.restore(4, abstract_state(cfg, mesh, tx))
    wte = state.params["backbone"]["wte"]
    state.params["backbone"]["wte"] = wte.at[3, 5].set(jnp.nan)
    ck.save(6, state, data_state, cfg)
  ck.close()
  longer = _cfg(data, "train.steps=6")
  with caplog.at_level(logging.ERROR):
    summary = train(longer, run, allow_config_change=("train.steps",))
  assert summary.start_step == 4 and summary.final_step == 6
  assert any("checkpoint 6" in m and "is corrupt" in m and "non-finite values restored"
             in m and "['backbone']['wte']" in m for m in _errors(caplog))


def test_every_checkpoint_corrupt_is_refused_until_start_over(trained, tmp_path, caplog):
  cfg, workdir, _ = trained
  run = _copy(workdir, tmp_path)
  _flip(run, 4, "params")
  _flip(run, 2, "params")
  with pytest.raises(NoReadableCheckpointError) as e:
    train(cfg, run)
  msg = str(e.value)
  moved = sorted(os.listdir(os.path.join(run, "corrupt_checkpoints")))
  assert [m.split("-")[0] for m in moved] == ["2", "4"]
  assert "no readable checkpoint left" in msg and "--start_over" in msg
  assert all(os.path.join(run, "corrupt_checkpoints", m) in msg for m in moved)
  with pytest.raises(NoReadableCheckpointError):  # still refused on a second attempt
    train(cfg, run)
  summary = train(cfg, run, start_over=True)
  assert summary.start_step == 0 and summary.final_step == 4
  assert sorted(os.listdir(os.path.join(run, "corrupt_checkpoints"))) == moved  # kept
  assert _same_losses(workdir, run)


@pytest.mark.long  # make test-long (issue 56 item 7): `prism train` subprocesses
def test_start_over_flag_of_the_cli(trained, tmp_path):
  cfg, workdir, data = trained
  run = _copy(workdir, tmp_path)
  for step in (2, 4):
    shutil.move(os.path.join(run, "checkpoints", str(step)),
                os.path.join(run, f"moved{step}"))
  os.makedirs(os.path.join(run, "corrupt_checkpoints", "4-x"))
  from test_checkpoint_bad_inputs import SETS  # pylint: disable=import-outside-toplevel
  cmd = [sys.executable, "-m", "prism_jax.cli", "train", f"--data={data}", f"--workdir={run}",
         *[f"--set={s}" for s in SETS + ["train.steps=1"]]]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert res.returncode != 0 and "no readable checkpoint left" in res.stderr
  res = subprocess.run(cmd + ["--start_over"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=300)
  assert res.returncode == 0, res.stderr[-2000:]


def test_checkpoint_without_digests_loads_with_warning(trained, tmp_path, caplog):
  cfg, workdir, _ = trained
  run = _copy(workdir, tmp_path)
  shutil.rmtree(os.path.join(run, "checkpoints", "4", "digest"))
  with caplog.at_level(logging.WARNING):
    _, params, _, step = load_params(run)
  assert step == 4
  assert any("checkpoint 4" in r.getMessage() and "no checksums" in r.getMessage()
             for r in caplog.records)
  _, good, _, _ = load_params(workdir)
  assert all(np.array_equal(np.asarray(a), np.asarray(b))
             for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(good)))


# ------------------------------------------------------------------ output directories

def test_cache_into_run_data_or_run_dir_is_refused(trained, tmp_path):
  cfg, workdir, _ = trained
  run = _copy(workdir, tmp_path)
  model, _, _ = load_for_inference(run)
  packed = prepare_data(cfg.data, cfg.model.vocab_size, run)
  before = _tree_hash(run)
  for target, what in ((packed.path, "packed-data directory"),
                       (run, "training run directory")):
    for rebuild in (False, True):
      with pytest.raises(io_guard.OutputDirError) as e:
        cache_lib.build_cache(model, cfg, packed, target, overwrite=rebuild, progress=False)
      assert target in str(e.value) and what in str(e.value)
  assert _tree_hash(run) == before  # nothing written, nothing deleted
  assert train(cfg, run).final_step == 4  # the run still resumes


def test_attribute_cli_rebuild_into_data_dir_is_refused(trained, tmp_path):
  """Case 3 exactly: prism attribute --cache_dir=<run>/data --rebuild."""
  _, workdir, _ = trained
  run = _copy(workdir, tmp_path)
  before = _tree_hash(run)
  res = subprocess.run(
      [sys.executable, "-m", "prism_jax.cli", "attribute", f"--workdir={run}", "--prompt=alpha",
       f"--cache_dir={os.path.join(run, 'data')}", "--rebuild"],
      cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
      timeout=300)
  assert res.returncode != 0
  assert "refusing to write the attribution cache" in res.stderr
  assert "packed-data directory" in res.stderr and "Traceback" not in res.stderr
  assert _tree_hash(run) == before


def test_claim_output_dir_kinds(tmp_path):
  own = str(tmp_path / "cards")
  assert io_guard.claim_output_dir(own, "cards") == own
  with open(os.path.join(own, "a.json"), "w") as f:
    f.write("{}")
  io_guard.claim_output_dir(own, "cards")  # resume: kept
  assert os.path.exists(os.path.join(own, "a.json"))
  with pytest.raises(io_guard.OutputDirError, match="holds a cards"):
    io_guard.claim_output_dir(own, "report", rebuild=True)
  assert os.path.exists(os.path.join(own, "a.json"))
  io_guard.claim_output_dir(own, "cards", rebuild=True)  # rebuild empties only its own
  assert os.listdir(own) == [io_guard.MARKER]
  other = tmp_path / "notes"
  other.mkdir()
  (other / "todo.txt").write_text("keep me")
  with pytest.raises(io_guard.OutputDirError, match="not empty"):
    io_guard.claim_output_dir(str(other), "cards", rebuild=True)
  assert (other / "todo.txt").read_text() == "keep me"
  afile = tmp_path / "file"
  afile.write_text("x")
  with pytest.raises(io_guard.OutputDirError, match="not a directory"):
    io_guard.claim_output_dir(str(afile), "cards")


def test_packed_metadata_replaced_is_a_clear_error(trained, tmp_path):
  """What case 3 left behind before the guard: a foreign metadata.json in data/."""
  cfg, workdir, _ = trained
  run = _copy(workdir, tmp_path)
  meta = os.path.join(run, "data", "metadata.json")
  with open(meta, "w") as f:
    f.write('{"identity": {}, "complete": false}')
  with pytest.raises(ValueError, match="is not the metadata of a packed dataset"):
    train(cfg, run)


# ------------------------------------------------------------------ inputs

@pytest.fixture(scope="module")
def small_cache(trained, tmp_path_factory):
  cfg, workdir, _ = trained
  model, _, _ = load_for_inference(workdir)
  packed = prepare_data(cfg.data, cfg.model.vocab_size, workdir)
  out = str(tmp_path_factory.mktemp("cache") / "c")
  cache = cache_lib.build_cache(model, cfg, packed, out,
                                cache_lib.CacheConfig(max_rows=8, batch_rows=4),
                                progress=False)
  return model, cache, packed


@pytest.mark.parametrize("bad", [999999, -4, 258])
def test_out_of_range_token_ids_are_refused_everywhere(small_cache, bad):
  model, cache, _ = small_cache
  rng = np.random.default_rng(abs(bad))
  tokens = rng.integers(0, 258, 10)
  tokens[6] = bad
  want = r"must be in \[0, vocab_size=258\).*first at position (\(0, )?6\b"
  with pytest.raises(ValueError, match="query token ids " + want):
    influence.attribute_batch(model, cache, [(tokens, [3, 7])])
  with pytest.raises(ValueError, match="query token ids " + want):
    influence.attribute(model, cache, tokens, [7])
  with pytest.raises(ValueError, match="query token ids " + want):
    influence.query_sides(model, [(tokens, [7])], LossConfig())
  with pytest.raises(ValueError, match="prompt token ids " + want):
    next(influence.attribute_generation(model, cache, tokens, max_new_tokens=2))
  with pytest.raises(ValueError, match="prompt token ids " + want):
    gen_lib.generate(model, tokens[None], max_new_tokens=2)
  out = model(jnp.asarray(rng.integers(0, 258, (1, 10)), jnp.int32))
  with pytest.raises(ValueError, match="decompose target ids " + want):
    decompose(model, out.protos, tokens)


def test_float64_kernel_path_computes_in_float32():
  from pallas_kernels.topk_reconstruct import api  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(7)
  z64, p64 = rng.standard_normal((24, 32)), rng.standard_normal((12, 32))
  with jax.enable_x64(True):
    z, p = jnp.asarray(z64, jnp.float64), jnp.asarray(p64, jnp.float64)
    got = api.topk_reconstruct(z, p, 3, implementation="pallas_interpret")
    ref = api.topk_reconstruct(z, p, 3, implementation="xla")
    grad = jax.grad(lambda zz: jnp.sum(api.topk_reconstruct(
        zz, p, 3, implementation="pallas_interpret")[3] ** 2))(z)
  # The kernels have no float64 variant: they compute in float32; the XLA reference is
  # dtype-generic (float64 here), so the two agree to float32 rounding.
  assert got[3].dtype == jnp.float32 and ref[3].dtype == jnp.float64
  assert grad.dtype == jnp.float64 and np.all(np.isfinite(np.asarray(grad)))
  # independent float64 reference: top-3 cosine prototypes and their raw-mixture z_hat
  cos = (z64 / np.linalg.norm(z64, axis=1, keepdims=True)) @ \
      (p64 / np.linalg.norm(p64, axis=1, keepdims=True)).T
  idx = np.argsort(-cos, axis=1)[:, :3]
  assert np.array_equal(np.sort(np.asarray(got[0]), 1), np.sort(idx, 1))
  np.testing.assert_allclose(np.asarray(got[2]), np.take_along_axis(cos, np.asarray(got[0]), 1),
                             rtol=0, atol=1e-5)
  np.testing.assert_allclose(np.asarray(got[3]), np.asarray(ref[3]), rtol=1e-5, atol=1e-5)


def test_relative_packed_dir_works_from_any_cwd(tmp_path, monkeypatch):
  data = _corpus(tmp_path / "corpus.txt", seed=3)
  (tmp_path / "a").mkdir()
  (tmp_path / "x" / "elsewhere").mkdir(parents=True)
  monkeypatch.chdir(tmp_path / "a")
  cfg = _cfg(data, "data.packed_dir=../relpack", "train.steps=2")
  train(cfg, "run")
  workdir = str(tmp_path / "a" / "run")
  monkeypatch.chdir(tmp_path / "x" / "elsewhere")
  _, saved_cfg, tok = load_for_inference(workdir)
  assert saved_cfg.data.packed_dir == str(tmp_path / "relpack")  # stored absolute
  assert tok.decode(tok.encode("alpha beta")) == "alpha beta"
  assert train(saved_cfg, workdir).start_step == 2  # resumes from here, no repack
  assert not os.path.exists(tmp_path / "x" / "relpack")


def test_non_parquet_file_named_parquet_names_the_file(tmp_path):
  bad = tmp_path / "texts.parquet"
  bad.write_bytes(os.urandom(256))
  for read in (lambda: load_documents([str(bad)]),
               lambda: train(_cfg(str(bad)), str(tmp_path / "run"))):
    with pytest.raises(ValueError) as e:
      read()
    assert str(bad) in str(e.value) and "not a readable parquet file" in str(e.value)
  assert not os.path.exists(tmp_path / "run" / "checkpoints" / "1")
