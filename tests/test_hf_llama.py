"""Llama-family checkpoints in and out (prism_jax.hf, model.arch=llama) against golden
directories written by transformers (tests/golden/hf_llama_family/NOTE.md says how and by
which versions): a Llama 3 model (grouped-query attention, untied head, rope scaling) and a
Qwen2 model (q/k/v biases, tied head)."""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from prism_jax import hf
from prism_jax.generate import generate
from prism_jax.loading import load_for_inference

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "hf_llama_family")
FAMILIES = ("llama", "qwen2")
VOCAB = 1000


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
  root = tmp_path_factory.mktemp("hf_llama")
  for fam in FAMILIES:
    hf.import_hf(os.path.join(GOLDEN, fam), str(root / fam))
    hf.import_hf(os.path.join(GOLDEN, fam), str(root / f"{fam}_prism"), "prism",
                 num_prototypes=16, k=4)
  return root


def _golden(fam):
  return load_file(os.path.join(GOLDEN, fam, "golden.safetensors"))


@pytest.mark.parametrize("fam", FAMILIES)
def test_imported_logits_match_transformers_and_prism_adds_nothing(imported, fam):
  g = _golden(fam)
  model, cfg, tok = load_for_inference(str(imported / fam))
  m = cfg.model
  assert (m.arch, m.n_heads, m.kv_heads, m.d_mlp, m.qkv_bias, m.tie_embeddings) == (
      "llama", 4, 2, 96, fam == "qwen2", fam == "qwen2")
  assert (m.rope_scaling_factor, m.rope_original_max_len) == (
      (8.0, 32) if fam == "llama" else (0.0, 8192))
  assert tok.vocab_size == VOCAB
  got = np.asarray(model(jnp.asarray(g["input_ids"], jnp.int32)).logits_BxTxV)
  scale = np.abs(g["logits"]).max()
  # 1e-5 relative to the logits' scale (float32 sums in another order than torch's)
  np.testing.assert_allclose(got[..., :VOCAB], g["logits"], rtol=1e-5, atol=1e-5 * scale)
  prism, pcfg, _ = load_for_inference(str(imported / f"{fam}_prism"))
  assert pcfg.model.kind == "prism" and pcfg.model.arch == "llama"
  again = np.asarray(prism(jnp.asarray(g["input_ids"], jnp.int32)).logits_BxTxV)
  assert np.array_equal(again, got)  # W r + W z_hat = W z, to the bit


@pytest.mark.parametrize("fam", FAMILIES)
def test_32_greedy_tokens_equal_transformers_generate(imported, fam):
  """The KV-cache generator (grouped-query cache, rotary positions at each step)."""
  g = _golden(fam)
  model, _, _ = load_for_inference(str(imported / fam))
  out = generate(model, g["input_ids"].tolist(), max_new_tokens=32, temperature=0.0)
  assert np.array_equal(np.asarray(out.tokens_BxL)[:, -32:], g["greedy"][:, 16:])


@pytest.mark.parametrize("fam", FAMILIES)
def test_export_round_trip_is_exact(imported, tmp_path, fam):
  src = os.path.join(GOLDEN, fam)
  hf.export_hf(str(imported / fam), str(tmp_path / "out"))
  want, got = load_file(os.path.join(src, "model.safetensors")), load_file(
      str(tmp_path / "out" / "model.safetensors"))
  assert sorted(got) == sorted(want)
  assert all(np.array_equal(got[k], want[k]) for k in want)
  cfg_in = json.loads(open(os.path.join(src, "config.json"), encoding="utf-8").read())
  cfg_out = json.loads((tmp_path / "out" / "config.json").read_text())
  for key in ("model_type", "architectures", "hidden_size", "intermediate_size",
              "num_key_value_heads", "rms_norm_eps", "rope_parameters", "tie_word_embeddings"):
    assert cfg_out[key] == cfg_in[key], key
  hf.import_hf(str(tmp_path / "out"), str(tmp_path / "back"))
  a, _, _ = load_for_inference(str(imported / fam))
  b, _, _ = load_for_inference(str(tmp_path / "back"))
  ids = jnp.asarray(_golden(fam)["input_ids"], jnp.int32)
  assert np.array_equal(np.asarray(a(ids).logits_BxTxV), np.asarray(b(ids).logits_BxTxV))


def _broken(tmp_path, fam, edit=None, drop=None):
  src = tmp_path / "src"
  shutil.copytree(os.path.join(GOLDEN, fam), src)
  if edit is not None:
    cfg = json.loads((src / "config.json").read_text())
    edit(cfg)
    (src / "config.json").write_text(json.dumps(cfg))
  if drop:
    tensors = load_file(str(src / "model.safetensors"))
    del tensors[drop]
    save_file(tensors, str(src / "model.safetensors"))
  return src


def _rope(**kw):
  return lambda c: c["rope_parameters"].update(kw)


BAD = {
    "rope type": ("llama", dict(edit=_rope(rope_type="yarn")), "rope_type='yarn'"),
    "o_proj bias": ("llama", dict(edit=lambda c: c.update(attention_bias=True)),
                    "attention_bias=True is not supported"),
    "mlp bias": ("llama", dict(edit=lambda c: c.update(mlp_bias=True)), "mlp_bias=True"),
    "activation": ("llama", dict(edit=lambda c: c.update(hidden_act="gelu")),
                   "hidden_act='gelu'"),
    "head dim": ("llama", dict(edit=lambda c: c.update(head_dim=32)), "head_dim=32"),
    "sliding window": ("qwen2", dict(edit=lambda c: c.update(use_sliding_window=True)),
                       "use_sliding_window=True"),
    "mistral window": ("llama", dict(edit=lambda c: c.update(
        model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=64)),
                       "sliding_window=64 is not supported"),
    "missing kv": ("llama", dict(drop="model.layers.1.self_attn.v_proj.weight"),
                   "missing weight model.layers.1.self_attn.v_proj.weight"),
    "missing bias": ("qwen2", dict(drop="model.layers.0.self_attn.k_proj.bias"),
                     "missing weight model.layers.0.self_attn.k_proj.bias"),
    "untied head absent": ("llama", dict(drop="lm_head.weight"), "missing weight lm_head"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_error_and_writes_nothing(tmp_path, case):
  fam, kwargs, message = BAD[case]
  src = _broken(tmp_path, fam, **kwargs)
  with pytest.raises(hf.HFFormatError, match=message):
    hf.import_hf(str(src), str(tmp_path / "target"))
  assert not (tmp_path / "target").exists()


def test_mistral_window_at_least_the_length_is_full_attention(tmp_path):
  src = _broken(tmp_path, "llama", edit=lambda c: c.update(
      model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=128))
  cfg = hf.import_hf(str(src), str(tmp_path / "run"))
  assert cfg.model.arch == "llama" and cfg.model.max_len == 128


@pytest.mark.transformers
@pytest.mark.parametrize("fam", FAMILIES)
def test_live_transformers_reloads_the_export(imported, tmp_path, fam):
  """Our export loads in live transformers with the golden logits (skipped without torch)."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  hf.export_hf(str(imported / fam), str(tmp_path / "out"))
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
  g = _golden(fam)
  with torch.no_grad():
    again = back(torch.from_numpy(g["input_ids"])).logits.numpy()
  assert np.array_equal(again, g["logits"])


@pytest.mark.parametrize("fam", FAMILIES)
def test_hub_export_of_a_llama_prism_run_loads_back_bit_exact(imported, tmp_path, fam):
  import prism_jax  # pylint: disable=g-import-not-at-top
  from prism_jax.hf import hub  # pylint: disable=g-import-not-at-top
  hub.export_hub(str(imported / f"{fam}_prism"), str(tmp_path / "hub"))
  cfg = json.loads((tmp_path / "hub" / "config.json").read_text())
  assert cfg["model_type"] == fam and cfg["prism_jax"]["model"]["arch"] == "llama"
  ids = jnp.asarray(_golden(fam)["input_ids"], jnp.int32)
  want = prism_jax.load(str(imported / f"{fam}_prism")).model(ids).logits_BxTxV
  got = prism_jax.load(str(tmp_path / "hub")).model(ids).logits_BxTxV
  assert np.array_equal(np.asarray(got), np.asarray(want))


def test_ekfac_says_it_reads_gpt2_layers_only(imported):
  from prism_jax.attribution.hessians import ekfac  # pylint: disable=g-import-not-at-top
  model, _, _ = load_for_inference(str(imported / "llama_prism"))
  with pytest.raises(ValueError, match="model.arch='llama' is not supported by it yet"):
    ekfac.layer_names(model)
