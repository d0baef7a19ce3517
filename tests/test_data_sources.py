"""Sources: txt/jsonl/parquet/default corpus, ids and names, decode errors, bad inputs."""

import json
import logging
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prism_jax.data import sources

_ALPHABET = list("abcdefghijklmnopqrstuvwxyz") + ["é", "ß", "日", "本", "🎉", "ж"]


def random_text(rng, n_words):
  words = ["".join(rng.choice(_ALPHABET, size=rng.integers(1, 9))) for _ in range(n_words)]
  return " ".join(words)


def test_txt_paragraph_split_and_names(tmp_path):
  rng = np.random.default_rng(0)
  paras = [random_text(rng, int(rng.integers(5, 120))) for _ in range(40)]
  text = "\n\n".join(paras) + "\n"
  path = tmp_path / "a.txt"
  path.write_text(text, encoding="utf-8")
  docs = sources.load_documents([str(path)])
  assert len(docs) > 1  # long file split into several documents
  assert [d.example_id for d in docs] == list(range(len(docs)))
  # Chunks are consecutive slices of the file, named by their first line.
  assert "".join(d.text for d in docs) == text
  lines = text.splitlines(keepends=True)
  for d in docs:
    file, line = d.name.rsplit(":", 1)
    assert file == str(path)
    assert d.text.startswith(lines[int(line) - 1])
    assert len(d.text) <= 2 * sources.DOC_MAX_CHARS


def test_ids_follow_source_order_and_globs(tmp_path):
  rng = np.random.default_rng(1)
  texts = {}
  for name in ("b.txt", "a.txt", "c.txt"):
    texts[name] = random_text(rng, 20)
    (tmp_path / name).write_text(texts[name])
  (tmp_path / "x.jsonl").write_text(json.dumps({"body": "json doc"}) + "\n")
  docs = sources.load_documents([str(tmp_path / "x.jsonl"), str(tmp_path / "*.txt")],
                                text_field="body")
  assert [d.text for d in docs] == ["json doc"] + [texts[n] for n in ("a.txt", "b.txt",
                                                                      "c.txt")]
  assert [d.example_id for d in docs] == [0, 1, 2, 3]


def test_jsonl_field_blank_lines_and_errors(tmp_path):
  rng = np.random.default_rng(2)
  records = [{"content": random_text(rng, 10), "id": i} for i in range(5)]
  lines = [json.dumps(r, ensure_ascii=False) for r in records]
  lines.insert(2, "")
  path = tmp_path / "d.jsonl"
  path.write_text("\n".join(lines) + "\n", encoding="utf-8")
  docs = sources.load_documents([str(path)], text_field="content")
  assert [d.text for d in docs] == [r["content"] for r in records]
  assert docs[2].name == f"{path}:4"  # line numbers count the blank line
  with pytest.raises(ValueError, match=r"d.jsonl:1: no text field 'text'"):
    sources.load_documents([str(path)])
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"text": "ok"}\n{"text": \n')
  with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid JSON"):
    sources.load_documents([str(bad)])


def test_parquet_text_column(tmp_path):
  rng = np.random.default_rng(3)
  texts = [random_text(rng, int(rng.integers(3, 30))) for _ in range(25)]
  table = pa.table({"id": list(range(25)), "text": texts,
                    "other": [t[::-1] for t in texts]})
  path = tmp_path / "shard.parquet"
  pq.write_table(table, path, row_group_size=7)  # several row groups
  docs = sources.load_documents([str(path)])
  assert [d.text for d in docs] == texts
  assert docs[10].name == f"{path}:10"
  docs = sources.load_documents([str(path)], text_field="other")
  assert [d.text for d in docs] == [t[::-1] for t in texts]
  with pytest.raises(ValueError, match=r"shard.parquet: no column 'body'"):
    sources.load_documents([str(path)], text_field="body")


def test_default_corpus_covers_every_topic():
  from pydoc_data import topics
  docs = sources.load_documents()
  assert len(docs) >= len(topics.topics) >= 70
  by_topic = {}
  for d in docs:
    topic = d.name.removeprefix("pydoc:").split("#")[0]
    by_topic.setdefault(topic, []).append(d.text)
  assert set(by_topic) == {k for k, v in topics.topics.items() if v.strip()}
  for topic, parts in by_topic.items():
    assert "".join(parts) == topics.topics[topic]  # the parts are the topic, in order
    assert all(len(p) <= 2 * sources.DOC_MAX_CHARS or "\n" not in p.strip() for p in parts)
  assert len({d.name for d in docs}) == len(docs)


def _with_bad_bytes(rng, n_bad):
  text = random_text(rng, 200).encode("utf-8")
  bad_positions = sorted(rng.choice(np.arange(10, len(text) - 10), n_bad, replace=False))
  out, prev = bytearray(), 0
  for p in bad_positions:
    # Cut only at a character boundary so the inserted byte is the sole invalid one.
    while (text[p] & 0xC0) == 0x80:
      p += 1
    out += text[prev:p] + b"\xff"
    prev = p
  out += text[prev:]
  return bytes(out)


def test_non_utf8_replace_logs_count(tmp_path, caplog):
  rng = np.random.default_rng(4)
  raw = _with_bad_bytes(rng, 5)
  path = tmp_path / "latin.txt"
  path.write_bytes(raw)
  with caplog.at_level(logging.WARNING):
    docs = sources.load_documents([str(path)], on_decode_error="replace")
  text = "".join(d.text for d in docs)
  assert text == raw.decode("utf-8", errors="replace")  # independent reference
  assert text.count("\ufffd") == 5
  assert sources.replaced_bytes_last_decode() == 5
  assert any("latin.txt" in r.getMessage() and "replaced 5 non-UTF-8 byte" in r.getMessage()
             for r in caplog.records)


def _bad_jsonl(raw):
  good = b'{"text": "good line"}\n'
  return good + good + b'{"text": "' + raw.replace(b'"', b"") + b'"}\n' + good


def test_non_utf8_strict_names_file_and_offset(tmp_path):
  rng = np.random.default_rng(5)
  raw = _with_bad_bytes(rng, 3)
  for name, content, where in (("s.txt", raw, "s.txt"),
                               ("s.jsonl", _bad_jsonl(raw), "s.jsonl:3")):
    path = tmp_path / name
    path.write_bytes(content)
    offset = content.index(b"\xff")  # offset in the file
    with pytest.raises(ValueError,
                       match=rf"{where}: invalid UTF-8 at byte offset {offset} "):
      sources.load_documents([str(path)], on_decode_error="strict")


def test_non_utf8_jsonl_replace(tmp_path, caplog):
  rng = np.random.default_rng(6)
  raw = _with_bad_bytes(rng, 4)
  path = tmp_path / "r.jsonl"
  path.write_bytes(_bad_jsonl(raw))
  with caplog.at_level(logging.WARNING):
    docs = sources.load_documents([str(path)])
  assert [d.text for d in docs] == ["good line", "good line",
                                    raw.replace(b'"', b"").decode("utf-8", "replace"),
                                    "good line"]
  assert sources.replaced_bytes_last_decode() == 4
  first = _bad_jsonl(raw).index(b"\xff")
  assert any(f"replaced 4 non-UTF-8 byte(s) with U+FFFD (first at byte offset {first})"
             in r.getMessage() for r in caplog.records)


def test_non_utf8_in_binary_parquet_column(tmp_path):
  path = tmp_path / "b.parquet"
  pq.write_table(pa.table({"text": pa.array([b"fine", b"bad \xfe byte"], pa.binary())}),
                 path)
  docs = sources.load_documents([str(path)])
  assert [d.text for d in docs] == ["fine", "bad \ufffd byte"]
  with pytest.raises(ValueError, match=r"b.parquet:1: invalid UTF-8 at byte offset 4"):
    sources.load_documents([str(path)], on_decode_error="strict")


def test_missing_empty_and_unsupported_inputs(tmp_path):
  with pytest.raises(FileNotFoundError, match="nope.txt' does not exist"):
    sources.load_documents([str(tmp_path / "nope.txt")])
  with pytest.raises(FileNotFoundError, match=r"glob .*\*.parquet' matches no files"):
    sources.load_documents([str(tmp_path / "*.parquet")])
  (tmp_path / "empty.txt").write_bytes(b"")
  with pytest.raises(ValueError, match=r"empty.txt' is empty"):
    sources.load_documents([str(tmp_path / "empty.txt")])
  (tmp_path / "blank.txt").write_text("\n \n\t\n")
  with pytest.raises(ValueError, match=r"blank.txt' holds no non-blank documents"):
    sources.load_documents([str(tmp_path / "blank.txt")])
  (tmp_path / "x.csv").write_text("a,b\n")
  with pytest.raises(ValueError, match=r"x.csv: unsupported file type '.csv'"):
    sources.load_documents([str(tmp_path / "x.csv")])
  with pytest.raises(IsADirectoryError, match="is a directory"):
    sources.load_documents([str(tmp_path)])


def test_source_hash_tracks_content(tmp_path):
  path = tmp_path / "h.txt"
  path.write_text("one two three")
  h1 = sources.source_hash([str(path)])
  assert sources.source_hash([str(path)]) == h1
  path.write_text("one two three!")
  assert sources.source_hash([str(path)]) != h1
  assert sources.source_hash([str(path)], text_field="x") != sources.source_hash([str(path)])
  assert sources.source_hash() == sources.source_hash(())
  assert os.path.exists(path)


def test_jsonl_lone_surrogate_escape(tmp_path):
  path = tmp_path / "sur.jsonl"
  path.write_text('{"text": "ok \\ud800 here"}\n')  # valid JSON, not valid UTF-8 text
  docs = sources.load_documents([str(path)])
  replaced = "\ud800".encode("utf-8", "surrogatepass").decode("utf-8", "replace")
  assert docs[0].text == f"ok {replaced} here" and "\ufffd" in replaced
  docs[0].text.encode("utf-8")  # encodable, so every tokenizer accepts it
  with pytest.raises(ValueError, match=r"sur.jsonl:1: lone surrogate U\+D800 at character 3"):
    sources.load_documents([str(path)], on_decode_error="strict")
