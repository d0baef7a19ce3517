"""What `prism_jax.load`'s Run returns: explanations, generations, attributions and the
report page, each readable as text in a terminal and drawn as HTML in a notebook
(`_repr_html_`). Every explanation carries its trust mark (prism_jax/model/trust.py)."""

from __future__ import annotations

import dataclasses
import html
from typing import Any

from prism_jax import paths
from prism_jax.model.trust import trust_label

TOP_SHOWN = 3  # prototypes a token's line shows (all k are in the records)


@dataclasses.dataclass(frozen=True)
class TokenExplanation:
  """The model's logit of `token` at its position, split into prototype slices and the
  residual (they sum to `logit`), with the trust of the model's prediction there."""

  position: int  # index of `token` in the text's tokens (its prediction read at position-1)
  token: int
  text: str
  logit: float
  prototypes: tuple[tuple[int, float, float], ...]  # (id, activation, contribution), by |c|
  residual: float
  prediction: int  # argmax W z at this position
  prediction_text: str
  agrees: bool  # argmax W z_hat = the prediction: the prototypes pick it
  proto_share: float  # the prototypes' share of the prediction's lead (nan: a tie)

  @property
  def trust(self) -> str:
    return trust_label(self.agrees, self.proto_share)


@dataclasses.dataclass(frozen=True)
class Decomposition:
  """Per token of a text (after the first): see TokenExplanation. Displays itself."""

  text: str
  first: str
  tokens: tuple[TokenExplanation, ...]

  @property
  def residual_decided(self) -> list[TokenExplanation]:
    return [t for t in self.tokens if not t.agrees]

  def __str__(self) -> str:
    lines = [f"{'pos':>4} {'token':<14} {'logit':>8} = {'protos':>8} + {'residual':>8} | "
             f"{'prediction':<12} {'trust':<10} | top prototypes (#id c=contribution)"]
    for t in self.tokens:
      protos = "  ".join(f"#{i} c={c:+.3f}" for i, _, c in t.prototypes[:TOP_SHOWN])
      mark = "RESIDUAL" if not t.agrees else t.trust
      total = sum(c for _, _, c in t.prototypes)
      lines.append(f"{t.position:>4} {repr(t.text)[:14]:<14} {t.logit:>8.3f} = {total:>+8.3f} + "
                   f"{t.residual:>+8.3f} | {repr(t.prediction_text)[:12]:<12} {mark:<10} | "
                   f"{protos}")
    lines.append(f"the residual decided {len(self.residual_decided)} of {len(self.tokens)} "
                 "predictions (RESIDUAL: their prototypes do not explain them)")
    return "\n".join(lines)

  __repr__ = __str__

  def _repr_html_(self) -> str:
    rows = []
    for t in self.tokens:
      protos = ", ".join(f"#{i} ({c:+.2f})" for i, _, c in t.prototypes[:TOP_SHOWN])
      style = "" if t.agrees else " style='color:#c62828;font-weight:600'"
      rows.append(f"<tr><td>{t.position}</td><td><code>{html.escape(repr(t.text))}</code></td>"
                  f"<td>{t.logit:.3f}</td><td>{protos}</td><td>{t.residual:+.3f}</td>"
                  f"<td{style}>{html.escape('residual decided' if not t.agrees else t.trust)}"
                  f"</td><td><code>{html.escape(repr(t.prediction_text))}</code></td></tr>")
    return ("<table><thead><tr><th>pos</th><th>token</th><th>logit</th><th>top prototypes "
            "(contribution)</th><th>residual</th><th>trust</th><th>prediction</th></tr>"
            "</thead><tbody>" + "".join(rows) + "</tbody></table>"
            f"<p>the residual decided {len(self.residual_decided)} of {len(self.tokens)} "
            "predictions: their prototypes do not explain them</p>")


@dataclasses.dataclass(frozen=True)
class Generation:
  """A continuation and its per-token trace (prism_jax.generate.GenerationOutput)."""

  prompt: str
  text: str  # the continuation alone
  how: str  # "temperature 0.8, top-k 40, seed 0" or "greedy"
  output: Any  # GenerationOutput of the one row
  report: str  # the token report (analysis.token_report)

  def __str__(self) -> str:
    return f"{self.prompt}{self.text}\n({self.how})\n{self.report}"

  __repr__ = __str__

  def _repr_html_(self) -> str:
    return (f"<p><b>{html.escape(self.prompt)}</b>{html.escape(self.text)} "
            f"<i>({html.escape(self.how)})</i></p><pre>{html.escape(self.report)}</pre>")


@dataclasses.dataclass(frozen=True)
class TokenAttribution:
  """The training sequences that most helped the model predict tokens[position]."""

  text: str
  position: int
  token_text: str
  sequences: tuple[tuple[int, float, str], ...]  # (example id, score, snippet), best first
  query_prototypes: tuple[int, ...]
  agrees: bool  # the prototypes pick the model's prediction here (else the residual did)
  note: str  # "" or the trust line: the residual decided, use a whole-model method
  method: str = ""  # the attribution method that ranked them (influence.METHOD_LABEL)

  def __str__(self) -> str:
    lines = [f"{self.text!r}, token {self.position} {self.token_text!r} (prototypes "
             f"{list(self.query_prototypes)})"]
    if self.method:
      lines.append(f"by {self.method}")
    if self.note:
      lines.append(f"note: {self.note}")
    lines += [f"  {r + 1}. score {s:+.4g}  doc {e}  {snip!r}"
              for r, (e, s, snip) in enumerate(self.sequences)]
    return "\n".join(lines)

  __repr__ = __str__

  def _repr_html_(self) -> str:
    rows = "".join(f"<tr><td>{r + 1}</td><td>{s:+.4g}</td><td>{e}</td><td><code>"
                   f"{html.escape(snip)}</code></td></tr>"
                   for r, (e, s, snip) in enumerate(self.sequences))
    note = f"<p style='color:#c62828'>{html.escape(self.note)}</p>" if self.note else ""
    return (f"<p>token {self.position} <code>{html.escape(repr(self.token_text))}</code> of "
            f"<code>{html.escape(repr(self.text))}</code></p>{note}<table><thead><tr><th>#"
            "</th><th>score</th><th>document</th><th>snippet</th></tr></thead><tbody>"
            f"{rows}</tbody></table>")


@dataclasses.dataclass(frozen=True)
class Report:
  """The self-contained HTML report page; in a notebook, an iframe of it (no request)."""

  html: str

  def __repr__(self) -> str:
    return f"Report({len(self.html) / 1e6:.1f} MB of self-contained HTML; .save(path) writes it)"

  def save(self, path: str) -> str:
    paths.write_text_atomic(path, self.html)
    return path

  def _repr_html_(self) -> str:
    return (f"<iframe srcdoc=\"{html.escape(self.html, quote=True)}\" style=\"width:100%;"
            "height:720px;border:1px solid #ddd\"></iframe>")
