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


def format_metrics(m: dict[str, Any]) -> str:
  parts = []
  for k, v in m.items():
    if isinstance(v, float):
      parts.append(f"{k} {v:,.4g}" if abs(v) < 1e4 else f"{k} {v:,.0f}")
    else:
      parts.append(f"{k} {v}")
  return " | ".join(parts)


class Progress:
  """tqdm on a TTY (process 0), an absl log line per logged step otherwise."""

  def __init__(self, start: int, total: int):
    self.total = total
    self.bar = None
    if _terminal_width() > 0 and jax.process_index() == 0:
      from tqdm import tqdm  # pylint: disable=g-import-not-at-top
      self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

  def update(self, step: int, m: dict[str, float], rates: dict[str, float],
             log_due: bool) -> None:
    if self.bar is not None:
      self.bar.update(1)
      post = {"loss": f"{m['loss']:.4f}"}
      if rates.get("tokens_per_s"):
        post["tok/s"] = f"{rates['tokens_per_s']:,.0f}"
      self.bar.set_postfix(post, refresh=False)
    elif log_due:
      logging.info("step %d/%d %s", step, self.total, format_metrics({**m, **rates}))

  def write(self, text: str) -> None:
    if self.bar is not None:
      self.bar.write(text)
    else:
      logging.info("%s", text)

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()
