"""The LDS model's recipe, pinned: every model option and loss weight, and every data and
optimisation setting that changes what a retrain learns, written out here rather than
taken from a preset (the tiny preset moved from λ_proto 1 to λ_proto_kl 1 after the first
LDS run, which silently changed what `experiments.lds` trained). No flags here, so a test
can import it beside other scripts.

Sized for the shared 2-core box: one retrain of the tiny preset itself (d 128, 4 layers,
64 tokens) took 145 s there; this one ~20 s (docs/history/RESULTS-to-2026-12-06.md, issue 17).
"""

from __future__ import annotations

from prism_jax.config import Config

# λ_proto_kl 1 (the tiny preset's default since issue 11's faithfulness sweep). The previous
# setting, λ_proto 1: --set=loss.lambda_proto=1 --set=loss.lambda_proto_kl=0.
RECIPE = {
    "model.kind": "prism", "model.vocab_size": 512, "model.max_len": 64,
    "model.d_model": 64, "model.n_layers": 2, "model.n_heads": 2, "model.mlp_ratio": 4,
    "model.num_prototypes": 128, "model.k": 4, "model.residual_routing": "straight_through",
    "model.mixture": "normalized", "model.distance": "cosine", "model.mixture_scale": "none",
    "model.residual_dropout": 0.0, "model.proto_init": "data", "model.proto_init_pick": "kmeans++", "model.implementation": None,
    "model.bias": True, "model.dropout": 0.0, "model.dtype": "float32", "model.remat": False,
    "model.init_std": 0.02, "model.vocab_used": 0,
    "model.arch": "gpt2", "model.mlp_dim": 0, "model.n_kv_heads": 0, "model.qkv_bias": False,
    "model.rope_theta": 10000.0, "model.rope_scaling_factor": 0.0,
    "model.rope_low_freq_factor": 1.0, "model.rope_high_freq_factor": 4.0,
    "model.rope_original_max_len": 8192, "model.norm_eps": 1e-5, "model.tie_embeddings": True,
    "loss.lambda_rec": 0.05, "loss.lambda_r1": 0.1, "loss.lambda_r2": 1.0,
    "loss.rec_kind": "relative", "loss.rec_ramp_steps": 0, "loss.lambda_proto": 0.0,
    "loss.lambda_rlogit": 0.0, "loss.lambda_proto_kl": 1.0,
    "data.sources": (), "data.val_sources": (), "data.text_field": "text",
    "data.tokenizer": "bpe", "data.seq_len": 32, "data.val_fraction": 0.05,
    "data.txt_documents": "paragraphs", "data.on_decode_error": "replace", "data.seed": 0,
    "data.split_seed": 0,
    "train.steps": 150, "train.batch_size": 16, "train.lr": 3e-3, "train.warmup_steps": 15,
    "train.min_lr_ratio": 0.1, "train.weight_decay": 0.1, "train.b1": 0.9, "train.b2": 0.95,
    "train.grad_clip": 1.0, "train.seed": 0, "train.proto_init_step": 30,
    "train.proto_init_cos": 0.6, "train.proto_init_latest": 0,
    "train.init_from": "", "train.trainable": "all", "train.revive_every": 0,
    "train.grad_accum": 1,
}
# What a retrain does not read (evaluation, checkpoints, logging, the data cache's path,
# the mesh: a retrain runs on one device).
UNPINNED = ("data.packed_dir", "train.eval_every", "train.eval_batches", "train.eval_at_start",
            "train.ckpt_every", "train.keep_checkpoints", "train.log_every", "train.log_to",
            "mesh.")


def config(overrides=()) -> Config:
  """RECIPE on the library's defaults (no preset), then `overrides` (--set)."""
  from prism_jax.train import apply_overrides  # pylint: disable=g-import-not-at-top
  return apply_overrides(apply_overrides(Config(), dict(RECIPE)), list(overrides))
