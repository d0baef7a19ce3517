"""prism_jax.train: optimiser, sharded state, jitted steps, loop, orbax checkpoints, metrics.

  cfg = apply_overrides(preset("tiny"), ["model.k=8", "train.steps=100"])
  result = train(cfg, "runs/x")                   # resumes from runs/x if present
  result.final_step, result.eval, result.state    # a TrainResult; .summary() is JSON
  Recipe(cfg, mesh)                               # PRISM's recipe: phases, bank init, revival
  Trainer(loss_fn, tx, trainable=pred).fit(params, batches, steps=100)  # any loss
  cfg = load_config("runs/x"); graphdef, params, cfg, step = load_params("runs/x")
  (a trained run for inference: prism_jax.loading.load_for_inference, or prism_jax.load)
"""

from prism_jax.train.checkpoint import (Checkpointer, ConfigMismatchError,
                                        NoReadableCheckpointError, load_config, load_params)
from prism_jax.train.integrity import CheckpointCorruptError
from prism_jax.train.validation import Evaluator, evaluate
from prism_jax.train.run import TrainResult, prepare, train
from prism_jax.train.metrics import read_metrics
from prism_jax.train.optimizer import decay_mask, lr_schedule, make_optimizer, reset_moments
from prism_jax.train.recipe import Recipe, init_prototypes
# Building a config lives in prism_jax.config; these names stay here for existing callers.
from prism_jax.config import apply_overrides, config_diff, config_from_dict, valid_keys
from prism_jax.train.state import (TrainState, abstract_state, create_train_state,
                                   default_mesh, state_shardings)
from prism_jax.train.step import make_eval_step, make_train_step
from prism_jax.train.engine import (Loop, LoopResult, Trainer, TrainingDivergedError,
                                     make_step)

__all__ = [
    "CheckpointCorruptError", "Checkpointer", "ConfigMismatchError", "Evaluator", "Loop",
    "LoopResult", "NoReadableCheckpointError", "Recipe", "TrainResult", "TrainState", "Trainer",
    "TrainingDivergedError", "abstract_state", "apply_overrides", "config_diff",
    "config_from_dict", "create_train_state", "decay_mask", "default_mesh", "evaluate",
    "init_prototypes", "load_config", "load_params", "lr_schedule",
    "make_eval_step", "make_optimizer", "make_step", "make_train_step",
    "prepare", "read_metrics", "reset_moments", "state_shardings", "train", "valid_keys",
]
