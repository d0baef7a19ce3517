"""Progress of a training loop: tqdm on a TTY, plain absl log lines otherwise."""

from __future__ import annotations

import os
import sys
from typing import Any

import jax
from absl import logging


def _terminal_width() -> int:
  """Columns of the terminal on stderr; 0 when it is not a (sized) TTY."""
  try:
    return os.get_terminal_size(sys.stderr.fileno()).columns if sys.stderr.isatty() else 0
  except (OSError, ValueError):
    return 0


# absl's prefix ("I1201 09:01:18.648751 140119656225664 progress.py:73] ") takes 55 columns:
# metric text wraps so that every log line fits 120.
LINE_WIDTH = 64
_SHORT = {"steady_tokens_per_s": "steady tok/s", "steady_tokens_per_s_per_device":
          "steady tok/s/dev", "steady_steps_per_s": "steps/s", "tflops_per_s": "TFLOP/s"}


def format_metrics(m: dict[str, Any], width: int = LINE_WIDTH, lead: str = "") -> str:
  """`lead name value | name value ...`, wrapped to lines of at most `width` characters."""
  parts = []
  for k, v in m.items():
    k = _SHORT.get(k, k)
    if isinstance(v, float):
      parts.append(f"{k} {v:,.4g}" if abs(v) < 1e4 else f"{k} {v:,.0f}")
    else:
      parts.append(f"{k} {v}")
  lines, cur, fresh = [], lead, True  # fresh: nothing but the lead on the current line
  for part in parts:
    if not fresh and len(cur) + 3 + len(part) > width:
      lines.append(cur)
      cur = "  " + part
    else:
      cur = (f"{cur} {part}" if cur else part) if fresh else f"{cur} | {part}"
    fresh = False
  return "\n".join(lines + [cur])


class Progress:
  """tqdm on a TTY (process 0), an absl log line per logged step otherwise."""

  def __init__(self, start: int, total: int):
    self.total = total
    self.bar = None
    if _terminal_width() > 0 and jax.process_index() == 0:
      from tqdm import tqdm  # pylint: disable=g-import-not-at-top  (deferred: tqdm, only on a terminal)
      self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

  def update(self, step: int, m: dict[str, float], rates: dict[str, float],
             log_due: bool) -> None:
    if self.bar is not None:
      self.bar.update(1)
      post = {"loss": f"{m['loss']:.4f}"}
      if rates.get("steady_tokens_per_s"):
        post["steady tok/s"] = f"{rates['steady_tokens_per_s']:,.0f}"
      self.bar.set_postfix(post, refresh=False)
    elif log_due:
      logging.info("%s", format_metrics({**m, **rates}, lead=f"step {step}/{self.total}"))

  def write(self, text: str) -> None:
    if self.bar is not None:
      self.bar.write(text)
    else:
      logging.info("%s", text)

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()
