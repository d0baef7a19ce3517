"""Docstrings of the public API name every argument and what is returned (Google style:
`Args:` / `Returns:` sections, as `make docs` renders them)."""

import inspect
import re

import pytest

import prism_jax
from prism_jax.attribution.caching.cache import build_cache
from prism_jax.attribution.hessians.hessian_block import hessian_block
from prism_jax.attribution.scoring.influence import attribute_batch
from prism_jax.config import preset
from prism_jax.data import prepare_data
from prism_jax.model.lm import decompose
from prism_jax.control.steering import gain_map, gains_vector, suppression_gains
from prism_jax.model.logit_edit import controlled_logits
from prism_jax.model.prototypes import prototype_layer
from prism_jax.loading import load_for_inference
from prism_jax.runs import Run
from prism_jax.train import Trainer

RUN_METHODS = [getattr(Run, n) for n in ("generate", "decompose", "attribute", "report",
                                         "steer", "suppress", "hessian_block")]
FUNCTIONS = [prism_jax.load, load_for_inference, prototype_layer, decompose, controlled_logits, suppression_gains,
             gains_vector, gain_map,
             hessian_block, build_cache, attribute_batch, prepare_data, preset,
             Trainer.__init__, Trainer.init, Trainer.fit] + RUN_METHODS


def _section(doc: str, name: str) -> str:
  m = re.search(rf"^\s*{name}:\s*$(.*?)(?=^\s*[A-Z][a-z]+:\s*$|\Z)", doc, re.M | re.S)
  return m.group(1) if m else ""


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__qualname__)
def test_docstring_names_every_argument_and_the_return(fn):
  doc = inspect.getdoc(fn if fn.__name__ != "__init__" else fn.__self__ if hasattr(
      fn, "__self__") else fn) or ""
  if fn.__name__ == "__init__":  # a class documents its constructor in the class docstring
    doc = inspect.getdoc(Trainer) or ""
  sig = inspect.signature(fn)
  params = [p for p in sig.parameters if p not in ("self", "cls")]
  args = _section(doc, "Args")
  missing = [p for p in params if not re.search(rf"^\s*\**{p}\b[^:\n]*:", args, re.M)]
  assert not missing, f"{fn.__qualname__}: Args section misses {missing}"
  if fn.__name__ != "__init__" and sig.return_annotation not in (None, "None"):
    assert _section(doc, "Returns").strip(), f"{fn.__qualname__}: no Returns section"


def test_cards_property_is_documented():
  assert "CardSet" in (Run.cards.__doc__ or "")
