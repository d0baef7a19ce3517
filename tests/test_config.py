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
  with pytest.raises(ValueError, match=r"train.grad_accum must be >= 1"):
    C.TrainConfig(grad_accum=0)
  with pytest.raises(ValueError, match="train.batch_size=16 must be divisible by "
                                       "train.grad_accum=3"):
    C.TrainConfig(batch_size=16, grad_accum=3)
  with pytest.raises(ValueError, match=r"train.revive_every must be >= 0 \(0: never\)"):
    C.TrainConfig(revive_every=-1)


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
  with pytest.raises(ValueError, match="model.k=4096 exceeds"):
    C.model_preset("tiny", k=4096)
  assert json.loads(C.to_json(cfg))["model"]["num_prototypes"] == 2048


def test_gpt2_recipes_budget_batch_lr_and_placement():
  """Each GPT-2 recipe: ~20 tokens per PRISM parameter (analytic count), 512 x 1024 tokens
  a step, GPT-3's peak LR by size, warm-up, bank init, evals and checkpoints inside the run."""
  from prism_jax import flops  # pylint: disable=import-outside-toplevel
  gpt3_lr = {"small": 6e-4, "medium": 3e-4, "large": 2.5e-4, "xl": 2e-4, "llama_1b": 2e-4}
  for name, lr in gpt3_lr.items():
    cfg = C.preset(name)
    tc = cfg.train
    params = flops.param_counts(cfg.model)["prism"]
    tokens = tc.steps * tc.batch_size * cfg.data.seq_len
    assert tc.batch_size * cfg.data.seq_len == 524_288 and cfg.data.seq_len == 1024
    assert 20 <= tokens / params < 20 * (1 + 100 * 524_288 / (20 * params))  # rounded up
    assert tc.steps % 100 == 0 and tc.lr == lr and tc.min_lr_ratio == 0.1
    assert 0 < tc.warmup_steps <= tc.steps // 10
    assert tc.warmup_steps == min(715, tc.steps // 10)  # 375M tokens / 524,288
    assert tc.proto_init_step == "auto" and C.bank_init_problem(cfg) is None
    assert C.latest_proto_init(tc) == tc.steps // 2
    assert tc.steps // tc.eval_every == 50 and tc.steps // tc.ckpt_every >= 5
    assert cfg.data.tokenizer == ("bpe" if name == "llama_1b" else "gpt2")


def test_steps_rescale_the_recipe_and_explicit_sets_win():
  from prism_jax.cli.train import build_config  # pylint: disable=import-outside-toplevel
  full = C.preset("medium")
  for steps in (2, 40, 1000, 100_000):
    cfg = build_config("medium", None, None, [f"train.steps={steps}"])
    tc = cfg.train
    assert tc.steps == steps and cfg.model == full.model and tc.lr == full.train.lr
    assert C.bank_init_problem(cfg) is None, steps
    assert tc.proto_init_step == "auto" and 1 <= C.latest_proto_init(tc) < steps
    assert tc.warmup_steps <= max(steps // 10, 0) and tc.warmup_steps <= 715
    assert 1 <= tc.eval_every <= steps and 1 <= tc.ckpt_every <= steps
  assert build_config("medium", None, None, ["train.steps=1000"]).train == C.preset(
      "medium", 1000).train
  assert C.preset("medium", 1000).train.proto_init_step == "auto"
  assert C.latest_proto_init(C.preset("medium", 1000).train) == 500  # half the run
  one = C.preset("medium", 1)  # no evaluation to decide at: the bank from the start
  assert one.train.proto_init_step == 0 and C.bank_init_problem(one) is None
  cfg = build_config("small", None, None, ["train.steps=1000", "train.warmup_steps=7",
                                           "train.proto_init_step=9"])
  assert (cfg.train.steps, cfg.train.warmup_steps, cfg.train.proto_init_step) == (1000, 7, 9)
  with pytest.raises(ValueError, match="train.steps='ten': expected int"):
    build_config("small", None, None, ["train.steps=ten"])
  with pytest.raises(ValueError, match="train.steps must be positive"):
    build_config("small", None, None, ["train.steps=0"])


def test_smoke_presets_and_names():
  smoke = C.preset("small_smoke")
  assert smoke.model == C.model_preset("small")
  assert (smoke.train.steps, smoke.train.batch_size, smoke.train.proto_init_step) == (10, 8, 5)
  assert C.bank_init_problem(smoke) is None
  assert C.preset("xl_smoke").model == C.model_preset("xl")
  assert C.preset("tiny") == C.Config(model=C.model_preset("tiny"),
                                      loss=C.LossConfig(lambda_proto_kl=1.0),
                                      data=C.DataConfig(seq_len=128))
  assert C.preset("tiny", 30).train == C.TrainConfig(steps=30)
  demo = C.preset("demo")  # the tiny backbone, issue 53's bank and recipe
  assert demo.model == C.model_preset("tiny", num_prototypes=16384, k=16, mixture="nnls",
                                      proto_init_pick="uniform")
  assert (demo.train.steps, demo.train.proto_init_step, demo.train.trainable) == (
      600, 580, "prototypes")
  assert C.preset("demo", 100).train.proto_init_step == 80  # the bank's last 20 steps
  assert demo.loss == C.preset("tiny").loss and demo.data == C.preset("tiny").data
  assert set(C.preset_names()) == {"tiny", "demo", "small", "medium", "large", "xl",
                                   "llama_1b", "small_smoke", "medium_smoke", "large_smoke",
                                   "xl_smoke", "llama_1b_smoke"}
  llama = C.preset("llama_1b_smoke")
  assert llama.model.arch == "llama" and llama.data.tokenizer == "bpe"
  for bad in ("tiny_smoke", "huge", "small_smokes"):
    with pytest.raises(ValueError, match=f"unknown preset '{bad}'"):
      C.preset(bad)


def test_a_bank_never_set_from_data_is_refused(tmp_path):
  """The refusal: one line naming both settings, before anything is prepared or written;
  random prototypes (model.proto_init=normal) and the dense twin are not refused."""
  from prism_jax.train import apply_overrides, train  # pylint: disable=import-outside-toplevel
  cfg = apply_overrides(C.preset("small"), ["train.steps=100", "train.proto_init_step=250"])
  problem = C.bank_init_problem(cfg)
  assert problem == (
      "train.proto_init_step=250 >= train.steps=100: the prototype bank would never be set "
      "from data; lower train.proto_init_step or raise train.steps (a GPT-2 recipe places it "
      "by its steps: preset(name, steps) or --set train.steps=N), or set model.proto_init="
      "normal for random prototypes")
  with pytest.raises(ValueError) as e:
    train(cfg, str(tmp_path / "run"))
  assert str(e.value) == problem and "\n" not in problem
  assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
  at_end = apply_overrides(cfg, ["train.proto_init_step=100"])
  assert C.bank_init_problem(at_end).startswith("train.proto_init_step=100 >= train.steps=100")
  assert C.bank_init_problem(apply_overrides(cfg, ["train.proto_init_step=99"])) is None
  assert C.bank_init_problem(apply_overrides(cfg, ["model.proto_init=normal"])) is None
  assert C.bank_init_problem(apply_overrides(cfg, ["model.kind=dense"])) is None


def test_the_cli_refuses_it_in_one_line(tmp_path):
  import os, subprocess, sys  # pylint: disable=import-outside-toplevel,multiple-imports
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=repo)
  out = subprocess.run([sys.executable, "-m", "prism_jax.cli", "train", "--config=tiny",
                        f"--workdir={tmp_path / 'run'}", "--set=train.steps=30"],
                       cwd=repo, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 2, out.stderr[-2000:]
  assert out.stderr.strip().splitlines()[-1] == (
      "error: train.proto_init_step=50 >= train.steps=30: the prototype bank would never be "
      "set from data; lower train.proto_init_step or raise train.steps (a GPT-2 recipe "
      "places it by its steps: preset(name, steps) or --set train.steps=N), or set "
      "model.proto_init=normal for random prototypes")
  assert not (tmp_path / "run").exists()
