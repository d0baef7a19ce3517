"""Reviving unused prototypes (prism_jax/train/revive.py, issue 44 item 4).

A forced collapse at a cut shape: the final LayerNorm's bias gets a large component along a
random unit vector e, so every hidden state z points near e; the bank holds k prototypes set
to real hidden states and K - k set near -e, which no token can select (cosine ~ -1 while k
prototypes sit near +1). Then `revive_dead` must bring the bank back to life on a fresh
window of tokens, change nothing else, and be deterministic and idempotent.
"""

import secrets

import jax
import numpy as np

from prism_jax.config import Config, DataConfig, LossConfig, TrainConfig, model_preset
from prism_jax.train import revive
from prism_jax.train.optimizer import make_optimizer
from prism_jax.train.state import TrainState, create_train_state, default_mesh

K, SMALL_K, D, V, T = 64, 4, 32, 97, 16


def _collapsed(seed: int):
  cfg = Config(model=model_preset("tiny", vocab_size=V, max_len=T, d_model=D, n_layers=1,
                                  n_heads=2, num_prototypes=K, k=SMALL_K, init_std=0.3),
               loss=LossConfig(), data=DataConfig(seq_len=T),
               train=TrainConfig(seed=seed, revive_every=10, proto_init_step=5))
  mesh = default_mesh(cfg, jax.devices()[:1])
  tx = make_optimizer(cfg.train)
  with jax.set_mesh(mesh):
    graphdef, state, shardings = create_train_state(cfg, mesh, tx)
  rng = np.random.default_rng(seed)
  e = rng.normal(size=D)
  e /= np.linalg.norm(e)
  params = jax.tree.map(lambda x: x, state.params)
  params["backbone"]["ln_f"]["bias"] = jax.numpy.asarray(8.0 * e, jax.numpy.float32)
  tokens = rng.integers(0, V, (40, T)).astype(np.int32)
  mask = rng.random((40, T)) < 0.9
  state = TrainState(state.step, params, state.opt_state)
  _, z, _ = revive.usage_and_states(graphdef, params, tokens[:4], mask[:4], mesh)
  bank = np.asarray(-e + 0.01 * rng.normal(size=(K, D)), np.float32)
  bank[:SMALL_K] = z[:SMALL_K]
  params["bank"]["protos"] = jax.device_put(bank, shardings.params["bank"]["protos"])
  # non-zero Adam moments everywhere, so a reset is visible
  opt = jax.tree.map(lambda x: x + 0.5 if x.dtype == np.float32 else x, state.opt_state)
  return graphdef, TrainState(state.step, params, opt), shardings, cfg, tokens, mask, mesh


def _moments(opt_state):
  leaves = jax.tree_util.tree_leaves_with_path(opt_state)
  return {jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves
          if "protos" in jax.tree_util.keystr(p)}


def test_a_collapsed_bank_comes_back_to_life_and_nothing_else_moves():
  seed = secrets.randbits(16)
  graphdef, state, shardings, cfg, tokens, mask, mesh = _collapsed(seed)
  usage, _, bank0 = revive.usage_and_states(graphdef, state.params, tokens, mask, mesh)
  assert (usage > 0).sum() == SMALL_K, f"seed {seed}: the collapse was not forced"
  new, n, seen = revive.revive_dead(graphdef, state, shardings, cfg, tokens, mask)
  assert n == K - SMALL_K and seen == int(mask.sum())
  usage1, _, bank1 = revive.usage_and_states(graphdef, new.params, tokens, mask, mesh)
  assert (usage1 > 0).mean() >= 0.95, f"seed {seed}: {(usage1 > 0).sum()} alive of {K}"
  np.testing.assert_array_equal(bank1[:SMALL_K], bank0[:SMALL_K])  # live ones untouched
  assert not np.allclose(bank1[SMALL_K:], bank0[SMALL_K:])
  for key, m in _moments(new.opt_state).items():  # the revived rows' moments start at 0
    old = _moments(state.opt_state)[key]
    if m.ndim == 2:
      np.testing.assert_array_equal(m[SMALL_K:], 0.0, err_msg=key)
      np.testing.assert_array_equal(m[:SMALL_K], old[:SMALL_K], err_msg=key)
  for a, b in zip(jax.tree.leaves(new.params["backbone"]),
                  jax.tree.leaves(state.params["backbone"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # deterministic (a resume revives the same) and idempotent (an alive bank is left as is)
  again, n2, _ = revive.revive_dead(graphdef, state, shardings, cfg, tokens, mask)
  np.testing.assert_array_equal(np.asarray(again.params["bank"]["protos"]), bank1)
  same, n3, _ = revive.revive_dead(graphdef, new, shardings, cfg, tokens, mask)
  assert n3 == 0 and same is new


def test_revive_is_due_only_after_the_init_on_its_cadence():
  cfg = Config(train=TrainConfig(revive_every=10, proto_init_step=5))
  assert [s for s in range(41) if revive.revive_due(cfg, s)] == [10, 20, 30, 40]
  off = Config(train=TrainConfig(revive_every=0))
  assert not any(revive.revive_due(off, s) for s in range(100))
