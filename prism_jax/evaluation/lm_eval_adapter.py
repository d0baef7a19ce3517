"""lm-evaluation-harness on a run: lm-eval's `LM` interface over the offline scorer
(scoring.py) and the KV-cached sampler (generate.py). Needs the `lm-eval` extra.

    import lm_eval, prism_jax
    from prism_jax.evaluation.lm_eval_adapter import LMEvalAdapter
    lm = LMEvalAdapter(prism_jax.load("runs/demo").suppress([12, 40]))   # gains optional
    lm_eval.simple_evaluate(model=lm, tasks=["my_task"], task_manager=...)

or `prism lm-eval --workdir=runs/demo -- --tasks ...` (cli/lm_eval_cli.py), which registers the
adapter as lm-eval's model "prism" (`register`: lm-eval 0.4 has a model registry but no
plugin entry point, so the process that runs lm-eval registers it) and then runs lm-eval's
own command line with `--model prism --model_args workdir=...`.

- loglikelihood: (context, continuation) -> (sum of the continuation's log-probabilities,
  whether it is the greedy continuation). Tokens by lm-eval's rules (scoring.encode_pair:
  the context's trailing whitespace moves to the continuation, an empty context is EOS),
  the window left-truncated to max_len as the offline scorer does (scoring's module doc):
  the same code scores both, so they agree to float rounding.
- loglikelihood_rolling: a document's log-likelihood over lm-eval's disjoint rolling
  windows of max_len tokens (its HF backend's: EOS first, each token predicted once).
- generate_until: greedy, or sampled with do_sample, through the KV cache; the text is cut
  at the first stop string (`until`) and EOS; the context keeps its last
  max_len - max_gen_toks tokens (the HF backend's rule; max_gen_toks >= max_len refused).
- A steered Run (`Run.steer` / `Run.suppress`, or `gains=FILE` in model_args) scores and
  samples from the edited logits ℓ − Σ_i (1 − g_i) a_i W p_i (PRISM.md §6).

Scoring requests share the scorer's fixed (batch_size, length bucket) programs; generation
groups requests by settings and prompt length (ragged prompts cannot share a KV cache),
rows padded to a power of two, so one program serves each (rows, length, max_gen_toks).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from prism_jax.evaluation import scoring
from prism_jax.generate import generate

EXTRA_HINT = "pip install 'prism_jax[lm-eval]'"
try:
  from lm_eval import utils as lm_eval_utils
  from lm_eval.api.model import LM
  from lm_eval.api.registry import register_model
except ModuleNotFoundError as e:  # the command's one `error:` line names the extra
  raise ModuleNotFoundError(f"lm-evaluation-harness is not installed ({e}): "
                            f"{EXTRA_HINT}") from None

MODEL_NAME = "prism"
DEFAULT_BATCH = 32
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's HF backend's; capped at max_len // 2 here
# model_args the adapter takes (lm-eval adds batch_size, max_batch_size, device and, with
# --trust_remote_code, trust_remote_code; the last three mean nothing to a JAX run).
OPTIONS = ("batch_size", "max_gen_toks", "seed")
IGNORED = ("max_batch_size", "device", "trust_remote_code")
_MAX_TOKEN_KEYS = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")
_GEN_KEYS = ("until", "do_sample", "temperature", "top_k", "top_p") + _MAX_TOKEN_KEYS


class RunLike(Protocol):
  """What the adapter reads of a run (prism_jax.runs.Run satisfies it; evaluation sits
  below runs, so the type is stated here)."""
  workdir: str
  model: Any
  config: Any
  tokenizer: Any
  gains_K: Any


def _batch_rows(batch_size) -> int:
  if batch_size is None or str(batch_size).startswith("auto"):
    return DEFAULT_BATCH  # fixed shapes: no search for the largest batch
  try:
    rows = int(batch_size)
  except ValueError:
    raise ValueError(f"batch_size={batch_size!r}: an integer or 'auto'") from None
  if rows < 1:
    raise ValueError(f"batch_size={rows}: must be >= 1")
  return rows


class LMEvalAdapter(LM):
  """lm-eval's `LM` over a trained run (module doc).

  Args:
    run: the run, e.g. `prism_jax.load(workdir)` or a steered view of it.
    batch_size: rows of each compiled batch; "auto" (or None) is 32.
    max_gen_toks: tokens generated when a request does not say (default min(256,
      max_len // 2)).
    seed: the sampling seed of do_sample requests (greedy ones ignore it).
    **ignored: lm-eval's max_batch_size, device and trust_remote_code, unused here.
  """

  # Set by `register`: (workdir, gains file or None) -> a run, for lm-eval's model_args.
  loader: Callable[[str, str | None], RunLike] | None = None

  def __init__(self, run: RunLike, batch_size: int | str | None = DEFAULT_BATCH,
               max_gen_toks: int | None = None, seed: int = 0, **ignored):
    super().__init__()
    unknown = sorted(set(ignored) - set(IGNORED))
    if unknown:
      raise ValueError(f"lm-eval model_args: unknown {unknown[0]!r}; the prism model takes "
                       f"workdir, gains, {', '.join(OPTIONS)}")
    self.run = run
    self.max_len = int(run.config.model.max_len)
    self.batch_rows = _batch_rows(batch_size)
    self.max_gen_toks = (min(DEFAULT_MAX_GEN_TOKS, self.max_len // 2) if max_gen_toks is None
                         else int(max_gen_toks))
    self.seed = int(seed)
    self.gains_K = None if run.gains_K is None else np.asarray(run.gains_K, np.float32)

  @classmethod
  def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None
                          ) -> "LMEvalAdapter":
    """lm-eval's constructor from model_args: `workdir` (required) and `gains` (a steering
    set file) go to `loader`, the rest to __init__."""
    args = dict(arg_dict)
    args.update({k: v for k, v in (additional_config or {}).items() if v is not None})
    workdir, gains = args.pop("workdir", None), args.pop("gains", None)
    if workdir is None:
      raise ValueError("lm-eval model_args: the prism model needs workdir=RUN_DIR")
    if cls.loader is None:
      raise ValueError("the prism model was registered without a run loader: use "
                       "`prism lm-eval` (or register(loader))")
    return cls(cls.loader(str(workdir), None if gains is None else str(gains)), **args)

  @classmethod
  def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None
                             ) -> "LMEvalAdapter":
    """As create_from_arg_obj, from lm-eval's "key=value,key=value" string."""
    return cls.create_from_arg_obj(lm_eval_utils.simple_parse_args_string(arg_string),
                                   additional_config)

  def get_model_info(self) -> dict:
    """What lm-eval records about the model in its results' config."""
    m = self.run.config.model
    steered = 0 if self.gains_K is None else int((self.gains_K != 1.0).sum())
    return {"prism_workdir": str(self.run.workdir), "prism_kind": m.kind,
            "prism_max_len": self.max_len, "prism_steered_prototypes": steered}

  # -- scoring ------------------------------------------------------------------------------

  def _score(self, pairs, desc: str, disable_tqdm: bool):
    from tqdm import tqdm  # pylint: disable=g-import-not-at-top  (deferred: tqdm, only while lm-eval runs)
    enc = scoring.encode_token_pairs(pairs, self.max_len)
    with tqdm(total=len(pairs), desc=desc, disable=disable_tqdm) as bar:
      return scoring.score_options(self.run.model, enc, batch_rows=self.batch_rows,
                                   progress=bar.update, gains_K=self.gains_K)

  def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
    """(log P(continuation | context), is_greedy) per request; `Instance.args` =
    (context, continuation)."""
    pairs = [scoring.encode_pair(self.run.tokenizer, *r.args) for r in requests]
    for r, (_, cont_ids) in zip(requests, pairs):
      if not cont_ids:
        raise ValueError(f"continuation {r.args[1]!r} has no token of its own after "
                         "tokenising context + continuation")
    sc = self._score(pairs, "prism loglikelihood", disable_tqdm)
    out = [(float(lp), bool(g)) for lp, g in zip(sc.logprob_O, sc.greedy_O)]
    for r, res in zip(requests, out):
      self.cache_hook.add_partial("loglikelihood", r.args, res)
    return out

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    """log P(document) per request (`Instance.args` = (text,)), summed over lm-eval's
    disjoint rolling windows of max_len tokens conditioned on EOS."""
    eos = self.run.tokenizer.eos_id
    pairs, owner = [], []
    for i, r in enumerate(requests):
      windows = lm_eval_utils.get_rolling_token_windows(
          token_list=list(self.run.tokenizer.encode(r.args[0])), prefix_token=eos,
          max_seq_len=self.max_len, context_len=1)
      for w in map(lm_eval_utils.make_disjoint_window, windows):
        pairs.append(w)
        owner.append(i)
    total = np.zeros(len(requests), np.float64)
    if pairs:
      sc = self._score(pairs, "prism loglikelihood_rolling", disable_tqdm)
      np.add.at(total, np.asarray(owner), sc.logprob_O)
    out = [float(x) for x in total]
    for r, res in zip(requests, out):
      self.cache_hook.add_partial("loglikelihood_rolling", r.args, res)
    return out

  # -- generation ---------------------------------------------------------------------------

  def _settings(self, gen_kwargs: dict) -> tuple:
    """(until, max_gen_toks, temperature (0: greedy), top_k, top_p) of a request's
    gen_kwargs, by lm-eval's rules: sampling when do_sample, or when do_sample is unset
    and temperature > 0."""
    unknown = sorted(set(gen_kwargs) - set(_GEN_KEYS))
    if unknown:
      raise ValueError(f"generate_until: gen_kwargs {unknown[0]!r} is not supported by the "
                       f"prism model (it takes {', '.join(_GEN_KEYS)})")
    until = gen_kwargs.get("until") or []
    until = [until] if isinstance(until, str) else list(until)
    given = [gen_kwargs[k] for k in _MAX_TOKEN_KEYS if gen_kwargs.get(k) is not None]
    max_gen = int(given[0]) if given else self.max_gen_toks
    if not 1 <= max_gen < self.max_len:
      raise ValueError(f"generate_until: max_gen_toks={max_gen} must be in [1, max_len="
                       f"{self.max_len}) (the prompt needs a token); set it with "
                       "--gen_kwargs max_gen_toks=N")
    do_sample = gen_kwargs.get("do_sample")
    temperature = gen_kwargs.get("temperature")
    if do_sample is None:
      do_sample = temperature is not None and float(temperature) > 0
    if not do_sample:
      temperature = 0.0
    else:  # transformers' default temperature when sampling; an explicit 0 stays greedy
      temperature = 1.0 if temperature is None else float(temperature)
    top_k = gen_kwargs.get("top_k")
    top_k = None if top_k in (None, 0) else int(top_k)
    return (tuple(until), max_gen, temperature, top_k, float(gen_kwargs.get("top_p", 1.0)))

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """The continuation of each request's context (`Instance.args` = (context,
    gen_kwargs)), cut at its first stop string."""
    from tqdm import tqdm  # pylint: disable=g-import-not-at-top  (deferred: tqdm, only while lm-eval runs)
    tok = self.run.tokenizer
    jobs = []  # (settings, prompt ids, request index)
    for i, r in enumerate(requests):
      context, gen_kwargs = r.args
      settings = self._settings(dict(gen_kwargs or {}))
      ids = list(tok.encode(context))[-(self.max_len - settings[1]):] or [tok.eos_id]
      jobs.append((settings, ids, i))
    out: list[str | None] = [None] * len(requests)
    key = lambda j: (j[0], len(j[1]))
    with tqdm(total=len(jobs), desc="prism generate_until", disable=disable_tqdm) as bar:
      for (settings, _), group in itertools.groupby(sorted(jobs, key=key), key=key):
        group = list(group)
        for start in range(0, len(group), self.batch_rows):
          chunk = group[start:start + self.batch_rows]
          for (_, _, i), text in zip(chunk, self._generate(settings, [j[1] for j in chunk])):
            out[i] = text
            self.cache_hook.add_partial("generate_until", requests[i].args, text)
          bar.update(len(chunk))
    return out

  def _generate(self, settings: tuple, prompts: list[list[int]]) -> list[str]:
    """One generate call on equal-length prompts, rows padded to a power of two."""
    until, max_gen, temperature, top_k, top_p = settings
    tok = self.run.tokenizer
    rows = 1 << (len(prompts) - 1).bit_length()
    batch = np.asarray(prompts + [prompts[0]] * (rows - len(prompts)), np.int32)
    res = generate(self.run.model, batch, max_new_tokens=max_gen, temperature=temperature,
                   top_k=top_k, top_p=top_p, eos_id=tok.eos_id, seed=self.seed,
                   proto_gain_K=self.gains_K)
    texts = []
    for r in range(len(prompts)):
      ids = res.tokens_BxL[r, :int(res.lengths_B[r])].tolist()
      if ids and ids[-1] == tok.eos_id:
        ids = ids[:-1]
      text = tok.decode(ids)
      for stop in until:
        if stop:
          text = text.split(stop)[0]
      texts.append(text)
    return texts


def register(loader: Callable[[str, str | None], RunLike], name: str = MODEL_NAME) -> type:
  """Registers the adapter as lm-eval's model `name` (process-wide, as lm-eval's registry
  is): `--model prism --model_args workdir=DIR[,gains=FILE]` then builds it on
  `loader(workdir, gains)`.

  Args:
    loader: (run directory, steering set file or None) -> the run to evaluate.
    name: the model name lm-eval knows it by.

  Returns:
    The registered class (LMEvalAdapter).
  """
  LMEvalAdapter.loader = staticmethod(loader)
  register_model(name)(LMEvalAdapter)  # registering the same class again is a no-op
  return LMEvalAdapter
