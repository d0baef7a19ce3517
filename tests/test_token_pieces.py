"""A token that is part of a UTF-8 character is shown as its bytes (<0xNN>), not as U+FFFD
(issue 56 item 6: eleven identical "�" chips in the explorer's signature). References: the
bytes themselves (the byte tokenizer's ids are bytes) and GPT-2's published byte alphabet
checked through an independent round trip: a token's shown text, with each <0xNN> turned back
into its byte, is exactly the bytes the tokenizer decodes the token to in context."""

import re

import numpy as np

from prism_jax.analysis import card_stats
from prism_jax.analysis.token_report import signature_line, token_text
from prism_jax.data import tokenizers as T

_HEX = re.compile(r"<0x([0-9A-F]{2})>")


def _unshow(text: str) -> bytes:
  """Inverse of show_bytes: <0xNN> -> that byte, everything else UTF-8."""
  out, last = bytearray(), 0
  for m in _HEX.finditer(text):
    out += text[last:m.start()].encode()
    out.append(int(m.group(1), 16))
    last = m.end()
  return bytes(out + text[last:].encode())


def test_show_bytes_round_trips_random_bytes():
  rng = np.random.default_rng(7)
  for _ in range(200):
    raw = bytes(rng.integers(0, 256, rng.integers(1, 12)).tolist())
    shown = T.show_bytes(raw)
    assert _unshow(shown) == raw
    assert "\ufffd" not in shown or "\ufffd".encode() in raw
  assert T.show_bytes("é’".encode() + b"\xe2\x80") == "é’<0xE2><0x80>"


def test_byte_tokenizer_pieces():
  tok = T.ByteTokenizer()
  assert tok.piece(ord("a")) == "a"
  assert [tok.piece(b) for b in "’".encode()] == ["<0xE2>", "<0x80>", "<0x99>"]
  assert tok.piece(tok.eos_id) == tok.decode([tok.eos_id])


def test_gpt2_pieces_are_their_bytes():
  tok = T.make_tokenizer("gpt2", 50257)
  rng = np.random.default_rng(3)
  text = "naïve café — “quoted” 日本語 emoji 🙂 " + "".join(
      chr(int(c)) for c in rng.integers(0x4E00, 0x4F00, 20))
  ids = tok.encode(text)
  pieces = [tok.piece(i) for i in ids]
  assert b"".join(_unshow(p) for p in pieces) == text.encode()  # every byte accounted for
  partial = [p for p in pieces if _HEX.search(p)]
  assert partial and not any("\ufffd" in p for p in pieces)
  # a whole-character token is shown as itself
  assert tok.piece(tok.encode(" café")[-1]) == tok.decode([tok.encode(" café")[-1]])


def test_signatures_and_token_report_show_bytes():
  tok = T.ByteTokenizer()
  sig = np.zeros((1, tok.vocab_size))
  sig[0, 0xE2], sig[0, ord("x")] = 2.0, 1.0
  promoted, _ = card_stats.signatures(sig, tok.decode, 2)[0]
  assert [t for t, _ in promoted] == ["<0xE2>", "x"]
  assert token_text(tok.decode, 0x99) == repr("<0x99>")
  plain = lambda ids: "".join(chr(i) for i in ids)  # a user's decode function: used as is
  assert card_stats.signatures(sig, plain, 1)[0][0][0][0] == chr(0xE2)


def test_the_demos_signature_line_shows_bytes():
  tok = T.ByteTokenizer()
  sig = np.zeros((2, tok.vocab_size), np.float32)
  sig[1, 0xE2], sig[1, ord("x")], sig[1, 0x99] = 3.0, 2.0, 1.0

  class _Model:
    def proto_logit_signatures(self):
      return sig

  assert signature_line(_Model(), 1, tok.decode) == "'<0xE2>' 'x' '<0x99>'"
