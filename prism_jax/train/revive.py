"""Reviving prototypes nobody uses: a bank that stays alive as the backbone moves.

The bank is set from hidden states once (train.proto_init_step). If the backbone is still
young then (a cut run, an early init), its states share one large common direction: under
cosine routing the few prototypes nearest that direction win every token's top-k, and as
the backbone trains the states spread out and away from where the bank was put. Prototypes
that no token selects get no gradient from CE, so nothing brings them back: the `small`
rehearsal ended with 8,171 of 8,192 never selected (issue 44, item 4).

Every `train.revive_every` steps after the init (0: never), `revive_dead` routes a window of
the coming training tokens (at least max(REVIVE_MIN_TOKENS, 2K), from the global batches
every process reads alike), counts how often each prototype is selected, and sets every
prototype selected by none of them to the hidden state of a token, drawn by k-means++ from
the window with the prototypes still in use as the starting centres (so the new ones go
where the live bank covers the tokens worst). Their Adam moments are zeroed; nothing else
changes, so a bank with no dead prototype is left bit for bit as it was. Deterministic in
(train.seed, step) and the parameters: a resumed run revives the same ones.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from prism_jax.config import Config
from prism_jax.model.lm import kmeans_pp_pick
from prism_jax.train.optimizer import PROTO_PATH, reset_moments
from prism_jax.train.state import TrainState

REVIVE_MIN_TOKENS = 8192  # "alive": selected at least once over this many tokens


def revive_due(cfg: Config, step: int, bank_set_at: int | None = None) -> bool:
  """Whether revival runs before `step`: every train.revive_every steps once the bank is set
  (at `bank_set_at`; default train.proto_init_step, which "auto" leaves to the recipe)."""
  every = cfg.train.revive_every
  init = cfg.train.proto_init_step if bank_set_at is None else bank_set_at
  return (cfg.model.kind == "prism" and every > 0 and init != "auto" and step > init
          and step % every == 0)


def window_tokens(loader, cfg: Config, step: int) -> tuple[np.ndarray, np.ndarray]:
  """Rows of the global batches from `step` on until they hold enough valid tokens."""
  need = max(REVIVE_MIN_TOKENS, 2 * cfg.model.num_prototypes)
  toks, masks, got, s = [], [], 0, step
  while got < need and len(toks) < 64:
    b = loader.global_batch_at(s)
    for row_t, row_m in zip(b["inputs"], b["mask"]):
      toks.append(row_t)
      masks.append(row_m)
      got += int(row_m.sum())
      if got >= need:
        break
    s += 1
  return np.stack(toks), np.stack(masks)


def usage_and_states(graphdef, params, tokens_BxT, mask_BxT, mesh):
  """(selections per prototype (K,), hidden states of the valid tokens (N, D), the bank),
  read replicated so that every process holds the same values."""
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def route(params, tokens, mask):
    model = nnx.merge(graphdef, params)
    out = model(tokens, mask_BxT=mask)
    return out.z_BxTxD, out.protos.idx_Nxk, model.bank.protos[...]

  z, idx, bank = jax.jit(route, out_shardings=replicated)(params, tokens_BxT, mask_BxT)
  valid = np.asarray(mask_BxT, bool).reshape(-1)
  idx = np.asarray(idx)[valid]
  usage = np.bincount(idx.reshape(-1), minlength=bank.shape[0])
  return usage, np.asarray(z).reshape(-1, z.shape[-1])[valid], np.asarray(bank)


def revive_dead(graphdef, state: TrainState, shardings: TrainState, cfg: Config,
                tokens_BxT: np.ndarray, mask_BxT: np.ndarray) -> tuple[TrainState, int, int]:
  """(state, prototypes revived, tokens routed): see the module doc."""
  mesh = shardings.step.mesh
  usage, z_NxD, bank_KxD = usage_and_states(graphdef, state.params, tokens_BxT, mask_BxT, mesh)
  dead = np.flatnonzero(usage == 0)
  if not len(dead):
    return state, 0, len(z_NxD)
  step = int(jax.device_get(state.step))
  rng = np.random.default_rng(np.random.SeedSequence([cfg.train.seed, step, 0xBA2C]))
  picks = kmeans_pp_pick(z_NxD, min(len(dead), len(z_NxD)), rng,
                         centres_CxD=bank_KxD[usage > 0])
  dead = dead[:len(picks)]
  bank = bank_KxD.copy()
  bank[dead] = z_NxD[picks].astype(np.float32)
  params = jax.tree.map(lambda x: x, state.params)
  params[PROTO_PATH[0]][PROTO_PATH[1]] = jax.device_put(
      bank, shardings.params[PROTO_PATH[0]][PROTO_PATH[1]])
  opt_state = jax.device_put(reset_moments(state.opt_state, rows=dead), shardings.opt_state)
  return TrainState(state.step, params, opt_state), len(dead), len(z_NxD)
