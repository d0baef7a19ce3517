#!/usr/bin/env bash
# What a new user gets from `pip install .` with no extras, and from the minimum lock
# (requirements/min.txt: the lowest versions setup.cfg allows), each in a fresh venv outside
# the repository: tools/check_install.py's checks (prism --help, a tiny `prism demo`, GPT-2's
# BPE from the package data, a gs:// path's one-line error naming the gcs extra,
# prism_jax.load(...).decompose(...)).
#   tools/check_install.sh [plain] [min]      (default: both; `make check-install`)
# Installs with make's uv (its cache makes a repeat install a few seconds), else pip.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
py="$("$repo/tools/find_python.sh")"
uv="$repo/.venv/bin/uv"
modes=("${@:-plain}")
[ $# -eq 0 ] && modes=(plain min)
for mode in "${modes[@]}"; do
  d="$(mktemp -d -t prism_install.XXXXXX)"
  trap 'rm -rf "$d"' EXIT
  "$py" -m venv "$d/venv"
  vpy="$d/venv/bin/python"
  if [ -x "$uv" ]; then inst=("$uv" pip install --quiet --python "$vpy"); else
    inst=("$vpy" -m pip install --quiet); fi
  start=$(date +%s)
  case "$mode" in
    plain) "${inst[@]}" "$repo" ;;
    min) "${inst[@]}" -r "$repo/requirements/min.txt" && "${inst[@]}" --no-deps "$repo" ;;
    *) echo "error: unknown mode $mode (plain or min)" >&2; exit 2 ;;
  esac
  echo "[$mode] installed in $(( $(date +%s) - start )) s"
  (cd "$d" && JAX_PLATFORMS=cpu "$vpy" "$repo/tools/check_install.py" "$d" "$mode")
  rm -rf "$d"
  trap - EXIT
done
