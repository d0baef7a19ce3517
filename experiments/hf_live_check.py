"""Llama-family import and export checked against live transformers, once, for RESULTS.

  python -m experiments.hf_live_check --torch_python=/tmp/hfvenv/bin/python \
      [--results_json=docs/results/hf_llama.json]

For each golden checkpoint of tests/golden/hf_llama_family (a Llama 3 model with GQA,
untied head and rope scaling; a Qwen2 model with q/k/v biases), `--torch_python` (an
interpreter with torch and transformers: the golden NOTE.md says how to make one) runs
transformers now on the checkpoint and on our export of its import: logits on the golden
ids and 32 greedy tokens. Reported: our imported logits' largest error relative to the
logits' scale, whether our 32 greedy tokens equal transformers' `generate`, and whether
transformers computes bit-identical logits from our export. The default suite checks the
same against the committed goldens without torch (tests/test_hf_llama.py).
"""

import json
import os
import subprocess
import tempfile

from absl import flags

from prism_jax.cli import launcher as cli
from prism_jax.cli import provenance

flags.DEFINE_string("torch_python", None, "python with torch and transformers", required=True)
flags.DEFINE_string("results_json", None, "write the result here (docs/results/hf_llama.json)")
FLAGS = flags.FLAGS

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "tests", "golden", "hf_llama_family")
FAMILIES = ("llama", "qwen2")
LIVE = """
import json, sys, numpy as np, torch, transformers
from safetensors.numpy import load_file
ids = torch.from_numpy(load_file(sys.argv[1])["input_ids"])
out = {"transformers": transformers.__version__, "torch": torch.__version__}
for name, path in (("source", sys.argv[2]), ("export", sys.argv[3])):
  m = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
  with torch.no_grad():
    out[name] = {"class": type(m).__name__, "logits": m(ids).logits.numpy().tolist(),
                 "greedy": m.generate(ids, max_new_tokens=32, do_sample=False,
                                      attention_mask=torch.ones_like(ids), eos_token_id=None,
                                      pad_token_id=0).numpy()[:, ids.shape[1]:].tolist()}
print(json.dumps(out))
"""


def check(fam: str, tmp: str) -> dict:
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  from prism_jax import hf  # pylint: disable=g-import-not-at-top
  from prism_jax.generate import generate  # pylint: disable=g-import-not-at-top
  from prism_jax.loading import load_for_inference  # pylint: disable=g-import-not-at-top
  src = os.path.join(GOLDEN, fam)
  golden = os.path.join(src, "golden.safetensors")
  run, out = os.path.join(tmp, fam), os.path.join(tmp, fam + "_export")
  hf.import_hf(src, run)
  hf.export_hf(run, out)
  live = json.loads(subprocess.run([FLAGS.torch_python, "-c", LIVE, golden, src, out],
                                   check=True, capture_output=True, text=True).stdout)
  ids = load_file(golden)["input_ids"]
  model, cfg, _ = load_for_inference(run)
  want = np.asarray(live["source"]["logits"], np.float32)
  got = np.asarray(model(jnp.asarray(ids, jnp.int32)).logits_BxTxV)[..., :want.shape[-1]]
  ours = generate(model, ids.tolist(), max_new_tokens=32, temperature=0.0)
  m = cfg.model
  return {"family": fam, "class": live["source"]["class"],
          "shape": f"d {m.d_model}, {m.n_layers} layers, {m.n_heads} q / {m.kv_heads} kv heads",
          "max_error_rel_to_scale": float(np.abs(got - want).max() / np.abs(want).max()),
          "greedy_32_equal": np.asarray(ours.tokens_BxL)[:, -32:].tolist()
                             == live["source"]["greedy"],
          "export_logits_bit_equal": live["export"]["logits"] == live["source"]["logits"],
          "export_class": live["export"]["class"],
          "transformers": live["transformers"], "torch": live["torch"]}


def main(argv):
  del argv
  with tempfile.TemporaryDirectory() as tmp:
    rows = [check(fam, tmp) for fam in FAMILIES]
  for r in rows:
    print(f"{r['family']}: {r['class']} ({r['shape']}): logits within "
          f"{r['max_error_rel_to_scale']:.1e} of the scale, greedy 32 equal "
          f"{r['greedy_32_equal']}, export reloads bit-equal {r['export_logits_bit_equal']} "
          f"(transformers {r['transformers']})")
  if FLAGS.results_json:
    provenance.write_results(FLAGS.results_json, {"rows": rows},
                             module="experiments.hf_live_check")


if __name__ == "__main__":
  cli.run(main)
