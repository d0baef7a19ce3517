"""Two `prism train` started together on one run directory, 20 times (issue 57's acceptance;
`make test-long`): each time exactly one trains, the other exits at once (rc 2, one `error:`
line naming the holder), and the survivor's final parameters equal an undisturbed run's to
the bit. On 14df241 the pair wrote duplicate metrics records and stale checkpoints, or one
hung and died with a TimeoutError.
"""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from prism_jax.train import load_params, read_metrics
from test_checkpoint_bad_inputs import SETS, _corpus

ROUNDS = int(os.environ.get("RACE_ROUNDS", 20))
PRISM = [sys.executable, "-m", "prism_jax.cli.main", "train", "--config=tiny"]


def _args(data, workdir):
  return PRISM + [f"--data={data}", f"--workdir={workdir}", "--set=train.log_to="] + [
      f"--set={s}" for s in SETS]


def _params(workdir):
  _, params, _, step = load_params(workdir)
  return step, [np.asarray(x) for x in jax.tree.leaves(params)]


@pytest.mark.long
def test_two_trainers_started_together(tmp_path):
  data = _corpus(tmp_path / "corpus.txt")
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  ref = tmp_path / "undisturbed"
  subprocess.run(_args(data, ref), check=True, capture_output=True, env=env, timeout=300)
  ref_step, ref_params = _params(str(ref))
  for r in range(ROUNDS):
    run = tmp_path / f"race{r}"
    procs = [subprocess.Popen(_args(data, run), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], (r, codes, [e[-1500:] for _, e in outs])
    loser = outs[[p.returncode for p in procs].index(2)][1]
    errors = [ln for ln in loser.splitlines() if ln.startswith("error:")]
    winner_pid = procs[[p.returncode for p in procs].index(0)].pid
    assert len(errors) == 1 and "is being written by" in errors[0], (r, loser[-1500:])
    assert f"pid {winner_pid}" in errors[0], (r, errors)
    assert "Traceback" not in loser
    steps = [m["step"] for m in read_metrics(str(run), "train")]
    assert len(steps) == len(set(steps)), (r, steps)  # one writer: no duplicate records
    step, params = _params(str(run))
    assert step == ref_step
    assert all(np.array_equal(a, b) for a, b in zip(params, ref_params)), r
