"""Config validation: every bad value fails at construction with a message naming it."""

import dataclasses
import json

import pytest

from prism_jax import config as C


@pytest.mark.parametrize("overrides,match", [
    (dict(k=300, num_prototypes=256), "model.k=300 exceeds model.num_prototypes=256"),
    (dict(d_model=130, n_heads=4), "model.d_model=130 is not divisible by model.n_heads=4"),
    (dict(kind="moe"), "model.kind='moe' is not one of"),
    (dict(residual_routing="stop"), "model.residual_routing='stop'"),
    (dict(mixture="softmax"), "model.mixture='softmax'"),
    (dict(distance="l1"), "model.distance='l1'"),
    (dict(proto_init="zeros"), "model.proto_init='zeros'"),
    (dict(dtype="float16"), "model.dtype='float16'"),
    (dict(implementation="cuda"), "model.implementation='cuda' is not one of"),
    (dict(k=0), "model.k must be a positive int, got 0"),
    (dict(n_layers=-1), "model.n_layers must be a positive int"),
    (dict(k=2.5), "model.k must be a positive int, got 2.5"),
    (dict(num_prototypes="256"), "model.num_prototypes must be a positive int, got '256'"),
])
def test_model_config_errors(overrides, match):
  with pytest.raises(ValueError, match=match):
    C.ModelConfig(**overrides)


def test_implementation_choices_are_the_ops():
  """One tuple of kernel implementations: the config's Literal is the op's."""
  import typing  # pylint: disable=import-outside-toplevel
  from pallas_kernels.topk_reconstruct import api  # pylint: disable=import-outside-toplevel
  hint = typing.get_type_hints(C.ModelConfig)["implementation"]
  literal = next(a for a in typing.get_args(hint) if a is not type(None))
  assert (None,) + typing.get_args(literal) == api.IMPLEMENTATIONS
  for impl in api.IMPLEMENTATIONS:
    assert C.ModelConfig(implementation=impl).implementation == impl


def test_loss_data_train_errors():
  with pytest.raises(ValueError, match="loss.lambda_r1 must be >= 0"):
    C.LossConfig(lambda_r1=-0.1)
  with pytest.raises(ValueError, match="loss.rec_kind='l1'"):
    C.LossConfig(rec_kind="l1")
  with pytest.raises(ValueError, match="data.seq_len must be positive"):
    C.DataConfig(seq_len=0)
  with pytest.raises(ValueError, match="data.val_fraction"):
    C.DataConfig(val_fraction=1.0)
  with pytest.raises(ValueError, match="data.tokenizer='wordpiece'"):
    C.DataConfig(tokenizer="wordpiece")
  with pytest.raises(ValueError, match="train.batch_size must be positive"):
    C.TrainConfig(batch_size=0)
  with pytest.raises(ValueError, match="train.lr must be positive"):
    C.TrainConfig(lr=0.0)


def test_mesh_minus_one_rules():
  C.MeshConfig(data=-1, fsdp=2, model=1)
  C.MeshConfig(data=2, fsdp=-1, model=2)
  C.MeshConfig(data=2, fsdp=2, model=2)
  with pytest.raises(ValueError, match="at most one mesh axis may be -1"):
    C.MeshConfig(data=-1, fsdp=-1)
  with pytest.raises(ValueError, match="positive or -1"):
    C.MeshConfig(data=0)
  with pytest.raises(ValueError, match="positive or -1"):
    C.MeshConfig(model=-2)


def test_seq_len_must_fit_max_len():
  model = C.model_preset("tiny")
  C.Config(model=model, data=C.DataConfig(seq_len=model.max_len))
  with pytest.raises(ValueError, match="data.seq_len=129 exceeds model.max_len=128"):
    C.Config(model=model, data=C.DataConfig(seq_len=129))


def test_configs_are_frozen_and_presets_match_the_spec():
  cfg = C.preset("tiny")
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.model.k = 3  # type: ignore[misc]
  spec = {"small": (768, 12, 8192), "medium": (1024, 24, 8192), "large": (1280, 36, 16384),
          "xl": (1600, 48, 16384)}
  for name, (d, layers, num_protos) in spec.items():
    m = C.model_preset(name)
    assert (m.d_model, m.n_layers, m.num_prototypes, m.k) == (d, layers, num_protos, 16)
    assert (m.vocab_size, m.max_len) == (50257, 1024)
  assert C.model_preset("tiny", k=4).k == 4
  with pytest.raises(ValueError, match="unknown preset 'huge'"):
    C.model_preset("huge")
  with pytest.raises(ValueError, match="model.k=999 exceeds"):
    C.model_preset("tiny", k=999)
  assert json.loads(C.to_json(cfg))["model"]["num_prototypes"] == 512
