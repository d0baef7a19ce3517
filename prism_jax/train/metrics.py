"""Metric writers (JSONL always; TensorBoard and W&B as `train.log_to` says:
prism_jax/train/tracking.py) and throughput accounting.

Throughput: tokens/s counts every position of every row (B*T per step); TFLOP/s uses
`prism_jax.flops.flops_per_token(model_cfg, T, loss_cfg)["train"]` (3x forward, prototype
head included, and the W z_hat head where the loss needs it); MFU is reported only where
`prism_jax.flops.device_peak_flops` knows the peak.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import jax
from absl import logging

from prism_jax import flops, paths
from prism_jax.config import LossConfig, ModelConfig
from prism_jax.train.tracking import WandbTracker

METRICS_FILE = "metrics.jsonl"
UPLOAD_EVERY_S = 30.0  # an object-store metrics file is re-uploaded at most this often
# (and at every checkpoint and at the end)


def _clean(value: Any) -> Any:
  """JSON-safe: non-finite floats become strings ("nan", "inf")."""
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)
  return value


class MetricsWriter:
  """Appends {"step", "split", ...} records to <workdir>/metrics.jsonl and TensorBoard."""

  def __init__(self, workdir: str, start_step: int = 0, tensorboard: bool = True,
               wandb: bool = False, config: dict[str, Any] | None = None):
    self.enabled = jax.process_index() == 0
    self.path = paths.join(workdir, METRICS_FILE)
    self._tb = self._wandb = None
    if not self.enabled:
      return
    kept = _truncate_after(self.path, start_step)  # a resumed run rewrites later steps
    # An object store cannot append: the file is kept in memory and re-uploaded on flush.
    self._lines = kept if paths.is_remote(self.path) else None
    self._uploaded = time.monotonic()
    self._file = None if self._lines is not None else open(self.path, "a", buffering=1)
    if tensorboard:
      try:
        from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top  (deferred: tensorboardX, only when logging to tensorboard)
        self._tb = SummaryWriter(paths.join(workdir, "tb"), purge_step=start_step + 1)
      except Exception as e:  # pylint: disable=broad-except
        logging.warning("TensorBoard disabled: %s", e)
    if wandb:
      self._wandb = WandbTracker(workdir, config)

  def write(self, step: int, split: str, metrics: dict[str, Any]) -> None:
    if not self.enabled:
      return
    record = {"step": int(step), "split": split}
    record.update({k: _clean(float(v)) if isinstance(v, (int, float)) else v
                   for k, v in metrics.items()})
    line = json.dumps(record) + "\n"
    if self._lines is not None:
      self._lines.append(line)
      if time.monotonic() - self._uploaded > UPLOAD_EVERY_S:
        self.flush()
    else:
      self._file.write(line)
    scalars = {k: float(v) for k, v in metrics.items()
               if isinstance(v, (int, float)) and math.isfinite(float(v))}
    if self._tb is not None:
      for k, v in scalars.items():
        self._tb.add_scalar(f"{split}/{k}", v, int(step))
    if self._wandb is not None:
      self._wandb.log(step, split, scalars)

  def histogram(self, step: int, split: str, name: str, counts) -> None:
    """A per-item count (e.g. each prototype's usage at an eval) as a histogram plot in
    the trackers (metrics.jsonl keeps scalars only): TensorBoard's histogram of the
    counts, W&B's of log10(1 + count) (usage spans orders of magnitude), each under
    "<split>/<name>"."""
    if not self.enabled or counts is None:
      return
    if self._tb is not None:
      self._tb.add_histogram(f"{split}/{name}", counts, int(step))
    if self._wandb is not None:
      self._wandb.histogram(step, f"{split}/{name}", counts)

  def flush(self) -> None:
    if self.enabled:
      if self._lines is not None:
        paths.write_text_atomic(self.path, "".join(self._lines))
        self._uploaded = time.monotonic()
      else:
        self._file.flush()
      if self._tb is not None:
        self._tb.flush()

  def close(self) -> None:
    if self.enabled:
      if self._lines is not None:
        self.flush()
      else:
        self._file.close()
      if self._tb is not None:
        self._tb.close()
      if self._wandb is not None:
        self._wandb.close()


def _truncate_after(path: str, step: int) -> list[str]:
  """Drops the records after `step` (rewriting the file); returns the lines kept."""
  p = paths.path(path)
  if not p.exists():
    return []
  lines = p.read_text().splitlines(keepends=True)
  keep = []
  for line in lines:
    try:
      if json.loads(line)["step"] <= step:
        keep.append(line)
    except (ValueError, KeyError):
      pass  # a line cut by a kill
  if not paths.is_remote(path):
    with open(path, "w") as f:
      f.writelines(keep)
  return keep


def read_metrics(workdir: str, split: str | None = "train") -> list[dict[str, Any]]:
  """The records of <workdir>/metrics.jsonl (one split, or all with split=None)."""
  text = paths.path(workdir).joinpath(METRICS_FILE).read_text()
  records = [json.loads(line) for line in text.splitlines() if line.strip()]
  return [r for r in records if split is None or r.get("split") == split]


class Throughput:
  """Steady tokens/s, TFLOP/s and MFU over windows between `read` calls.

  Steady: time spent in work that is not a training step (evaluation, checkpoint saves,
  compilation, the prototype init) is reported by the loop through `exclude` and left out
  of both the window rates and the run's overall rate (`overall`).
  """

  def __init__(self, model_cfg: ModelConfig | None, seq_len: int, tokens_per_step: int,
               num_devices: int, device=None, loss_cfg: LossConfig | None = None):
    """`model_cfg` None (a loss that is not the model's): tokens/s only, no TFLOP/s;
    `loss_cfg` adds the λ_proto head's FLOPs when the loss computes it."""
    self.tokens_per_step = tokens_per_step
    self.num_devices = num_devices
    self.flops_per_token = (None if model_cfg is None else
                            float(flops.flops_per_token(model_cfg, seq_len, loss_cfg)["train"]))
    peak = flops.device_peak_flops(device or jax.devices()[0])
    self.peak_total = peak * num_devices if peak else None
    self._t0 = None
    self._steps = 0
    self._excluded = 0.0
    self._total_steps, self._total_s = 0, 0.0

  def start(self) -> None:
    self._t0, self._steps, self._excluded = time.perf_counter(), 0, 0.0

  def step(self) -> None:
    self._steps += 1

  def exclude(self, seconds: float) -> None:
    """Leaves `seconds` of non-step work out of the current window."""
    self._excluded += seconds

  def _rates(self, steps: int, seconds: float) -> dict[str, float]:
    dt = max(seconds, 1e-9)
    tok_s = steps * self.tokens_per_step / dt
    out = {"steady_tokens_per_s": tok_s, "steady_tokens_per_s_per_device":
           tok_s / self.num_devices, "steady_steps_per_s": steps / dt}
    if self.flops_per_token:
      flops_s = tok_s * self.flops_per_token
      out["tflops_per_s"] = flops_s / 1e12
      if self.peak_total:
        out["mfu"] = flops_s / self.peak_total
    return out

  def read(self) -> dict[str, float]:
    """Steady rates since the last start() (then restarts the window)."""
    if self._t0 is None or self._steps == 0:
      self.start()
      return {}
    seconds = time.perf_counter() - self._t0 - self._excluded
    self._total_steps += self._steps
    self._total_s += seconds
    out = self._rates(self._steps, seconds)
    out["excluded_s"] = self._excluded
    self.start()
    return out

  def overall(self) -> float | None:
    """Steady tokens/s over every window read so far (None before the first)."""
    if not self._total_steps:
      return None
    return self._rates(self._total_steps, self._total_s)["steady_tokens_per_s"]


class _DropLibraryLogs:
  """absl-handler filter: drops records below `min_level` logged from inside orbax."""

  def __init__(self, min_level: int):
    self.min_level = min_level

  def filter(self, record) -> bool:
    return record.levelno >= self.min_level or "/orbax/" not in record.pathname


def quiet_library_logs(min_level: int = 30) -> None:
  """Hide orbax's per-save chatter (below `min_level`, default WARNING) on the absl
  handler; our own log lines are untouched."""
  handler = logging.get_absl_handler()
  for f in list(handler.filters):
    if isinstance(f, _DropLibraryLogs):
      handler.removeFilter(f)
  handler.addFilter(_DropLibraryLogs(min_level))
