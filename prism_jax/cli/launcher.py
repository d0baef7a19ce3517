"""What every command-line entry point shares: user errors as one `error: ...` line.

A mistake a user can fix (a bad or missing flag, a missing file, a bad config value, a config
that does not match the checkpoint, a diverged run) prints one line naming it and exits with
status 2; the traceback is for `--debug`. Anything else is a bug and keeps its traceback.
In a multi-process job a failed process then exits at once (no graceful shutdown), so the
others stop within the heartbeat timeout with an error naming it instead of waiting 300 s.
Used by the `prism` subcommands and by the scripts of experiments/ and benchmarks/.
"""

import atexit
import contextlib
import errno
import functools
import gc
import io
import os
import re
import sys
import time
import traceback

from absl import app, flags, logging

# jax and the library are imported inside the functions that use them: every command imports this
# module before its flags are parsed, and a bad flag or --help is answered before jax loads.

flags.DEFINE_bool("debug", False, "show the full traceback of user errors")

# User-fixable: bad values, missing/unreadable files, refused configs, divergence, a
# missing optional extra (ModuleNotFoundError naming it), and a run whose every checkpoint
# is corrupt (checkpoint.NoReadableCheckpointError).
USER_ERRORS = (ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError,
               PermissionError, FloatingPointError, ModuleNotFoundError)
USAGE_EXIT = 2
# A full or read-only disk is the user's to fix (free space, another --workdir), not a bug:
# one line naming the file, not a traceback.
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def _is_disk_error(e: BaseException) -> bool:
  return isinstance(e, OSError) and e.errno in DISK_ERRNOS


def one_line(e: BaseException) -> str:
  text = str(e).strip() or type(e).__name__
  if _is_disk_error(e):
    where = f" {e.filename}" if e.filename else ""
    text = f"cannot write{where}: {os.strerror(e.errno).lower()}"
  return "error: " + " | ".join(line.strip() for line in text.splitlines() if line.strip())


def _is_user_error(e: BaseException) -> bool:
  # Only an already-imported checkpoint module can have raised its error: importing it
  # here (jax, orbax: ~2.4 s) would tax every refused command that never touched it.
  ckpt = sys.modules.get("prism_jax.train.checkpoint")
  extra = (ckpt.NoReadableCheckpointError,) if ckpt is not None else ()
  return isinstance(e, USER_ERRORS + extra) or _is_disk_error(e)


def _parse_flags(argv):
  """absl's parser, with a bad flag (unknown, bad value, required and missing) as one line."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    print(one_line(e), file=sys.stderr)
    sys.exit(USAGE_EXIT)


HELP_ARGS = ("-h", "--help", "-?", "--helpshort")


def _wants_help(argv) -> bool:
  args = list(argv[1:])
  if "--" in args:  # what follows is another program's (prism lm-eval ... -- --help)
    args = args[:args.index("--")]
  return any(a in HELP_ARGS for a in args)


def command_help(main, prog: str) -> str:
  """`prog`'s module doc and its flags with their help: those its module defines and those
  of prism_jax's shared modules it registered (sampling, distributed, --debug); not absl's
  or another library's (--helpfull lists every flag)."""
  name = main.__module__
  module = sys.modules.get(name)
  spec = getattr(module, "__spec__", None)
  own = sys.argv[0] if name == "__main__" else name  # absl's key for a script's flags
  tops = {"prism_jax", (spec.name if spec else name).split(".")[0]}
  keys = [own] + [m for m in flags.FLAGS.flags_by_module_dict()
                  if m != own and m.split(".")[0] in tops]
  sections = [flags.FLAGS.module_help(k).strip("\n") for k in keys]
  doc = ((module.__doc__ if module else None) or "").strip()
  return "\n\n".join([f"usage: {prog} [--flags]"] + ([doc] if doc else [])
                     + ["flags:"] + [s for s in sections if s])


def _let_inflight_reads_finish(seconds: float = 1.0) -> None:
  """After a failed orbax restore (a damaged checkpoint: one line follows), TensorStore
  reads still in flight complete into orbax's closed event loop and print
  RuntimeError("Event loop is closed") tracebacks from their thread, a second traceback
  about nothing the user can act on: they get `seconds` to finish with stderr captured
  (2 runs in 18 printed one under load before; 0 in 24 after)."""
  with contextlib.redirect_stderr(io.StringIO()):
    time.sleep(seconds)


def writes_into_run(main):
  """`main` holding the run lock of --workdir (prism_jax/run_lock.py) for the whole command:
  for the commands that write into a run (its cache, cards, report, suppression sets)."""
  @functools.wraps(main)
  def locked(argv):
    from prism_jax import run_lock  # pylint: disable=g-import-not-at-top
    with run_lock.hold(flags.FLAGS.workdir):
      return main(argv)
  return locked


def run(main, argv=None) -> None:
  """`absl.app.run(main)`, with user errors reported on one line (see module doc); `argv`
  (default sys.argv) starts with the program name. `--help` (-h) prints the command's doc
  and flags (command_help), exit 0: absl's own shows the flags of the module run as the
  program, which for the `prism` console script defines none."""
  argv = list(sys.argv if argv is None else argv)
  if _wants_help(argv):
    print(command_help(main, argv[0]))
    sys.exit(0)
  def guarded(argv):
    try:
      return main(argv)
    except Exception as e:  # pylint: disable=broad-except
      user = not flags.FLAGS.debug and _is_user_error(e)
      if _in_a_distributed_job():
        print(one_line(e) if user else traceback.format_exc(), file=sys.stderr)
        _exit_after_failure(e, USAGE_EXIT if user else 1)
      if not user:
        raise
      if getattr(e, "reads_in_flight", False):
        _let_inflight_reads_finish()
      print(one_line(e), file=sys.stderr)
      sys.exit(USAGE_EXIT)
  # The interpreter's shutdown then skips its cyclic-garbage passes over the whole heap:
  # ~0.5 CPU-s of a process that imported jax (memory goes back to the OS either way).
  # Exit handlers registered after this one (jax's, orbax's, when imported later) run
  # before it; those of modules imported earlier run after it, their cycles left unfreed.
  atexit.register(gc.freeze)
  app.run(guarded, argv=argv, flags_parser=_parse_flags)


def _in_a_distributed_job() -> bool:
  jax = sys.modules.get("jax")  # not imported: no runtime to leave
  return jax is not None and jax.distributed.is_initialized()


def _exit_after_failure(e: Exception, code: int) -> None:
  """prism_jax.distributed.exit_after_failure: at once, not after jax's 300 s shutdown."""
  import jax  # pylint: disable=g-import-not-at-top
  from prism_jax import distributed  # pylint: disable=g-import-not-at-top
  timeout = getattr(flags.FLAGS, "heartbeat_timeout_s", None) or distributed.HEARTBEAT_TIMEOUT_S
  # on CPU a collective whose peer died fails at once (gloo: "Connection closed by peer");
  # on TPU and GPU it waits, and the runtime's heartbeat ends it. The process's devices,
  # not a traced code path.
  peer_lost = (isinstance(e, jax.errors.JaxRuntimeError) and jax.default_backend() == "cpu"
               and bool(re.search(r"Gloo|Connection closed by peer", str(e))))
  why = f"{type(e).__name__}: {one_line(e).removeprefix('error: ')}"
  distributed.exit_after_failure(why, code, peer_lost, timeout)


def retain_freed_host_memory() -> bool:
  """The CPU allocator setting of prism_jax/cli/host_memory.py, for a launcher whose
  process trains on CPU (XLA:CPU mallocs each step's buffers afresh: page faults every
  step otherwise). Process-wide, so the library never applies it; logged when applied.
  PRISM_JAX_RETAIN_FREED_MEMORY=0 opts out."""
  import jax  # pylint: disable=g-import-not-at-top
  from prism_jax.cli import host_memory  # pylint: disable=g-import-not-at-top
  if jax.default_backend() != "cpu":  # the process's devices, not a traced code path
    return False
  applied = host_memory.retain_freed_memory()
  if applied:
    logging.info("host memory: glibc keeps freed memory in the process (mmap/trim "
                 "thresholds 2 GiB, top pad 256 MiB); %s=0 opts out", host_memory.ENV_VAR)
  return applied
