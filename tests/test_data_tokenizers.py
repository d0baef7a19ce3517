"""Tokenizers: byte and BPE round trips (unicode included), exact vocab, save/load."""

import numpy as np
import pytest

from prism_jax.data import sources
from prism_jax.data import tokenizers as tok_lib


def random_unicode(rng, n):
  # Mix of ASCII, Latin-1, CJK, emoji, control characters and the literal "<eos>".
  pools = [range(32, 127), range(0xC0, 0x180), range(0x4E00, 0x4F00),
           range(0x1F600, 0x1F650), range(0, 32)]
  out = []
  for _ in range(n):
    if rng.random() < 0.03:
      out.append("<eos>")
      continue
    pool = pools[rng.choice(len(pools), p=[0.6, 0.1, 0.1, 0.1, 0.1])]
    out.append(chr(int(rng.choice(np.array(pool)))))
  return "".join(out)


@pytest.fixture(scope="module")
def bpe():
  docs = sources.load_documents()
  return tok_lib.train_bpe((d.text for d in docs), 512)


def test_byte_round_trip_and_ids():
  rng = np.random.default_rng(0)
  tok = tok_lib.ByteTokenizer(300)
  assert (tok.vocab_size, tok.eos_id, tok.pad_id) == (300, 256, 257)
  for _ in range(20):
    text = random_unicode(rng, int(rng.integers(0, 200)))
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(np.asarray(ids + [tok.eos_id, tok.pad_id])) == text
  assert tok.decode([104, 105, 256], skip_special=False) == "hi<eos>"
  with pytest.raises(ValueError, match="vocab_size >= 258"):
    tok_lib.ByteTokenizer(257)


def test_bpe_exact_vocab_round_trip(bpe):
  rng = np.random.default_rng(1)
  assert bpe.vocab_size == 512
  assert len(bpe.hf_tokenizer.get_vocab()) == 512
  assert {bpe.eos_id, bpe.pad_id} == {bpe.hf_tokenizer.token_to_id("<eos>"),
                                      bpe.hf_tokenizer.token_to_id("<pad>")}
  for _ in range(20):
    text = random_unicode(rng, int(rng.integers(1, 300)))
    ids = bpe.encode(text)
    assert all(0 <= i < 512 for i in ids)
    assert bpe.eos_id not in ids  # literal "<eos>" text is not the special token
    assert bpe.decode(ids) == text
  batch = [random_unicode(rng, 50) for _ in range(5)]
  assert bpe.encode_batch(batch) == [bpe.encode(t) for t in batch]
  # BPE compresses English documentation text well below one token per byte.
  doc = sources.load_documents()[0].text
  assert len(bpe.encode(doc)) < 0.6 * len(doc.encode("utf-8"))


def test_bpe_small_corpus_fills_exact_vocab():
  tok = tok_lib.train_bpe(["tiny corpus, tiny corpus"], 400)
  assert tok.vocab_size == 400
  text = "any text at all: ÿ 🎉"
  assert tok.decode(tok.encode(text)) == text
  with pytest.raises(ValueError, match="vocab_size >= 258"):
    tok_lib.train_bpe(["x"], 200)


def test_save_and_load_by_path(tmp_path, bpe):
  rng = np.random.default_rng(2)
  text = random_unicode(rng, 200)
  bpe.save(str(tmp_path / "bpe"))
  for where in (tmp_path / "bpe", tmp_path / "bpe" / "tokenizer.json"):
    loaded = tok_lib.load_tokenizer(str(where))
    assert loaded.kind == "bpe"
    assert loaded.encode(text) == bpe.encode(text)
    assert (loaded.vocab_size, loaded.eos_id, loaded.pad_id) == (512, bpe.eos_id,
                                                                 bpe.pad_id)
  tok_lib.ByteTokenizer(512).save(str(tmp_path / "byte"))
  loaded = tok_lib.load_tokenizer(str(tmp_path / "byte"))
  assert (loaded.kind, loaded.vocab_size) == ("byte", 512)
  assert loaded.decode(loaded.encode(text)) == text
  with pytest.raises(FileNotFoundError, match="no tokenizer at"):
    tok_lib.load_tokenizer(str(tmp_path / "nothing"))
  with pytest.raises(ValueError, match="unknown tokenizer kind 'wordpiece'"):
    tok_lib.make_tokenizer("wordpiece", 512)
