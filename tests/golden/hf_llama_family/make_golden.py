"""Writes the golden Llama-family directories of tests/test_hf_llama.py (run it with
transformers; nothing here is prism_jax, so the reference is independent of the code it
checks):

    python3.11 -m venv /tmp/hfvenv
    /tmp/hfvenv/bin/pip install torch==2.13.0 transformers safetensors   # CPU torch
    /tmp/hfvenv/bin/python tests/golden/hf_llama_family/make_golden.py

Two random models of 2 layers with grouped-query attention (4 query heads, 2 key/value
heads), an MLP width that is not a multiple of d (96 at d 64), vocab 1000, 128 positions:
- `llama/`: LlamaForCausalLM, untied LM head, Llama 3 rotary scaling (factor 8 over an
  original 32 positions, so the scaling moves frequencies inside the 128 tested), θ 500000;
- `qwen2/`: Qwen2ForCausalLM, tied head, q/k/v biases, θ 1e6, RMSNorm eps 1e-6.
Every parameter (norm scales and biases included) is drawn from a normal (torch seed 0).
Each directory holds `save_pretrained`'s files, the 1000-id byte-level BPE of
tests/golden/hf_gpt2_tiny (its tokenizer.json, saved by PreTrainedTokenizerFast), and
`golden.safetensors`: `input_ids` (2, 16) int64 (numpy seed 0), their float32 `logits`, and
`greedy` (2, 48): `generate` of 32 new tokens, greedy, from the first 16.
"""

import os
import sys

import numpy as np
import torch
import transformers
from safetensors.numpy import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZER = os.path.join(HERE, "..", "hf_gpt2_tiny", "tokenizer.json")
COMMON = dict(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              bos_token_id=0, eos_token_id=0, pad_token_id=0)


def configs():
  llama = transformers.LlamaConfig(
      **COMMON, tie_word_embeddings=False, rms_norm_eps=1e-5,
      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 32})
  qwen2 = transformers.Qwen2Config(
      **COMMON, tie_word_embeddings=True, rms_norm_eps=1e-6,
      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
  return {"llama": (transformers.LlamaForCausalLM, llama),
          "qwen2": (transformers.Qwen2ForCausalLM, qwen2)}


def write(name, cls, cfg) -> None:
  out = os.path.join(HERE, name)
  torch.manual_seed(0)
  model = cls(cfg).eval()
  with torch.no_grad():
    for pname, p in model.named_parameters():
      scale = 0.3 if p.ndim > 1 else 0.1
      p.copy_(torch.randn_like(p) * scale + (1.0 if pname.endswith("norm.weight") else 0.0))
  model.save_pretrained(out, safe_serialization=True)
  tok = transformers.PreTrainedTokenizerFast(
      tokenizer_file=TOKENIZER, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
      unk_token="<|endoftext|>", pad_token="<|endoftext|>")
  tok.save_pretrained(out)
  ids = np.random.default_rng(0).integers(0, 1000, (2, 16)).astype(np.int64)
  with torch.no_grad():
    logits = model(torch.from_numpy(ids)).logits.numpy().astype(np.float32)
    greedy = model.generate(torch.from_numpy(ids), max_new_tokens=32, do_sample=False,
                            attention_mask=torch.ones_like(torch.from_numpy(ids)),
                            eos_token_id=None, pad_token_id=0).numpy()
  save_file({"input_ids": ids, "logits": logits, "greedy": greedy},
            os.path.join(out, "golden.safetensors"))


def main() -> None:
  for name, (cls, cfg) in configs().items():
    write(name, cls, cfg)
  with open(os.path.join(HERE, "NOTE.md"), "w", encoding="utf-8") as f:
    f.write(
        "# Golden Llama-family checkpoints (tests/test_hf_llama.py)\n\n"
        "Produced by `make_golden.py` (its docstring says what and how) with Python "
        f"{sys.version.split()[0]}, transformers {transformers.__version__}, torch "
        f"{torch.__version__}, tokenizers {__import__('tokenizers').__version__}, "
        f"safetensors {__import__('safetensors').__version__}, numpy {np.__version__}.\n\n"
        "- `llama/`: LlamaForCausalLM (d 64, 2 layers, 4 query / 2 key-value heads, MLP 96,\n"
        "  vocab 1000, untied head, Llama 3 rope scaling: factor 8, original 32 positions).\n"
        "- `qwen2/`: Qwen2ForCausalLM (the same shape, tied head, q/k/v biases, θ 1e6).\n"
        "- each `golden.safetensors`: `input_ids` (2, 16), transformers' float32 `logits`\n"
        "  (2, 16, 1000) on CPU and `greedy` (2, 48): `generate`, 32 new tokens, greedy.\n\n"
        "Regenerate only if the reference itself must change.\n")


if __name__ == "__main__":
  main()
