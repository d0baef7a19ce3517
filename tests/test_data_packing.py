"""Packing: rows vs a brute-force reconstruction, split by document, idempotence, errors."""

import collections
import json
import os

import numpy as np
import pytest

from prism_jax.config import DataConfig
from prism_jax.data import PackedData, pack, prepare_data, sources
from prism_jax.data.packing import SPLITS


def write_jsonl(path, rng, n_docs, max_words=60):
  words = ["alpha", "beta", "gamma", "δέλτα", "日本", "🎉", "x", "yz", "the", "a"]
  texts = [" ".join(rng.choice(words, size=int(rng.integers(1, max_words))))
           for _ in range(n_docs)]
  with open(path, "w", encoding="utf-8") as f:
    for t in texts:
      f.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")
  return texts


def reference_rows(doc_tokens, doc_ids, T, eos, pad):
  """Brute force: one stream per split, rows of T+1 with a one-token overlap."""
  tok, eid, off = [eos], [-1], [-1]
  for i in doc_ids:
    ids = list(doc_tokens[i]) + [eos]
    tok += ids
    eid += [i] * len(ids)
    off += list(range(len(ids)))
  rows = {"tokens": [], "example_id": [], "offset": []}
  r = 0
  while r * T + 1 < len(tok):
    for name, stream, fill in (("tokens", tok, pad), ("example_id", eid, -1),
                               ("offset", off, -1)):
      row = stream[r * T:r * T + T + 1]
      rows[name].append(row + [fill] * (T + 1 - len(row)))
    r += 1
  return {k: np.array(v, np.int32).reshape(-1, T + 1) for k, v in rows.items()}


@pytest.mark.parametrize("tokenizer,T", [("byte", 7), ("bpe", 16)])
def test_rows_match_brute_force(tmp_path, tokenizer, T):
  rng = np.random.default_rng(0)
  src = str(tmp_path / "c.jsonl")
  texts = write_jsonl(src, rng, 120)
  cfg = DataConfig(sources=(src,), tokenizer=tokenizer, seq_len=T, val_fraction=0.1,
                   seed=3)
  packed = prepare_data(cfg, 300, str(tmp_path / "work"))
  assert packed.path == str(tmp_path / "work" / "data")
  tok = packed.tokenizer
  assert (tok.kind, tok.vocab_size) == (tokenizer, 300)
  if tokenizer == "byte":
    doc_tokens = [list(t.encode("utf-8")) for t in texts]  # independent of the code
  else:
    doc_tokens = [tok.encode(t) for t in texts]
    assert all(tok.decode(d) == t for d, t in zip(doc_tokens, texts))
  split_of = [packed.document_split(i) for i in range(len(texts))]
  seen = collections.Counter()
  for split in SPLITS:
    ids = [i for i in range(len(texts)) if split_of[i] == split]
    ref = reference_rows(doc_tokens, ids, T, tok.eos_id, tok.pad_id)
    rows = packed.rows(split)
    assert packed.num_rows(split) == len(ref["tokens"])
    for name in ref:
      np.testing.assert_array_equal(rows[name], ref[name], err_msg=f"{split} {name}")
    # Targets (columns 1..T) list every document token (EOS included) exactly once.
    eid, off = rows["example_id"][:, 1:], rows["offset"][:, 1:]
    real = eid >= 0
    seen.update(zip(eid[real].tolist(), off[real].tolist()))
  expected = {(i, j) for i, d in enumerate(doc_tokens) for j in range(len(d) + 1)}
  assert set(seen) == expected and max(seen.values()) == 1
  # Documents and snippets read back from the rows.
  for i in rng.choice(len(texts), 10, replace=False):
    np.testing.assert_array_equal(packed.document_tokens(int(i)), doc_tokens[i])
    assert packed.document_text(int(i)) == texts[i]
    assert packed.document_name(int(i)) == f"{src}:{i + 1}"
  meta = packed.metadata
  assert meta["counts"]["tokens"] == sum(len(d) + 1 for d in doc_tokens)
  assert meta["counts"]["documents"] == len(texts)
  assert meta["tokenizer"]["kind"] == tokenizer


def test_split_is_by_document_and_seeded(tmp_path):
  rng = np.random.default_rng(1)
  src = str(tmp_path / "c.jsonl")
  write_jsonl(src, rng, 50)
  val_sets = []
  for seed in (0, 1):
    cfg = DataConfig(sources=(src,), tokenizer="byte", seq_len=8, val_fraction=0.2,
                     split_seed=seed)
    packed = PackedData(pack(cfg, 258, str(tmp_path / f"p{seed}")))
    ids = {s: set(np.unique(packed.rows(s)["example_id"])) - {-1} for s in SPLITS}
    assert not ids["train"] & ids["val"]
    assert ids["train"] | ids["val"] == set(range(50))
    assert len(ids["val"]) == 10
    assert ids["val"] == set(packed.document_ids("val").tolist())
    val_sets.append(ids["val"])
  assert val_sets[0] != val_sets[1]
  # Same seed, another directory: the same split, byte for byte.
  cfg = DataConfig(sources=(src,), tokenizer="byte", seq_len=8, val_fraction=0.2,
                   split_seed=0)
  again = PackedData(pack(cfg, 258, str(tmp_path / "again")))
  np.testing.assert_array_equal(again.rows("val")["tokens"],
                                PackedData(str(tmp_path / "p0")).rows("val")["tokens"])


def test_tiny_corpus_gets_one_val_document(tmp_path):
  src = tmp_path / "t.jsonl"
  src.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("one doc", "two",
                                                                   "three docs here")))
  cfg = DataConfig(sources=(str(src),), tokenizer="byte", seq_len=4, val_fraction=0.01)
  packed = prepare_data(cfg, 258, str(tmp_path))
  assert packed.metadata["counts"]["val"]["documents"] == 1
  assert packed.metadata["counts"]["train"]["documents"] == 2
  one = tmp_path / "one.jsonl"
  one.write_text(json.dumps({"text": "a single document long enough"}) + "\n")
  cfg = DataConfig(sources=(str(one),), tokenizer="byte", seq_len=4, val_fraction=0.1)
  with pytest.raises(ValueError, match="1 document.*needs at least 2"):
    pack(cfg, 258, str(tmp_path / "one"))
  packed = prepare_data(DataConfig(sources=(str(one),), tokenizer="byte", seq_len=4,
                                   val_fraction=0.0, packed_dir=str(tmp_path / "nv")),
                        258, "unused")
  assert packed.num_rows("val") == 0 and packed.num_rows("train") > 0


def test_corpus_shorter_than_a_row(tmp_path):
  src = tmp_path / "short.txt"
  src.write_text("tiny")  # 4 bytes + EOS = 5 tokens
  cfg = DataConfig(sources=(str(src),), tokenizer="byte", seq_len=16, val_fraction=0.0)
  with pytest.raises(ValueError, match=r"corpus has 5 tokens, fewer than seq_len\+1=17"):
    prepare_data(cfg, 258, str(tmp_path / "w"))
  assert os.listdir(tmp_path / "w") == []  # nothing half-written left behind
  # Documents shorter than the context are fine: they are packed together.
  src = tmp_path / "short.jsonl"
  src.write_text("".join(json.dumps({"text": "ab"}) + "\n" for _ in range(6)))
  cfg = DataConfig(sources=(str(src),), tokenizer="byte", seq_len=16, val_fraction=0.0)
  packed = prepare_data(cfg, 258, str(tmp_path / "w"))
  assert packed.metadata["counts"]["tokens"] == 18
  assert packed.num_rows("train") == 2  # ceil(18 targets / 16)
  assert packed.num_documents == 6


def test_idempotent_reuse_and_refusal(tmp_path):
  rng = np.random.default_rng(2)
  src = tmp_path / "c.jsonl"
  write_jsonl(str(src), rng, 30)
  cfg = DataConfig(sources=(str(src),), tokenizer="bpe", seq_len=8)
  out = pack(cfg, 300, str(tmp_path / "p"))
  mtimes = {f: os.stat(os.path.join(out, f)).st_mtime_ns for f in os.listdir(out)}
  assert pack(cfg, 300, str(tmp_path / "p")) == out  # no-op
  assert {f: os.stat(os.path.join(out, f)).st_mtime_ns for f in os.listdir(out)} == mtimes
  with pytest.raises(ValueError, match=r"different config: seq_len \(stored 8, requested "
                     r"9\); vocab_size \(stored 300, requested 301\)"):
    pack(DataConfig(sources=(str(src),), tokenizer="bpe", seq_len=9), 301,
         str(tmp_path / "p"))
  with src.open("a") as f:
    f.write(json.dumps({"text": "one more document"}) + "\n")
  with pytest.raises(ValueError, match=r"different config: source_hash"):
    pack(cfg, 300, str(tmp_path / "p"))
  (tmp_path / "foreign").mkdir()
  with pytest.raises(ValueError, match="not a finished packed dataset"):
    pack(cfg, 300, str(tmp_path / "foreign"))


def test_snippet_shows_the_token_in_context(tmp_path):
  src = tmp_path / "s.txt"
  text = "The quick brown fox jumps over the lazy dog. " * 4
  src.write_text(text)
  cfg = DataConfig(sources=(str(src),), tokenizer="byte", seq_len=8, val_fraction=0.0)
  packed = prepare_data(cfg, 258, str(tmp_path))
  i = text.index("fox")
  before, token, after = packed.snippet_parts(0, i, width=4)
  assert (before, token, after) == ("own ", "f", "ox j")
  assert packed.snippet(0, i, width=4) == f"{src}:1: own [[f]]ox j"
  assert packed.snippet_parts(0, len(text), width=2)[1] == "<eos>"
  with pytest.raises(IndexError, match="offset"):
    packed.snippet(0, len(text) + 1)
  with pytest.raises(IndexError, match="example id 1 out of range"):
    packed.snippet(1, 0)


def test_default_corpus_tiny_preset(tmp_path):
  """The demo's path: BPE to the tiny vocab on the embedded corpus, then reuse."""
  from prism_jax.config import preset
  cfg = preset("tiny")
  packed = prepare_data(cfg.data, cfg.model.vocab_size, str(tmp_path))
  docs = sources.load_documents()
  meta = packed.metadata
  assert packed.vocab_size == meta["tokenizer"]["vocab_size"] == cfg.model.vocab_size
  assert packed.seq_len == cfg.data.seq_len
  assert meta["counts"]["documents"] == packed.num_documents == len(docs)
  n_val = meta["counts"]["val"]["documents"]
  assert n_val == round(cfg.data.val_fraction * len(docs))
  # Tokens per row: (rows * T) target slots hold every document token plus padding.
  for split in SPLITS:
    assert (packed.num_rows(split) - 1) * cfg.data.seq_len < (
        meta["counts"][split]["tokens"]) <= packed.num_rows(split) * cfg.data.seq_len
  rng = np.random.default_rng(0)
  for i in rng.choice(len(docs), 5, replace=False).tolist():
    assert packed.document_text(i) == docs[i].text
    assert packed.document_name(i) == docs[i].name
  assert prepare_data(cfg.data, cfg.model.vocab_size, str(tmp_path)).path == packed.path
