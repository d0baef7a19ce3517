"""The lm-evaluation-harness adapter (prism_jax/evaluation/lm_eval_adapter.py, `prism
lm-eval`), offline, on the tests' shared tiny run (tests/tiny_run.py).

- `prism lm-eval` runs the local task (tests/lm_eval_task/) through lm-eval's own command
  line: its per-choice loglikelihoods equal the offline scorer's on the same JSONL (1e-5),
  and so do acc and acc_norm;
- a fresh random request against a float64 NumPy reference (logits of a plain forward,
  log-softmax in float64, the context's whitespace moved by hand), is_greedy included;
- loglikelihood_rolling against a direct float64 sum over windows written out here;
- generate_until's greedy (and a seeded sampled) text against Run.generate's;
- gains 0 on the continuation's prototypes: the change W z − Σ(1 − g) a W p predicts, through
  a steering file read by the command's loader (both formats; another bank's set refused);
- without lm_eval, the command is one `error:` line naming the extra;
- (transformers-marked) a dense run exported to GPT-2 scores the same in lm-eval's HF backend.
"""

import glob
import json
import os
import secrets
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from lm_eval.api.instance import Instance

import prism_jax
import tiny_run
from prism_jax.cli import lm_eval_cli
from prism_jax.evaluation import lm_eval_adapter, scoring, tasks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK_DIR = os.path.join(REPO, "tests", "lm_eval_task")
TASK, DATA = "prism_python_docs_mc", os.path.join(TASK_DIR, "python_docs_mc.jsonl")
WORDS = ["for", "while", "the", "of", "prototype", "token", "mesh", "<x>", "&amp;"]
# The reference's forward compiled whole (one program per length; op-by-op dispatch
# compiled every op for every length).
_forward = nnx.jit(lambda model, ids: model(ids))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  return prism_jax.load(tiny_run.tiny_run(tmp_path_factory)["run"])


def _req(kind, *args):
  return Instance(request_type=kind, doc={}, arguments=tuple(args), idx=0)


def _text(rng, n):
  return " ".join(rng.choice(WORDS, n))


def _offline(model, tok, max_len):
  """(items, per-option logprobs) of the local task by the offline scorer."""
  items = tasks.load_jsonl_task(DATA, TASK)
  enc = scoring.encode_items(items, tok, max_len)
  return items, scoring.score_options(model, enc).logprob_O


@pytest.mark.long  # ~30-45 s: `make test-long`
def test_prism_lm_eval_command_matches_the_offline_scorer(run, tmp_path):
  out = tmp_path / "out"
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO,
             HF_DATASETS_CACHE=str(tmp_path / "hf_datasets"), HF_HOME=str(tmp_path / "hf"))
  res = subprocess.run(
      [sys.executable, "-m", "prism_jax.cli", "lm-eval", f"--workdir={run.workdir}", "--",
       "--tasks", TASK, "--include_path", TASK_DIR, "--output_path", str(out),
       "--log_samples", "--batch_size", "16"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert res.returncode == 0, res.stderr[-3000:]
  [samples] = glob.glob(str(out / "**" / f"samples_{TASK}_*.jsonl"), recursive=True)
  [results] = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
  with open(samples, encoding="utf-8") as f:
    docs = sorted((json.loads(line) for line in f), key=lambda d: d["doc_id"])
  got = np.asarray([float(ll) for d in docs for ll, _ in d["filtered_resps"]])
  items, want = _offline(run.model, run.tokenizer, run.config.model.max_len)
  assert len(docs) == len(items) == 24 and got.shape == want.shape
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
  with open(results, encoding="utf-8") as f:
    data = json.load(f)
  acc = data["results"][TASK]
  assert acc["acc,none"] == pytest.approx(scoring.correct(items, want).mean())
  assert acc["acc_norm,none"] == pytest.approx(scoring.correct(items, want, norm=True).mean())
  assert data["config"]["model_args"] == {"workdir": run.workdir}
  assert data["config"]["prism_steered_prototypes"] == 0


def _float64_logprob(run, ctx_ids, cont_ids, gains_K=None):
  """(log P(cont | ctx), greedy) in float64 from the model's z, its codes and the bank:
  ℓ = W z − Σ_j (1 − g_{i_j}) a_j W p_{i_j}, log-softmax in float64."""
  model, max_len = run.model, run.config.model.max_len
  seq = (ctx_ids + cont_ids)[-(max_len + 1):]
  out = _forward(model, jnp.asarray([seq[:-1]], jnp.int32))
  z = np.asarray(out.z_BxTxD[0], np.float64)
  w = np.asarray(model.backbone.wte[...], np.float64)
  logits = z @ w.T
  if gains_K is not None:
    p = np.asarray(model.bank.protos[...], np.float64)
    idx, act = np.asarray(out.protos.idx_Nxk), np.asarray(out.protos.act_Nxk, np.float64)
    drop = (1.0 - np.asarray(gains_K, np.float64)[idx]) * act  # (T, k)
    logits = logits - np.einsum("tj,tjd,vd->tv", drop, p[idx], w)
  logits[:, model.cfg.num_token_ids:] = -1e9  # vocabulary padding, as the head does
  m = logits.max(1, keepdims=True)
  logp = logits - (m + np.log(np.exp(logits - m).sum(1, keepdims=True)))
  n = len(cont_ids)
  targets = np.asarray(seq[1:])[-n:]
  greedy = bool((logits[-n:].argmax(1) == targets).all())
  return float(logp[np.arange(len(seq) - 1)[-n:], targets].sum()), greedy


def test_a_fresh_request_against_float64_numpy(run):
  seed = secrets.randbits(16)
  rng = np.random.default_rng(seed)
  ctx, cont = _text(rng, 3) + " ", _text(rng, 2)  # lm-eval moves the trailing space
  long_ctx = _text(rng, 12)  # > max_len bytes: left-truncated
  lm = lm_eval_adapter.LMEvalAdapter(run)
  got = lm.loglikelihood([_req("loglikelihood", ctx, cont),
                          _req("loglikelihood", long_ctx, " " + cont)])
  # byte tokens are the text's bytes: the windows written out by hand
  for (ll, greedy), (c, k) in zip(got, [(ctx[:-1], " " + cont), (long_ctx, " " + cont)]):
    want, want_greedy = _float64_logprob(run, list(c.encode()), list(k.encode()))
    assert ll == pytest.approx(want, rel=2e-5, abs=2e-4), seed
    assert greedy == want_greedy, seed


def _rolling_reference(run, ids, max_len):
  """Σ over chunks of max_len targets of ids[1:] (ids[0] is EOS), each chunk predicted
  from the max_len tokens before its last target, in float64."""
  total, n = 0.0, len(ids) - 1
  for first in range(1, n + 1, max_len):
    last = min(first + max_len - 1, n)  # targets ids[first..last]
    start = max(0, last - max_len)  # inputs ids[start..last-1]
    total += _float64_logprob(run, ids[start:first], ids[first:last + 1])[0]
  return total


def test_rolling_loglikelihood_is_the_direct_float64_sum_over_windows(run):
  seed = secrets.randbits(16)
  rng = np.random.default_rng(seed)
  max_len = run.config.model.max_len
  doc = _text(rng, 20)
  if len(doc) % max_len == 0:  # keep the last window partial whatever the draw
    doc = doc[:-1]
  ids = [run.tokenizer.eos_id] + list(doc.encode())
  assert len(ids) - 1 > 2 * max_len and (len(ids) - 1) % max_len, "3 windows, one partial"
  lm = lm_eval_adapter.LMEvalAdapter(run)
  got, empty = lm.loglikelihood_rolling([_req("loglikelihood_rolling", doc),
                                         _req("loglikelihood_rolling", "")])
  assert got == pytest.approx(_rolling_reference(run, ids, max_len), rel=2e-5, abs=5e-4), seed
  assert empty == 0.0


@pytest.mark.long  # ~20 s: `make test-long` (make test's 12 minutes)
def test_generate_until_is_run_generate_cut_at_the_stop_string(run):
  seed = secrets.randbits(16)
  rng = np.random.default_rng(seed)
  room = run.config.model.max_len - 8  # the context a request of 8 new tokens keeps
  prompts = [_text(rng, 2), _text(rng, 2), _text(rng, 1)]  # <= 19 bytes: whole
  long = "prototype token mesh " + _text(rng, 2)  # > room bytes: its head is cut
  # top_k None as the adapter's greedy calls: the same compiled programs serve both
  greedy = lambda p: run.generate(p, max_new_tokens=8, greedy=True, top_k=None).text
  want = [greedy(p) for p in prompts] + [greedy(list(long.encode())[-room:])]
  stop = want[0][2:4]  # inside the first continuation (may be empty: then no cut)
  sampled = run.generate(prompts[1], max_new_tokens=6, temperature=0.9, top_k=None,
                         seed=0).text
  lm = lm_eval_adapter.LMEvalAdapter(run, seed=0)
  got = lm.generate_until(
      [_req("generate_until", prompts[0], {"until": [stop], "max_gen_toks": 8}),
       _req("generate_until", prompts[1], {"until": [], "max_gen_toks": 8}),
       _req("generate_until", prompts[2], {"max_gen_toks": 8, "do_sample": False}),
       _req("generate_until", long, {"until": "\n\n", "max_new_tokens": 8}),
       _req("generate_until", prompts[1], {"do_sample": True, "temperature": 0.9,
                                           "max_gen_toks": 6})])
  cut = lambda text, s: text.split(s)[0] if s else text
  assert got == [cut(want[0], stop), want[1], want[2], cut(want[3], "\n\n"), sampled], seed
  with pytest.raises(ValueError, match="max_gen_toks=32 must be in"):
    lm.generate_until([_req("generate_until", "x", {"max_gen_toks": 32})])
  with pytest.raises(ValueError, match="'repetition_penalty' is not supported"):
    lm.generate_until([_req("generate_until", "x", {"repetition_penalty": 1.1})])


def test_gains_from_a_steering_file_edit_loglikelihoods_as_the_formula_says(run, tmp_path):
  from prism_jax.control.suppression import ProtoSet  # pylint: disable=g-import-not-at-top
  seed = secrets.randbits(16)
  rng = np.random.default_rng(seed)
  ctx, cont = _text(rng, 3), " " + _text(rng, 2)
  ctx_ids, cont_ids = list(ctx.encode()), list(cont.encode())
  seq = (ctx_ids + cont_ids)[-(run.config.model.max_len + 1):]
  out = _forward(run.model, jnp.asarray([seq[:-1]], jnp.int32))
  active = np.asarray(out.protos.idx_Nxk)[-len(cont_ids):]  # on the continuation's targets
  ids = [int(i) for i in np.unique(active)[:3]]
  sets = {"explorer": tmp_path / "gains.json", "suppress": tmp_path / "set.json"}
  sets["explorer"].write_text(json.dumps({"gains": {str(i): 0.0 for i in ids}}))
  ProtoSet.create(run.model, ids).save(str(sets["suppress"]))
  lm_eval_adapter.register(lm_eval_cli.load_run)
  plain = lm_eval_adapter.LMEvalAdapter(run).loglikelihood([_req("loglikelihood", ctx, cont)])
  for name, path in sets.items():
    lm = lm_eval_adapter.LMEvalAdapter.create_from_arg_string(
        f"workdir={run.workdir},gains={path}")
    gains_K = np.ones(run.config.model.num_prototypes, np.float32)
    gains_K[ids] = 0.0
    np.testing.assert_array_equal(lm.gains_K, gains_K, err_msg=name)
    (ll, _), = lm.loglikelihood([_req("loglikelihood", ctx, cont)])
    want, _ = _float64_logprob(run, ctx_ids, cont_ids, gains_K)
    assert ll == pytest.approx(want, rel=2e-5, abs=2e-4), (name, seed)
    assert abs(ll - plain[0][0]) > 1e-3, (name, seed)  # the edit changed the score
  other = json.loads(sets["suppress"].read_text())
  other["fingerprint"]["bank_sha256"] = "0" * 64
  sets["suppress"].write_text(json.dumps(other))
  with pytest.raises(ValueError, match="saved for another model"):
    lm_eval_cli.load_run(run.workdir, str(sets["suppress"]))


def test_without_lm_eval_the_command_is_one_error_line_naming_the_extra(tmp_path):
  code = ("import sys; sys.modules['lm_eval'] = None\n"
          "from prism_jax.cli import main\n"
          f"main.main(['prism', 'lm-eval', '--workdir={tmp_path}', '--', '--tasks', 'x'])")
  res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                       text=True, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO))
  errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
  assert res.returncode == 2 and len(errors) == 1, res.stderr[-3000:]
  assert "prism_jax[lm-eval]" in errors[0] and "Traceback" not in res.stderr


@pytest.mark.transformers
def test_an_exported_dense_run_scores_the_same_in_lm_evals_hf_backend(tmp_path):
  """The golden GPT-2 imported as a dense run, exported again (`prism export-hf`), then
  lm-eval's HF backend and the adapter on the same requests (skipped without torch)."""
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  pytest.importorskip("accelerate")
  from lm_eval.models.huggingface import HFLM  # pylint: disable=g-import-not-at-top
  from prism_jax import hf  # pylint: disable=g-import-not-at-top
  golden = os.path.join(REPO, "tests", "golden", "hf_gpt2_tiny")
  hf.import_hf(golden, str(tmp_path / "dense"), kind="dense")
  hf.export_hf(str(tmp_path / "dense"), str(tmp_path / "hf"))
  dense = prism_jax.load(str(tmp_path / "dense"))
  items = tasks.load_jsonl_task(DATA, TASK)
  reqs = [_req("loglikelihood", c, k) for it in items
          for c, k in zip(it.contexts, it.continuations)]
  doc = " ".join(it.contexts[0] for it in items)  # longer than the 128-token window
  ours = lm_eval_adapter.LMEvalAdapter(dense, batch_size=8)
  theirs = HFLM(pretrained=str(tmp_path / "hf"), backend="causal", device="cpu",
                dtype="float32", batch_size=8)
  assert theirs.max_length == ours.max_len and theirs.eot_token_id == dense.tokenizer.eos_id
  got, want = ours.loglikelihood(reqs), theirs.loglikelihood(reqs)
  np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], rtol=1e-5, atol=1e-4)
  assert [g[1] for g in got] == [w[1] for w in want]
  rolling = [_req("loglikelihood_rolling", doc)]
  assert ours.loglikelihood_rolling(rolling)[0] == pytest.approx(
      theirs.loglikelihood_rolling(rolling)[0], rel=1e-5, abs=1e-3)
