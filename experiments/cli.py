"""What every command-line entry point shares: user errors as one `error: ...` line.

A mistake a user can fix (a missing file, a bad config value, a config that does not match
the checkpoint, a diverged run) prints one line naming it and exits with status 2; the
traceback is for `--debug`. Anything else is a bug and keeps its traceback.
"""

import sys

from absl import app, flags

flags.DEFINE_bool("debug", False, "show the full traceback of user errors")

# User-fixable: bad values, missing/unreadable files, refused configs, divergence.
USER_ERRORS = (ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError,
               PermissionError, FloatingPointError)


def one_line(e: BaseException) -> str:
  text = str(e).strip() or type(e).__name__
  return "error: " + " | ".join(line.strip() for line in text.splitlines() if line.strip())


def run(main) -> None:
  """`absl.app.run(main)`, with user errors reported on one line (see module doc)."""
  def guarded(argv):
    try:
      return main(argv)
    except USER_ERRORS as e:
      if flags.FLAGS.debug:
        raise
      print(one_line(e), file=sys.stderr)
      sys.exit(2)
  app.run(guarded)
