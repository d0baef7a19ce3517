"""Writes the golden Hugging Face GPT-2 directory of tests/test_hf.py (run it with transformers).

    python3.11 -m venv /tmp/hfvenv
    /tmp/hfvenv/bin/pip install torch==2.13.0 transformers safetensors   # CPU torch
    /tmp/hfvenv/bin/python tests/golden/hf_gpt2_tiny/make_golden.py

A tiny random GPT-2 (d 32, 2 layers, 4 heads, vocab 1000, 128 positions; every parameter
drawn at random, biases and LayerNorms included), a byte-level BPE of 1000 ids trained on
the standard library's pydoc topics (the embedded corpus), saved by `save_pretrained`, and
`golden_logits.safetensors`: fixed token ids and the float32 logits transformers computes
for them. Nothing here is prism_jax: the reference is independent of the code it checks.
"""

import os
import sys

import numpy as np
import torch
import transformers
from pydoc_data import topics
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

OUT = os.path.dirname(os.path.abspath(__file__))
VOCAB, POSITIONS = 1000, 128


def tokenizer() -> transformers.GPT2TokenizerFast:
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  texts = [topics.topics[k] for k in sorted(topics.topics)]
  tok.train_from_iterator(texts, trainer=trainer)
  assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
  return transformers.GPT2TokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                        eos_token="<|endoftext|>", unk_token="<|endoftext|>")


def main() -> None:
  torch.manual_seed(0)
  cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=POSITIONS, n_embd=32, n_layer=2,
                                n_head=4, activation_function="gelu_new",
                                bos_token_id=0, eos_token_id=0)
  model = transformers.GPT2LMHeadModel(cfg).eval()
  with torch.no_grad():  # every parameter random (the default init zeroes biases)
    for name, p in model.named_parameters():
      p.copy_(torch.randn_like(p) * (0.3 if p.ndim > 1 else 0.1)
              + (1.0 if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")) else 0.0))
  model.save_pretrained(OUT, safe_serialization=True)
  tokenizer().save_pretrained(OUT)
  rng = np.random.default_rng(0)
  ids = rng.integers(0, VOCAB, (2, 16)).astype(np.int64)
  with torch.no_grad():
    logits = model(torch.from_numpy(ids)).logits.numpy().astype(np.float32)
  save_file({"input_ids": ids, "logits": logits}, os.path.join(OUT, "golden_logits.safetensors"))
  with open(os.path.join(OUT, "NOTE.md"), "w", encoding="utf-8") as f:
    f.write(
        "# Golden Hugging Face GPT-2 (tests/test_hf.py)\n\n"
        "Produced by `make_golden.py` (its docstring says how to run it) with Python "
        f"{sys.version.split()[0]}, transformers {transformers.__version__}, torch "
        f"{torch.__version__}, tokenizers {__import__('tokenizers').__version__}, "
        f"safetensors {__import__('safetensors').__version__}, numpy {np.__version__}.\n\n"
        "- `config.json`, `model.safetensors`: a random GPT2LMHeadModel (d 32, 2 layers, 4 heads,\n"
        "  vocab 1000, 128 positions, gelu_new); every parameter drawn from a normal\n"
        "  (torch seed 0), so biases and LayerNorm parameters are checked too.\n"
        "- `tokenizer.json`, `tokenizer_config.json`: a 1000-id byte-level BPE trained on the\n"
        "  pydoc topics, saved by GPT2TokenizerFast.\n"
        "- `golden_logits.safetensors`: `input_ids` (2, 16) int64 (numpy seed 0) and `logits`\n"
        "  (2, 16, 1000) float32 from transformers' forward in float32 on CPU.\n\n"
        "Regenerate only if the reference itself must change (e.g. a new config field).\n")


if __name__ == "__main__":
  main()
