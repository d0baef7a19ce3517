"""Test set-up: CPU only, 8 simulated devices (1 where a file needs no more: see
tests/xdist_devices.py), float64 available for references.

The device count must be set before any JAX backend starts: in pytest_configure, before
collection imports the test modules.
"""

import atexit
import gc
import os

# As the command-line launcher does (prism_jax/cli/launcher.py): shutdown skips the
# cyclic-garbage passes over the heap (~0.5 CPU-s a process, more for a pytest worker).
atexit.register(gc.freeze)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite compiles hundreds of small programs, each run a few times: LLVM's optimisation
# of XLA:CPU's generated loops costs more than it saves at these sizes (test_ekfac.py: 107
# -> 65 CPU-s). It may change rounding (FMA contraction), so every process of a test uses
# it: the multi-process tests' workers inherit this environment.
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]).strip()
# `make test` gives the run a fresh persistent compilation cache (Makefile), shared by the
# pytest processes and the single-process runs they start (the environment reaches them);
# a cache hit returns the same executable, so no result changes. Multi-process runs go
# without it (multiprocess_env.py).
if os.environ.get("PRISM_JAX_TEST_JIT_CACHE"):
  from multiprocess_env import jit_cache_env  # pylint: disable=wrong-import-position
  os.environ.update(jit_cache_env(os.environ["PRISM_JAX_TEST_JIT_CACHE"]))

import jax  # noqa: E402

import pytest  # noqa: E402

import xdist_devices  # noqa: E402


def pytest_configure(config):
  jax.config.update("jax_num_cpu_devices", xdist_devices.device_count(config))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
  if xdist_devices.splits_by_devices(node.config):
    node.workerinput[xdist_devices.DEVICES_KEY] = xdist_devices.assign_devices(
        node.gateway.id)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
  del error
  xdist_devices.worker_down(node.gateway.id)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
  if xdist_devices.splits_by_devices(config):
    config.option.loadscopereorder = False  # LONGEST_FIRST's order, not by test count
    return xdist_devices.DeviceScheduling(config, log)
  return None


@pytest.fixture(autouse=True, scope="module")
def _device_count_of_the_file(request):
  xdist_devices.check_devices(request.path)


@pytest.fixture(scope="session")
def gcs():
  """A local GCS emulator (tests/gcs_emulator.py) for the whole session: its environment
  dict. One per session, since gcsfs caches its client (and the endpoint) per process."""
  import gcs_emulator  # pylint: disable=import-outside-toplevel
  with gcs_emulator.running() as env:
    yield env


# The longest files first (`make test` runs files whole on xdist workers, in collection
# order): the run then ends on short files, not with one worker alone on a long one.
# Measured with `--durations=0` (a99c15e); a file missing here keeps its place after them.
LONGEST_FIRST = ("test_kernels.py", "test_faults.py", "test_preemption.py", "test_nnls.py",
                 "test_ekfac.py", "test_report_browser.py", "test_throughput.py",
                 "test_sharding.py", "test_head.py", "test_evaluation_lds.py",
                 "test_lm_eval.py", "test_attribution_methods.py", "test_tracking.py",
                 "test_results_commands.py", "test_script_flags.py",
                 "test_hessian.py", "test_control_suppression.py", "test_cli.py",
                 "test_hf.py", "test_kernels_backward.py", "test_train_extend.py",
                 "test_multihost.py", "test_generate.py", "test_sharding_aot.py",
                 "test_train_resume.py", "test_control_heldout.py", "test_model.py",
                 "test_cache_multihost.py", "test_serve_safety.py",
                 "test_serve_fuzz.py", "test_proto_init_auto.py", "test_run_integrity.py")


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
