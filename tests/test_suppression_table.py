"""The suppression table's procedure (prism_jax/control/suppression_table.py): its
conditions, one row per condition against float64 NumPy, and the spec's selection against
the selectors called directly."""

import secrets

import numpy as np
import pytest

from prism_jax.config import model_preset
from prism_jax.control import behaviour_cis, selection, suppression_table as st
from prism_jax.control.suppression import ProtoSet
from prism_jax.model.lm import build_model

VOCAB, K, D = 64, 32, 16


def test_conditions_order_sizes_and_random_sets_outside_the_set():
  seed = secrets.randbits(32)
  rng = np.random.default_rng(seed)
  first = rng.choice(K, size=5, replace=False)
  second = rng.choice(K, size=5, replace=False)
  ban = rng.choice(VOCAB, size=3, replace=False)
  conds = st.conditions([("suppress (a)", first), ("other (b)", second)], ("token ban", ban),
                        K, refill=True, random_sets=4, seed=seed)
  names = [n for n, _ in conds]
  assert names == ["unedited", "suppress (a)", "other (b)", "token ban",
                   "random #0", "random #1", "random #2", "random #3"], f"seed {seed}"
  edits = dict(conds)
  assert edits["unedited"] == {}
  assert edits["suppress (a)"] == {"ids": tuple(first.tolist()), "refill": True}
  assert edits["token ban"] == {"ban": tuple(ban.tolist())}
  draws = [edits[f"random #{r}"]["ids"] for r in range(4)]
  for ids in draws:  # as many as the first set, distinct, none of them in it
    assert len(ids) == len(first) == len(set(ids)) and not set(ids) & set(first.tolist())
    assert all(0 <= i < K for i in ids)
  # the same seed draws the same sets; another seed (almost surely) others
  again = st.conditions([("suppress (a)", first)], ("token ban", ban), K, refill=True,
                        random_sets=4, seed=seed)
  assert [e["ids"] for n, e in again if n.startswith("random")] == draws
  with pytest.raises(ValueError, match="the first prototype set .* is empty"):
    st.conditions([("s", [])], ("ban", ban), K, refill=False, random_sets=1, seed=0)
  with pytest.raises(ValueError, match="do not fit a bank of 8"):
    st.conditions([("s", range(5))], ("ban", ban), 8, refill=False, random_sets=1, seed=0)


def test_condition_row_against_float64_numpy():
  seed = secrets.randbits(32)
  rng = np.random.default_rng(seed)
  base = rng.uniform(0.2, 1.0, size=200)
  after = base * rng.uniform(0.1, 0.9, size=200)
  q = {"ppl_before": float(rng.uniform(5, 9)), "ppl_after": float(rng.uniform(5, 9)),
       "kl": float(rng.uniform()), "argmax_change": float(rng.uniform())}
  row = st.condition_row("suppress", {"ids": (1, 2, 3), "refill": False}, after, q, base,
                         rate_ci=lambda x: behaviour_cis.bootstrap_mean(x, seed=1),
                         fall_ci=lambda b, a: behaviour_cis.bootstrap_ratio_change(b, a, seed=1))
  assert row["prototypes"] == 3 and row["banned_tokens"] == 0
  assert row["rate"]["mean"] == pytest.approx(after.mean(), rel=1e-12), f"seed {seed}"
  assert row["rate"]["lo"] <= row["rate"]["mean"] <= row["rate"]["hi"]
  assert row["rate_fall"]["mean"] == pytest.approx(1 - after.mean() / base.mean(), rel=1e-12)
  assert row["ppl_change"] == pytest.approx(q["ppl_after"] / q["ppl_before"] - 1, rel=1e-12)
  assert (row["kl"], row["argmax_change"]) == (q["kl"], q["argmax_change"])
  unedited = st.condition_row("unedited", {}, base, q, base,
                              rate_ci=behaviour_cis.bootstrap_mean, fall_ci=None)
  assert "rate_fall" not in unedited and unedited["prototypes"] == 0
  never = st.condition_row("token ban", {"ban": (4, 5)}, after, q, np.zeros_like(base),
                           rate_ci=behaviour_cis.bootstrap_mean, fall_ci=None)
  assert "rate_fall" not in never and never["banned_tokens"] == 2  # nothing to fall from


def test_random_over_suppression_against_numpy():
  rng = np.random.default_rng(secrets.randbits(32))
  falls = rng.uniform(-0.2, 0.9, size=5)
  rows = [{"condition": "unedited"}, {"condition": "suppress", "rate_fall": {"mean": falls[0]}},
          {"condition": "token ban", "rate_fall": {"mean": 0.5}}]
  rows += [{"condition": f"random #{r}", "rate_fall": {"mean": f}}
           for r, f in enumerate(falls[1:])]
  assert st.random_over_suppression(rows) == pytest.approx(
      np.abs(falls[1:]).mean() / abs(falls[0]), rel=1e-12)
  assert st.random_over_suppression(rows[:3]) is None  # no random rows
  assert st.random_over_suppression([rows[0], {"condition": "suppress"}] + rows[3:]) is None


def _model():
  cfg = model_preset("tiny", vocab_size=VOCAB, max_len=8, d_model=D, n_layers=1, n_heads=2,
                     num_prototypes=K, k=4, init_std=0.3)
  return build_model(cfg, seed=secrets.randbits(16))


def test_selection_from_spec_is_the_selector_it_names(tmp_path):
  model = _model()
  tokens = [3, 17, 40]
  got = st.selection_from_spec("logit_signature", model, ban_ids=tokens, num=6)
  assert got == selection.by_logit_signature(model, tokens, num=6)
  saved = ProtoSet.create(model, [5, 2, 9], [0.9, 0.4, 0.1], method="contrast", query="q")
  path = saved.save(str(tmp_path), name="s")
  from_file = st.selection_from_spec(f"file:{path}", model, num=6)
  assert (from_file.ids, from_file.scores, from_file.method) == ((5, 2, 9), (0.9, 0.4, 0.1),
                                                                "contrast")
  with pytest.raises(ValueError, match="needs the run's cards"):
    st.selection_from_spec("keywords:a,b", model, num=3)
  with pytest.raises(ValueError, match="unknown --select='nearest'"):
    st.selection_from_spec("nearest", model, num=3)
