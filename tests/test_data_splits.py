"""Held-out splits: validation files, a split seed apart from the shuffle, .txt documents."""

import json

import numpy as np
import pytest

from prism_jax.config import DataConfig
from prism_jax.data import OldPackError, PackedData, make_loader, pack
from prism_jax.data.packing import METADATA, SPLITS
from prism_jax.data.tokenizers import make_tokenizer


def random_text(rng, n_paragraphs, words=("alpha", "beta", "γάμμα", "日本", "x", "the")):
  paras = [" ".join(rng.choice(words, size=int(rng.integers(5, 60))))
           for _ in range(n_paragraphs)]
  return "\n\n".join(paras) + "\n"


def split_ids(packed):
  return {s: set(np.unique(packed.rows(s)["example_id"]).tolist()) - {-1} for s in SPLITS}


def test_val_sources_are_exactly_the_val_split(tmp_path):
  rng = np.random.default_rng(5)
  train_txt = [random_text(rng, int(rng.integers(3, 20))) for _ in range(3)]
  val_txt = [random_text(rng, int(rng.integers(3, 20))) for _ in range(2)]
  train = [tmp_path / f"train{i}.txt" for i in range(3)]
  val = [tmp_path / f"val{i}.txt" for i in range(2)]
  for p, t in zip(train + val, train_txt + val_txt):
    p.write_text(t, encoding="utf-8")
  cfg = DataConfig(sources=tuple(map(str, train)), val_sources=tuple(map(str, val)),
                   tokenizer="byte", seq_len=16, val_fraction=0.3, txt_documents="file")
  packed = PackedData(pack(cfg, 258, str(tmp_path / "packed")))
  ids = split_ids(packed)
  assert ids == {"train": {0, 1, 2}, "val": {3, 4}}  # one document per file, val last
  for e, text in zip(range(5), train_txt + val_txt):
    assert packed.document_text(e) == text
  assert [packed.document_name(e).rsplit(":", 1)[0] for e in (3, 4)] == list(map(str, val))
  # No training text in the val rows: every val token comes from a val file.
  rows = packed.rows("val")  # every stream token after the first is one row's target once
  targets = rows["tokens"][:, 1:][rows["example_id"][:, 1:] >= 0]
  assert targets.size == sum(len(t.encode()) + 1 for t in val_txt)
  assert set(rows["example_id"][:, 1:][rows["example_id"][:, 1:] >= 0].tolist()) == {3, 4}


def test_split_seed_fixes_the_split_while_the_shuffle_seed_moves(tmp_path):
  rng = np.random.default_rng(9)
  src = tmp_path / "c.txt"
  src.write_text(random_text(rng, 200), encoding="utf-8")
  base = dict(sources=(str(src),), tokenizer="byte", seq_len=16, val_fraction=0.2,
              txt_documents="300")
  packs = {}
  for seed, split_seed in ((0, 0), (1, 0), (0, 1)):
    packs[seed, split_seed] = PackedData(pack(DataConfig(seed=seed, split_seed=split_seed,
                                                         **base), 258,
                                              str(tmp_path / f"p{seed}{split_seed}")))
  a, b, c = (split_ids(packs[k]) for k in ((0, 0), (1, 0), (0, 1)))
  assert a == b and a != c
  np.testing.assert_array_equal(packs[0, 0].rows("val")["tokens"],
                                packs[1, 0].rows("val")["tokens"])
  # The shuffle seed still moves the training order.
  order = [make_loader(packs[0, 0], "train", 4, s).batch_at(0)["row_id"] for s in (0, 1)]
  assert not np.array_equal(order[0], order[1])


def test_txt_documents_modes(tmp_path):
  rng = np.random.default_rng(2)
  text = random_text(rng, 60)
  src = tmp_path / "t.txt"
  src.write_text(text, encoding="utf-8")
  counts = {}
  for mode in ("file", "paragraphs", "500"):
    cfg = DataConfig(sources=(str(src),), tokenizer="byte", seq_len=16, val_fraction=0.0,
                     txt_documents=mode)
    packed = PackedData(pack(cfg, 258, str(tmp_path / mode)))
    docs = [packed.document_text(e) for e in range(packed.num_documents)]
    assert "".join(docs).replace("\n", "") == text.replace("\n", "")
    counts[mode] = len(docs)
    if mode == "500":
      assert max(len(d) for d in docs) <= 1000  # chunks close near 500 chars (2x cap)
  assert counts["file"] == 1 < counts["paragraphs"] < counts["500"]


def test_bad_split_configs_are_clear_errors(tmp_path):
  src = tmp_path / "a.txt"
  src.write_text("some text here\n")
  with pytest.raises(ValueError, match="also in data.sources"):
    pack(DataConfig(sources=(str(src),), val_sources=(str(src),), tokenizer="byte",
                    seq_len=4), 258, str(tmp_path / "p"))
  with pytest.raises(ValueError, match="txt_documents"):
    DataConfig(txt_documents="chapters")
  with pytest.raises(ValueError, match="needs data.sources"):
    DataConfig(val_sources=(str(src),))
  with pytest.raises(FileNotFoundError, match="missing.txt"):
    pack(DataConfig(sources=(str(src),), val_sources=(str(tmp_path / "missing.txt"),),
                    tokenizer="byte", seq_len=4), 258, str(tmp_path / "q"))


def test_format_1_pack_is_refused_with_how_to_repack(tmp_path):
  """A format-1 pack (whole .npy arrays, written before issue 28) is refused by the packer
  and by the reader in one line that says how to re-pack; re-packing gives the rows a
  format-1 pack of a one-piece corpus held (the same stream, split and ids)."""
  rng = np.random.default_rng(4)
  src = tmp_path / "c.txt"
  src.write_text(random_text(rng, 40), encoding="utf-8")
  cfg = DataConfig(sources=(str(src),), tokenizer="byte", seq_len=16, split_seed=3)
  old = tmp_path / "old"
  old.mkdir()
  meta = {"config": {"format_version": 1, "sources": [str(src)], "seed": 3}, "source_hash": "x",
          "counts": {}}
  (old / METADATA).write_text(json.dumps(meta))
  np.save(old / "train_tokens.npy", rng.integers(0, 256, (4, 17)).astype(np.int32))
  for call in (lambda: pack(cfg, 258, str(old)), lambda: PackedData(str(old))):
    with pytest.raises(OldPackError) as e:
      call()
    assert "\n" not in str(e.value) and "format 1" in str(e.value)
    assert f"re-pack it: remove everything in {old} but tokenizer.json" in str(e.value)
  assert sorted(p.name for p in old.iterdir()) == [METADATA, "train_tokens.npy"]
  # As the message says: with only the run's tokenizer left, the same command packs the rows
  # a fresh pack holds (load_for_inference reads that tokenizer, so it must stay).
  for p in old.iterdir():
    p.unlink()
  make_tokenizer("byte", 258).save(str(old))
  pack(cfg, 258, str(old))
  fresh = PackedData(pack(cfg, 258, str(tmp_path / "fresh")))
  for split in ("train", "val"):
    for key in ("tokens", "example_id", "offset"):
      np.testing.assert_array_equal(np.asarray(PackedData(str(old)).rows(split)[key]),
                                    np.asarray(fresh.rows(split)[key]))
