#!/usr/bin/env bash
# Prints a command that runs a working Python >= 3.12, or explains and exits 1.
# The image's pyenv shims for python3.12 fail unless PYENV_VERSION names a version, so
# installed pyenv versions are tried explicitly as well as plain interpreters on PATH.
ok() { "$@" -c 'import sys, venv; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }
if [ -n "${PYTHON:-}" ] && ok $PYTHON; then echo "$PYTHON"; exit 0; fi
for exe in python3.12 python3.13 python3.14 python3; do
  if command -v "$exe" >/dev/null 2>&1 && ok "$exe"; then command -v "$exe"; exit 0; fi
done
if command -v pyenv >/dev/null 2>&1; then
  for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9]|[2-9][0-9])' | sort -V); do
    exe="$(pyenv root)/versions/$v/bin/python3"
    if [ -x "$exe" ] && ok "$exe"; then echo "$exe"; exit 0; fi
  done
fi
echo "error: no Python >= 3.12 found (tried \$PYTHON, python3.12/3.13/3.14, python3, pyenv versions)." >&2
echo "       jax 0.12 needs Python >= 3.12; install one or set PYTHON=/path/to/python3.12." >&2
exit 1
