"""A trained run in one line: `run = prism_jax.load("runs/demo")`.

  run = prism_jax.load("runs/demo")                  # a run directory, local or gs://
  out = run.generate("The for statement")            # the library's sampling defaults
  dec = run.decompose("def f(x): return x")          # per token: prototypes + residual
  dec                                                # a table in a notebook, text in a terminal
  att = run.attribute("The for statement", position=3)  # training text behind a token
  page = run.report("The for statement")             # the HTML report (inline in a notebook)
  quiet = run.suppress([12, 40])                     # a steered view: g = 0 on those
  quiet.generate("The for statement")                # same seed, the edit applied
  run.steer({7: 2.0})                                # gains: 0 removes, > 1 amplifies

`Run` holds `.model`, `.config`, `.tokenizer` and `.workdir`. Text goes in and comes out;
token ids are accepted too. Every explanation carries its trust mark
(prism_jax/model/trust.py): whether the prototype path alone picks the model's prediction,
and the prototypes' share of the prediction's lead over the runner-up.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

from prism_jax import paths, run_lock
from prism_jax.analysis import report_page
from prism_jax.analysis.token_report import token_report
from prism_jax.attribution.hessians import curvature
from prism_jax.control.steering import gains_vector
from prism_jax.control.suppression import model_fingerprint
from prism_jax.data import batch as batch_lib
from prism_jax.data import prepare_data
from prism_jax.data.tokenizers import piece
from prism_jax.generate import SAMPLING, generate as generate_ids, sampling_label
from prism_jax.model.lm import decompose as decompose_logits
from prism_jax.model.logit_edit import controlled_logits, edited_trust
from prism_jax.model.trust import RESIDUAL_DECIDED, output_trust, prediction_trust

from prism_jax.run_views import (TOP_SHOWN, Decomposition, Generation, Report,  # noqa: F401
                                 TokenAttribution, TokenExplanation)

# Attribution, cards, the report's data, the Hessian block and load() import their modules
# when called (deferred: scipy.sparse and orbax, ~0.6 s): importing this module costs what
# the model and generate cost.


class Run:
  """A trained run: its model, config and tokenizer, and what PRISM does with them.
  `gains_K` (a steered view, `steer` / `suppress`): prototype i's share of the logits is
  scaled by gains_K[i] in generate and decompose (PRISM.md §6; r_t kept from the unedited
  pass)."""

  def __init__(self, workdir: str, model, config, tokenizer, gains_K=None):
    self.workdir, self.model, self.config, self.tokenizer = workdir, model, config, tokenizer
    self.gains_K = gains_K

  def __repr__(self) -> str:
    m = self.config.model
    bank = f", K={m.num_prototypes}, k={m.k}" if m.kind == "prism" else ""
    steered = ""
    if self.gains_K is not None:
      changed = np.flatnonzero(np.asarray(self.gains_K) != 1.0)
      steered = f", steered: {len(changed)} prototype gains != 1"
    return (f"Run({self.workdir!r}: {m.kind}, d={m.d_model}, layers={m.n_layers}{bank}, "
            f"vocab={m.vocab_size}{steered})")

  def steer(self, gains=None, *, steering_set=None) -> "Run":
    """A view of this run with prototype gains (composes with this view's gains).

    Args:
      gains: {prototype id: gain} or a (K,) array of gains; 0 removes a prototype's share
        of the logits, 1 leaves it, > 1 amplifies it.
      steering_set: a saved set's JSON content (the explorer's or `prism suppress`'s;
        control/steering.read_set reads a file), checked against this run's bank.

    Returns:
      A new Run sharing the model, whose generate and decompose apply the gains.
    """
    return self._steered(gains=gains, steering_set=steering_set)

  def suppress(self, proto_ids) -> "Run":
    """A view with the given prototypes removed (gain 0).

    Args:
      proto_ids: prototype ids to remove.

    Returns:
      A new Run (see `steer`).
    """
    return self._steered(ids=proto_ids)

  def _steered(self, **forms) -> "Run":
    if self.config.model.kind != "prism":
      raise ValueError(f"{self.workdir} is a dense run: it has no prototypes to steer")
    fingerprint = (model_fingerprint(self.model) if forms.get("steering_set") is not None
                   else None)
    g = gains_vector(self.config.model.num_prototypes, **forms, fingerprint=fingerprint,
                     base_K=self.gains_K)
    return Run(self.workdir, self.model, self.config, self.tokenizer, g)

  def attribute(self, text, position: int | None = None, *, top: int = 5,
                build: bool = True) -> TokenAttribution:
    """The training sequences that most helped predict one token, by cached PRISM
    attribution. When the residual decided that prediction, the result says so (its
    prototypes do not explain it).

    Args:
      text: the text (or token ids) holding the token.
      position: index of the token in the text's tokens (default: the last one; >= 1).
      top: how many training sequences to return.
      build: build <workdir>/attribution_cache (with progress) when it is missing; with
        False a missing cache is a ValueError.

    Returns:
      A TokenAttribution: ranked (document id, score, snippet) and the trust note.
    """
    return attribute(self, text, position, top=top, build=build)

  def report(self, text, max_new_tokens: int = 32, *, attribution: bool = False,
             **sampling) -> Report:
    """The interactive HTML report of `text` and its continuation (cards built once under
    <workdir>/cards).

    Args:
      text: the prompt (text or token ids).
      max_new_tokens: tokens to generate after it.
      attribution: add each token's attributed training sequences (builds the cache if
        needed).
      **sampling: temperature / top_k / seed (default: the library's sampling defaults).

    Returns:
      A Report: `.html`, `.save(path)`, shown inline in a notebook.
    """
    return report(self, text, max_new_tokens, attribution=attribution, **sampling)

  @property
  def cards(self):
    """The prototype cards (prism_jax.analysis.cards.CardSet: `.card(i)`, `.search(text)`),
    read from <workdir>/cards or built there once (a pass over the training split)."""
    if getattr(self, "_cards", None) is None:
      self._cards = run_cards(self)  # pylint: disable=attribute-defined-outside-init
    return self._cards

  def hessian_block(self, i: int, j: int, *, rows: int = 4, path: str = "full",
                    loss_cfg=None) -> np.ndarray:
    """Exact ∂²L/∂p_i∂p_j of the run's own training loss over validation rows. A loss term
    the bank's Hessian does not model (e.g. λ_proto_kl) is refused in one line naming it.

    Args:
      i: the first prototype id.
      j: the second prototype id.
      rows: how many validation rows the loss is averaged over (the first ones).
      path: "full" (through the similarities too) or "linear" (activations fixed).
      loss_cfg: the loss (default: the run's config's `loss`).

    Returns:
      The (D, D) float64 block.
    """
    return hessian_block(self, i, j, rows=rows, path=path, loss_cfg=loss_cfg)

  def _ids(self, text_or_ids) -> np.ndarray:
    if isinstance(text_or_ids, str):
      ids = self.tokenizer.encode(text_or_ids)
    else:
      ids = list(text_or_ids)
    if not len(ids):
      raise ValueError("the text encodes to no tokens")
    if len(ids) > self.config.model.max_len:
      raise ValueError(f"the text has {len(ids)} tokens, the model's context is "
                       f"{self.config.model.max_len}")
    return np.asarray(ids, np.int32)

  def generate(self, text, max_new_tokens: int = 32, *, greedy: bool = False,
               temperature: float = SAMPLING["temperature"], top_k: int | None = SAMPLING["top_k"],
               seed: int = SAMPLING["seed"], top: int = TOP_SHOWN):
    """Continue `text`, with each token's prototypes and trust mark.

    A list of texts is generated in batches: prompts of equal token length share one call
    (ragged prompts cannot share a KV cache), so any mix of lengths works. Greedy results
    equal one-at-a-time calls; a sample may depend on its batch (the draws are per batch).

    Args:
      text: the prompt (text or token ids), or a list of texts.
      max_new_tokens: tokens to generate (fewer if the context fills).
      greedy: argmax decoding instead of sampling.
      temperature: sampling temperature (the library's default 0.8).
      top_k: sample among the k most likely tokens (None: all).
      seed: the sampling seed (the same seed gives the same text).
      top: prototypes listed per token in the report.

    Returns:
      A Generation: `.text` (the continuation), `.output` (ids and trace), `.report`; a
      list of them, in order, for a list of texts.
    """
    if isinstance(text, (list, tuple)) and text and all(isinstance(t, str) for t in text):
      return self._generate_many(list(text), max_new_tokens, greedy=greedy,
                                 temperature=temperature, top_k=top_k, seed=seed, top=top)
    ids = self._ids(text)
    room = self.config.model.max_len - len(ids)
    if room < 1:
      raise ValueError(f"the prompt fills the model's context ({self.config.model.max_len})")
    temperature = 0.0 if greedy else temperature
    out = generate_ids(self.model, ids[None], max_new_tokens=min(max_new_tokens, room),
                       temperature=temperature, top_k=top_k, seed=seed,
                       eos_id=self.tokenizer.eos_id,
                       proto_gain_K=None if self.gains_K is None else jnp.asarray(self.gains_K))
    n = int(out.lengths_B[0])
    prompt = text if isinstance(text, str) else self.tokenizer.decode(ids.tolist())
    return Generation(prompt, self.tokenizer.decode(out.tokens_BxL[0, :n].tolist()),
                      sampling_label(temperature, top_k, seed), out,
                      token_report(out, self.tokenizer.decode, top=top))

  def _generate_many(self, texts: list[str], max_new_tokens: int, *, greedy: bool,
                     temperature: float, top_k: int | None, seed: int, top: int
                     ) -> list[Generation]:
    """Run.generate on a list: one batched call per prompt length."""
    ids = [self._ids(t) for t in texts]
    groups: dict[int, list[int]] = {}
    for i, x in enumerate(ids):
      groups.setdefault(len(x), []).append(i)
    temperature = 0.0 if greedy else temperature
    gains = None if self.gains_K is None else jnp.asarray(self.gains_K)
    out: list[Generation | None] = [None] * len(texts)
    for length, members in groups.items():
      room = self.config.model.max_len - length
      if room < 1:
        raise ValueError(f"a prompt fills the model's context ({self.config.model.max_len})")
      batch = generate_ids(self.model, np.stack([ids[i] for i in members]),
                           max_new_tokens=min(max_new_tokens, room), temperature=temperature,
                           top_k=top_k, seed=seed, eos_id=self.tokenizer.eos_id,
                           proto_gain_K=gains)
      for r, i in enumerate(members):
        row = _row(batch, r)
        n = int(row.lengths_B[0])
        out[i] = Generation(texts[i], self.tokenizer.decode(row.tokens_BxL[0, :n].tolist()),
                            sampling_label(temperature, top_k, seed), row,
                            token_report(row, self.tokenizer.decode, top=top))
    return out

  def decompose(self, text) -> Decomposition:
    """Every token after the first, explained: its logit split into the k prototype slices
    and the residual, and the trust of the model's prediction at its position.

    Args:
      text: the text (or token ids), at least two tokens.

    Returns:
      A Decomposition: one TokenExplanation per token after the first (a table in a
      notebook, text in a terminal).
    """
    if self.config.model.kind != "prism":
      raise ValueError(f"{self.workdir} is a dense run: it has no prototypes to decompose by")
    ids = self._ids(text)
    if len(ids) < 2:
      raise ValueError("decompose needs at least two tokens (the first has no prediction)")
    out = self.model(jnp.asarray(ids[None, :-1]))
    parts = decompose_logits(self.model, out.protos, jnp.asarray(ids[1:]))
    idx, act = np.asarray(parts.idx_Nxk), np.asarray(out.protos.act_Nxk, np.float64)
    contrib = np.asarray(parts.contrib_Nxk, np.float64)
    logit = np.asarray(parts.logit_N, np.float64)
    if self.gains_K is None:
      trust = output_trust(self.model, out)
    else:  # the edited logits and their prototype path W z_hat_g (gains applied)
      g = jnp.asarray(self.gains_K)
      g_Nxk = np.asarray(g[out.protos.idx_Nxk], np.float64)
      logit = logit - ((1.0 - g_Nxk) * contrib).sum(-1)
      contrib = contrib * g_Nxk
      trust = edited_trust(self.model, out.protos, controlled_logits(self.model, out, g)[0], g)
    decode = lambda i: piece(self.tokenizer, i)  # a partial UTF-8 byte as <0xNN>
    rows = []
    for j in range(len(ids) - 1):
      order = np.argsort(-np.abs(contrib[j]), kind="stable")
      rows.append(TokenExplanation(
          position=j + 1, token=int(ids[j + 1]), text=decode(ids[j + 1]),
          logit=float(logit[j]),
          prototypes=tuple((int(idx[j, o]), float(act[j, o]), float(contrib[j, o]))
                           for o in order),
          residual=float(parts.residual_N[j]), prediction=int(trust.top1_N[j]),
          prediction_text=decode(trust.top1_N[j]), agrees=bool(trust.agrees_N[j]),
          proto_share=float(trust.proto_share_N[j])))
    return Decomposition(self.tokenizer.decode(ids.tolist()), decode(ids[0]), tuple(rows))


def _row(out, r: int):
  """Row r of a GenerationOutput as a one-row GenerationOutput."""
  take = lambda x: None if x is None else x[r:r + 1]
  trace = None if out.trace is None else type(out.trace)(*(take(x) for x in out.trace))
  return out._replace(tokens_BxL=take(out.tokens_BxL), lengths_B=take(out.lengths_B),
                      logit_BxL=take(out.logit_BxL), trace=trace)


def _packed(run: "Run"):
  return prepare_data(run.config.data, run.config.model.vocab_size, run.workdir)


def _cache(run: "Run", packed, build: bool):
  from prism_jax.attribution.caching import cache_format  # pylint: disable=g-import-not-at-top
  cache_dir = paths.join(run.workdir, "attribution_cache")
  if not build and not cache_format.is_cache_dir(cache_dir):
    raise ValueError(f"no attribution cache in {cache_dir}; pass build=True (or run `prism "
                     f"attribute --workdir={run.workdir} --build_only`)")
  return open_or_build_cache(run, packed)


def open_or_build_cache(run: "Run", packed, writer: str = "prism_jax.load(...)",
                        **build_kwargs):
  """<workdir>/attribution_cache opened, or built (`build_kwargs`: cache.build_cache's)
  under the run lock: a build writes into the run; opening a complete cache writes nothing.
  `writer` names this process in the lock."""
  from prism_jax.attribution.caching import cache as cache_lib  # pylint: disable=g-import-not-at-top
  from prism_jax.attribution.caching import cache_format  # pylint: disable=g-import-not-at-top
  cache_dir = paths.join(run.workdir, "attribution_cache")
  building = (contextlib.nullcontext() if cache_format.is_complete_cache(cache_dir)
              else run_lock.hold(run.workdir, f"{writer}: the attribution cache build"))
  with building:
    return cache_lib.open_or_build(run.model, run.config, packed, cache_dir, **build_kwargs)


def attribute(run: "Run", text, position: int | None = None, *, top: int = 5,
              build: bool = True) -> TokenAttribution:
  """Run.attribute: see its docstring."""
  from prism_jax.attribution.scoring import influence  # pylint: disable=g-import-not-at-top
  if run.config.model.kind != "prism":
    raise ValueError(f"{run.workdir} is a dense run: cached attribution needs prototypes")
  ids = run._ids(text)  # pylint: disable=protected-access
  position = len(ids) - 1 if position is None else int(position)
  if not 1 <= position < len(ids):
    raise ValueError(f"position must be in [1, {len(ids) - 1}] (a token with one before it), "
                     f"got {position}")
  packed = _packed(run)
  cache = _cache(run, packed, build)
  att = influence.attribute(run.model, cache, ids[:position + 1], [position],
                            cfg=influence.InfluenceConfig(top=top), packed=packed)
  agrees = bool(prediction_trust(run.model, ids, [position]).agrees_N[0])
  return TokenAttribution(
      run.tokenizer.decode(ids.tolist()), position, piece(run.tokenizer, ids[position]),
      tuple((int(e), float(sc), snip) for e, sc, snip in zip(att.example_ids, att.scores,
                                                               att.snippets)),
      tuple(int(i) for i in att.query_protos), agrees, "" if agrees else RESIDUAL_DECIDED,
      influence.METHOD_LABEL)


def run_cards(run: "Run", cache=None, *, build: bool = True,
              writer: str = "prism_jax.load(...)", packed=None, **build_kwargs):
  """Run.cards: <workdir>/cards read, or built there under the run lock (with `cache`'s
  index when given; `build_kwargs`: cards.build_cards'); None when absent and not `build`.
  `writer` names this process in the lock; `packed`: the run's data, when held already."""
  from prism_jax.analysis import cards as cards_lib  # pylint: disable=g-import-not-at-top
  cards_dir = paths.join(run.workdir, "cards")
  if paths.path(paths.join(cards_dir, cards_lib.CARDS_FILE)).is_file():
    return cards_lib.CardSet.load(cards_dir, model=run.model)
  if not build:
    return None
  if run.config.model.kind != "prism":
    raise ValueError(f"{run.workdir} is a dense run: it has no prototype cards")
  with run_lock.hold(run.workdir, f"{writer}: building the cards"):
    return cards_lib.build_cards(run.model, run.config,
                                 _packed(run) if packed is None else packed, cache=cache,
                                 decode=run.tokenizer.decode, out_dir=cards_dir,
                                 **build_kwargs)


def hessian_block(run: "Run", i: int, j: int, *, rows: int = 4, path: str = "full",
                  loss_cfg=None) -> np.ndarray:
  """Run.hessian_block: see its docstring."""
  from prism_jax.attribution.hessians.hessian_block import hessian_block as block  # pylint: disable=g-import-not-at-top
  loss_cfg = run.config.loss if loss_cfg is None else loss_cfg
  curvature.check_loss(loss_cfg)  # before reading any data: one line naming the term
  if rows < 1:
    raise ValueError(f"rows must be >= 1, got {rows}")
  val = _packed(run).rows("val")
  if not len(val["tokens"]):
    raise ValueError(f"{run.workdir} has no validation rows (data.val_fraction=0): the "
                     "Hessian block is measured on them")
  take = slice(0, min(rows, len(val["tokens"])))
  b = batch_lib.from_rows(np.asarray(val["tokens"][take]), np.asarray(val["example_id"][take]),
                          np.asarray(val["offset"][take]), None)
  batch = {k: b[k] for k in ("inputs", "targets", "mask")}
  with jax.enable_x64(True):
    return block(run.model, [batch], int(i), int(j), loss_cfg=loss_cfg, path=path)


def report(run: "Run", text, max_new_tokens: int = 32, *, attribution: bool = False,
           **sampling) -> Report:
  """Run.report: see its docstring."""
  from prism_jax.analysis import report as report_lib  # pylint: disable=g-import-not-at-top
  if run.config.model.kind != "prism":
    raise ValueError(f"{run.workdir} is a dense run: a report needs prototypes")
  packed = _packed(run)
  cache = _cache(run, packed, True) if attribution else None
  cards = run_cards(run, cache)
  data = report_lib.report_data(run.model, run.config, run.tokenizer.decode,
                                run._ids(text), cards, cache=cache, packed=packed,  # pylint: disable=protected-access
                                max_new_tokens=max_new_tokens, eos_id=run.tokenizer.eos_id,
                                metrics_path=paths.join(run.workdir, "metrics.jsonl"),
                                **sampling)
  return Report(report_page.render(data))


def load(workdir: str, *, step: int | None = None) -> Run:
  """A trained run in one line.

  Args:
    workdir: the run directory (local or gs://), as `prism train` or `prism import-hf`
      wrote it; a directory `prism export --format=hub` wrote (or a Hugging Face cache
      snapshot of one); or "hf://org/name[@revision]", fetched through huggingface_hub
      (from its cache when HF_HUB_OFFLINE=1).
    step: the checkpoint step (default: the newest).

  Returns:
    A Run: `.model`, `.config`, `.tokenizer`, and generate / decompose / attribute /
    report / steer / suppress / cards / hessian_block.
  """
  from prism_jax.hf import hub  # pylint: disable=g-import-not-at-top
  from prism_jax.loading import load_for_inference  # pylint: disable=g-import-not-at-top
  workdir = hub.resolve(workdir)  # hf://org/name: its snapshot (huggingface_hub's cache)
  if hub.is_hub_dir(workdir):
    if step is not None:
      raise ValueError(f"{workdir} is a Hub export of one checkpoint: it has no step={step}")
    model, cfg, tokenizer = hub.load_hub(workdir)
  else:
    model, cfg, tokenizer = load_for_inference(workdir, step=step)
  return Run(workdir, model, cfg, tokenizer)

