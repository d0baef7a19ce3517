"""The README model card of a Hub export (hf/hub.py): YAML metadata the Hub indexes, then
what a reader checks before trusting the model: its shape, the run's last validation
figures (CE, how far the prototypes carry the prediction) and how to load it."""

from __future__ import annotations

import json
import os

from prism_jax import paths
from prism_jax.config import Config

FIGURES = (("loss", "val CE", "{:.4f}"), ("perplexity", "val perplexity", "{:.2f}"),
           ("agreement", "agreement argmax W ẑ = argmax W z", "{:.1%}"),
           ("agreement_decisive", "agreement on decisive tokens", "{:.1%}"),
           ("proto_ce_ratio", "CE(W ẑ) / CE(W z)", "{:.3f}"),
           ("r1_bar", "R̄1", "{:.3f}"), ("r2_bar", "R̄2", "{:.3f}"),
           ("dead_frac", "prototypes unused on val", "{:.1%}"))


def last_eval(workdir: str) -> dict:
  """The run's last validation record of metrics.jsonl ({} without one)."""
  path = paths.join(workdir, "metrics.jsonl")
  if not paths.path(path).is_file():
    return {}
  last = {}
  for line in paths.path(path).read_text().splitlines():
    try:
      rec = json.loads(line)
    except ValueError:
      continue
    if rec.get("split") == "val":
      last = rec
  return last


def base_model(cfg: Config) -> str | None:
  """The Hugging Face model a retrofit started from: its source's import note (the
  directory it was imported from, by name), or None."""
  src = cfg.train.init_from
  note = os.path.join(src, "imported_from.json") if src else ""
  if not note or not os.path.isfile(note):
    return None
  with open(note, encoding="utf-8") as f:
    return os.path.basename(os.path.normpath(json.load(f)["hf_dir"]))


def model_card(workdir: str, cfg: Config, step: int, architecture: str) -> str:
  m = cfg.model
  base = base_model(cfg)
  meta = ["---", "library_name: prism_jax", "pipeline_tag: text-generation", "tags:",
          "- prism", "- prototypes", "- interpretability", f"- {m.arch}"]
  if base:
    meta.append(f"base_model: {base}")
  meta.append("---")
  ev = last_eval(workdir)
  shown = [(label, fmt, ev.get(key)) for key, label, fmt in FIGURES
           if m.kind == "prism" or key in ("loss", "perplexity")]
  figures = [f"| {label} | {fmt.format(v)} |" for label, fmt, v in shown
             if isinstance(v, (int, float)) and v == v]  # recorded and not NaN
  what = (f"a PRISM model: {architecture}'s backbone with a bank of {m.num_prototypes} "
          f"prototypes, {m.k} active per token ({m.mixture} mixture)" if m.kind == "prism"
          else f"a dense {architecture} (PRISM's dense twin)")
  lines = meta + ["", f"# {os.path.basename(os.path.normpath(workdir))}", "",
                  f"This is {what}; d {m.d_model}, {m.n_layers} layers, {m.n_heads} heads"
                  f"{f' ({m.kv_heads} key/value)' if m.kv_heads != m.n_heads else ''}, "
                  f"vocabulary {m.num_token_ids}, exported by prism_jax from step {step}.",
                  "", "```python", "import prism_jax",
                  'run = prism_jax.load("hf://ORG/NAME")  # or this directory',
                  'run.decompose("The prototypes of")', "```", "",
                  "`transformers.AutoModelForCausalLM.from_pretrained` loads the backbone "
                  "alone: its logits W z are the PRISM model's (W r + Σ a W p, exactly); the "
                  "bank is in `prism_head.safetensors`."]
  if figures:
    lines += ["", f"Validation at step {ev.get('step', step)} ({int(ev.get('tokens', 0)):,} "
              "tokens):", "", "| figure | value |", "|---|---|", *figures]
  return "\n".join(lines) + "\n"
