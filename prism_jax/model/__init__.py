"""Models: the functional prototype layer, the backbones (GPT-2's, the Llama family's, or a
user's registered one), PrismLM and DenseLM."""

from prism_jax.model.backbones import HiddenStateBackbone, register_backbone
from prism_jax.model.lm import (DenseLM, Decomposition, LMOutput, PrismLM, build_model,
                                decompose, init_prototypes_from_hidden)
from prism_jax.model.logit_edit import controlled_logits
from prism_jax.model.prototypes import PrototypeBank, PrototypeOutput, prototype_layer
from prism_jax.model.transformer import Backbone, KVCache

__all__ = [
    "Backbone", "DenseLM", "Decomposition", "HiddenStateBackbone", "KVCache", "LMOutput",
    "PrismLM", "PrototypeBank", "PrototypeOutput", "build_model", "controlled_logits",
    "decompose", "init_prototypes_from_hidden", "prototype_layer", "register_backbone",
]
