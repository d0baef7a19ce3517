"""The control edit of PRISM.md §6 on a PrismLM's logits, for samplers and scorers alike.

    logits_BxTxV = controlled_logits(model, out, gains_K)   # out = model(tokens_BxT)

The edit scales each active prototype's share of the logits by its gain,
    ℓ'_t = ℓ_t − Σ_{i∈S_t} (1 − g_i) a_{t,i} W p_i,
keeping the routing S_t, the activations a_{t,i} and the residual r_t of the unedited pass
(recomputing the residual would cancel the edit). g = 0 on G is suppression; g_i = 1 + w_i
is the gain controller ℓ' = ℓ + Σ_i w_i a_{t,i} W p_i. The sampler (generate.py) applies
it per decoded token; a teacher-forced scorer applies it to a whole (B, T, V) pass. The
gains themselves are built and checked in prism_jax/control/steering.py (`gains_vector`,
`suppression_gains`), from a dict, an array, an id list or a saved set.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from prism_jax.model.lm import LMOutput, PrismLM
from prism_jax.model.prototypes import sparse_mixture
from prism_jax.model.trust import Trust, token_trust


def controlled_logits(model: PrismLM, out: LMOutput, gains_K: jax.Array) -> jax.Array:
  """`out.logits_BxTxV` after the gains edit; `out` is the unedited pass of `model`.

  Args:
    model: the PrismLM (a DenseLM has no prototypes: ValueError) whose bank and LM head
      give each prototype's logit share W p_i.
    out: the unedited `LMOutput` of one forward pass of `model`: its `logits_BxTxV` and
      `protos`, which holds the B·T tokens flattened row-major (as PrismLM returns them),
      so a sampler passes its decoded rows as a (B, 1, V) output.
    gains_K: one gain g_i per prototype, shape (K,) (cast to float32): 1 leaves a
      prototype's share unchanged, 0 removes it (`control.steering.suppression_gains`), 1 + w_i
      scales it.

  Returns:
    The edited logits ℓ' = ℓ − Σ_{i∈S_t} (1 − g_i) a_{t,i} W p_i, float32 (B, T, V).
  """
  if not isinstance(model, PrismLM) or out.protos is None:
    raise ValueError("controlled_logits needs a PrismLM and its output: the dense model "
                     "has no prototypes")
  num_protos = model.cfg.num_prototypes
  gains_K = jnp.asarray(gains_K, jnp.float32)
  if gains_K.shape != (num_protos,):
    raise ValueError(f"gains_K must have shape (K,)=({num_protos},), got {gains_K.shape}")
  logits_BxTxV = out.logits_BxTxV
  batch, seq, _ = logits_BxTxV.shape
  protos = out.protos
  if protos.idx_Nxk.shape[0] != batch * seq:
    raise ValueError(f"out.protos has {protos.idx_Nxk.shape[0]} tokens, the logits "
                     f"{batch}x{seq}: pass the output of one forward pass")
  drop_Nxk = (1.0 - gains_K[protos.idx_Nxk]) * protos.act_Nxk
  delta_NxV = code_logits(model, model.bank.protos[...], protos.idx_Nxk, drop_Nxk)
  return logits_BxTxV - delta_NxV.reshape(batch, seq, -1)


def code_logits(model, dict_KxD: jax.Array, idx_Nxk: jax.Array,
                coef_Nxk: jax.Array) -> jax.Array:
  """W Σ_j coef_{t,j} d_{idx_{t,j}}, (N, V): the logit share of a sparse code over a
  dictionary (a PrismLM's prototypes; an SAE's decoder rows on a DenseLM's hidden state).
  The edit above and the controllers (control/controllers.py) both go through it."""
  delta_NxD = sparse_mixture(coef_Nxk, idx_Nxk, jnp.asarray(dict_KxD))
  return model.backbone.lm_head(delta_NxD[None])[0]


def edited_trust(model, protos, logits_NxV: jax.Array, gains_K: jax.Array | None = None
                 ) -> Trust:
  """The trust of (edited) logits (prism_jax/model/trust.py): whether their prototype path
  W z_hat, each activation scaled by its prototype's gain, picks their top-1. `logits_NxV`:
  `controlled_logits` with the same gains (or the model's own logits with gains None)."""
  act_Nxk = protos.act_Nxk if gains_K is None else protos.act_Nxk * gains_K[protos.idx_Nxk]
  return token_trust(logits_NxV, code_logits(model, model.bank.protos[...], protos.idx_Nxk,
                                             act_Nxk))
