"""Plain-text report of a generation: each token with its top prototypes (PRISM.md §1).

    text = token_report(out, tokenizer.decode, row=0, top=3)

For PRISM each generated token gets one line: its id and text, the sampled logit, the
residual slice <W_y, r_t>, its trust mark (prism_jax/model/trust.py: "proto 87%" when
argmax W z_hat is the model's top-1, with the prototypes' share of the top-1's lead;
"RESIDUAL" when the residual decided it, so the prototypes listed do not explain it) and
the `top` active prototypes by contribution, as `#id a=activation c=contribution`. The
contributions over all k active prototypes plus the residual slice sum to the logit. A
closing line counts the tokens the residual decided.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from prism_jax.data.tokenizers import piece_fn

from prism_jax.generate import GenerationOutput
from prism_jax.model.trust import trust_label

Decode = Callable[[Iterable[int]], str]


def token_text(decode: Decode, token_id: int) -> str:
  """One token as a short printable literal (a partial UTF-8 byte as <0xNN>)."""
  return repr(piece_fn(decode)(token_id))


def signature_line(model, proto_id: int, decode: Decode, n: int = 3) -> str:
  """The tokens prototype `proto_id` pushes up most (top entries of W p_i), each as
  `token_text` shows it: the demo's signature line."""
  sig_V = np.asarray(model.proto_logit_signatures()[proto_id])
  return " ".join(token_text(decode, int(t)) for t in np.argsort(-sig_V, kind="stable")[:n])


def token_rows(out: GenerationOutput, row: int = 0, top: int = 3) -> list[dict]:
  """Per generated token of batch row `row`: id, logit and (PRISM) top prototypes, residual."""
  if not 0 <= row < out.tokens_BxL.shape[0]:
    raise ValueError(f"row={row} is outside the batch of {out.tokens_BxL.shape[0]}")
  if top < 1:
    raise ValueError(f"top must be >= 1, got {top}")
  rows = []
  for t in range(int(out.lengths_B[row])):
    entry = {"step": t, "token": int(out.tokens_BxL[row, t]),
             "logit": float(out.logit_BxL[row, t])}
    if out.trace is not None:
      tr = out.trace
      contrib_k = tr.contrib_BxLxk[row, t]
      order = np.argsort(-contrib_k, kind="stable")[:top]
      entry["prototypes"] = [(int(tr.idx_BxLxk[row, t, j]), float(tr.act_BxLxk[row, t, j]),
                              float(contrib_k[j])) for j in order]
      entry["proto_total"] = float(contrib_k.sum())
      entry["residual"] = float(tr.residual_BxL[row, t])
      entry["agrees"] = bool(tr.agrees_BxL[row, t])
      entry["proto_share"] = float(tr.proto_share_BxL[row, t])
      entry["proto_top1"] = int(tr.proto_top1_BxL[row, t])
    rows.append(entry)
  return rows


def token_report(out: GenerationOutput, decode: Decode, *, row: int = 0, top: int = 3) -> str:
  """The generated text of `row`, then one line per token (see module docstring)."""
  n = int(out.lengths_B[row]) if 0 <= row < len(out.lengths_B) else 0
  lines = [f"generated text: {decode(out.tokens_BxL[row, :n].tolist())!r}"]
  if out.trace is not None:
    lines.append("step     id token        logit  = protos  + residual | trust      | top "
                 "prototypes (#id a=activation c=contribution)")
  rows = token_rows(out, row, top)
  for e in rows:
    head = (f"{e['step']:>4} {e['token']:>6} {token_text(decode, e['token'])[:10]:<10} "
            f"{e['logit']:>8.3f}")
    if "prototypes" not in e:
      lines.append(head)
      continue
    protos = "  ".join(f"#{i} a={a:.3f} c={c:+.3f}" for i, a, c in e["prototypes"])
    mark = trust_label(e["agrees"], e["proto_share"])
    lines.append(f"{head}  = {e['proto_total']:>+7.3f} + {e['residual']:>+7.3f} | "
                 f"{mark.upper() if mark == 'residual' else mark:<10} | {protos}")
  if out.trace is not None and rows:
    decided = sum(not e["agrees"] for e in rows)
    lines.append(f"trust: the prototypes pick the model's top-1 on {len(rows) - decided} of "
                 f"{len(rows)} tokens; RESIDUAL marks the {decided} the residual decided "
                 "(their prototypes do not explain them)")
  return "\n".join(lines)
