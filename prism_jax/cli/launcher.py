"""What every command-line entry point shares: user errors as one `error: ...` line.

A mistake a user can fix (a missing file, a bad config value, a config that does not match
the checkpoint, a diverged run) prints one line naming it and exits with status 2; the
traceback is for `--debug`. Anything else is a bug and keeps its traceback.
"""

import sys

from absl import app, flags

flags.DEFINE_bool("debug", False, "show the full traceback of user errors")

# User-fixable: bad values, missing/unreadable files, refused configs, divergence (and a
# run whose every checkpoint is corrupt, checkpoint.NoReadableCheckpointError).
USER_ERRORS = (ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError,
               PermissionError, FloatingPointError)


def one_line(e: BaseException) -> str:
  text = str(e).strip() or type(e).__name__
  return "error: " + " | ".join(line.strip() for line in text.splitlines() if line.strip())


def _is_user_error(e: BaseException) -> bool:
  from prism_jax.train.checkpoint import NoReadableCheckpointError  # pylint: disable=g-import-not-at-top
  return isinstance(e, USER_ERRORS + (NoReadableCheckpointError,))


def run(main) -> None:
  """`absl.app.run(main)`, with user errors reported on one line (see module doc)."""
  def guarded(argv):
    try:
      return main(argv)
    except Exception as e:  # pylint: disable=broad-except
      if flags.FLAGS.debug or not _is_user_error(e):
        raise
      print(one_line(e), file=sys.stderr)
      sys.exit(2)
  app.run(guarded)
