"""Hugging Face GPT-2 checkpoints in and out (safetensors; no torch at run time).

    from prism_jax import hf
    hf.import_hf("gpt2_dir", "runs/gpt2", kind="dense")   # then load_for_inference
    hf.export_hf("runs/x", "x_hf")                        # GPT2LMHeadModel.from_pretrained
"""

from prism_jax.hf.convert import export_hf, import_hf, read_hf
from prism_jax.hf.gpt2_config import HFFormatError, hf_config, model_config
from prism_jax.hf.hf_dir import is_hf_dir

__all__ = ["HFFormatError", "export_hf", "hf_config", "import_hf", "is_hf_dir",
           "model_config", "read_hf"]
