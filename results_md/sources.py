"""Readers that turn an experiment's own results JSON into experiments.reproduce's rows.

Each experiment writes its results in its own shape (docs/results/<topic>.json, with the
"command" that wrote it); a reader here picks the numbers the paper-vs-ours table shows.
A file with no reader must already hold schema rows (reproduce.py's docstring). CAVEATS
(results_md/control.py, with the control and evaluation readers) holds what a
recorded file cannot say about itself; its reader appends it to the row.
"""

from __future__ import annotations

import os
from typing import Callable

from results_md.clone_timing import (demo_time_markdown, demo_time_rows,
                                              suite_time_markdown, suite_time_rows)
from results_md.scale_table import scale_table_markdown
from results_md.serve_load import serve_load_markdown, serve_load_rows
from results_md.prototype_path import (alive_markdown, alive_rows, capacity_markdown,
                                           capacity_rows, defaults_markdown, defaults_rows,
                                           demo_recipe_markdown, demo_recipe_rows,
                                           lds_markdown, size_markdown, size_rows)
from results_md.control import (CAVEATS, heldout_markdown, mc_eval, mc_markdown,
                                           suppression_heldout, suppression_heldout_headline,
                                           suppression_superseded)
from results_md.readers import (bench_pack, hf_llama, lds, lds_costs, lds_default,
                                           retrofit, retrofit_markdown)


def throughput(data: dict) -> list[dict]:
  """PRISM/dense training tokens/s (process CPU time) of the current code, per config: a
  CPU measurement, said so in the row beside the paper's H200 figure."""
  out = []
  for r in data["rows"]:
    if r["code"] == "new":
      loss = {"prism_paper": ", the paper's four loss terms"}.get(r.get("variant"), "")
      out.append({"metric": f"PRISM/dense train tokens/s, {r['config']}{loss} (CPU)",
                  "ours": f"{r['ratio_cpu']:.3f} on CPU (process time)",
                  "note": f"`{r['config']}` at batch {r['batch']} x {r['seq_len']}, "
                          f"{r['steps']} timed steps per model, one run on this 2-core CPU "
                          f"box, not a GPU; analytic FLOP ratio {r['analytic']:.3f}; the "
                          "round's other runs: section 'Training throughput'",
                  "command": data["command"]})
  small = [o for o in out if o["metric"].endswith("small (CPU)")]
  (small or out)[0]["claim"] = "throughput"
  return out


def _runs_label(name: str) -> str:
  stem = os.path.splitext(os.path.basename(name))[0]
  return {"throughput": "A (12 rounds)", "round4_final_B": "B (12 rounds)",
          "round4_small_C": "C (12 rounds, small only)"}.get(
              stem, stem.replace("round4_run", "") + " (8 rounds)")


def throughput_runs_markdown(files: dict[str, dict]) -> str:
  """Round 4 of issue 18, every run of bench_train against the old code (wall / CPU): the
  new code's dense speed-up and PRISM/dense ratios, each run from its own JSON."""
  lines = ["| run | JSON (commit) | byte dense new/old | byte PRISM/dense, paper's loss | "
           "byte PRISM/dense, tiny preset's loss | small PRISM/dense | small dense new/old |",
           "|---|---|---|---|---|---|---|"]

  def pair(new: dict, old: dict, key: tuple[str, str]) -> tuple[str, str]:
    r = new.get(key)
    if r is None:
      return "–", "–"
    ratio = f"{r['ratio_wall']:.3f} / {r['ratio_cpu']:.3f}"
    o = old.get(key[0])
    speed = "–" if o is None else (f"{r['dense_tok_s_wall'] / o['dense_tok_s_wall']:.2f}x / "
                                   f"{r['dense_tok_s_cpu'] / o['dense_tok_s_cpu']:.2f}x")
    return ratio, speed

  for name, data in sorted(files.items(), key=lambda kv: _runs_label(kv[0])):
    new = {(r["config"], r.get("variant")): r for r in data["rows"] if r["code"] == "new"}
    old = {r["config"]: r for r in data["rows"] if r["code"] == "old"}
    paper, byte_speed = pair(new, old, ("byte", "prism_paper"))
    tiny_loss, _ = pair(new, old, ("byte", "prism"))
    small, small_speed = pair(new, old, ("small", "prism"))
    lines.append(f"| {_runs_label(name)} | {name} (`{data['commit'][:12]}`) | {byte_speed} | "
                 f"{paper} | {tiny_loss} | {small} | {small_speed} |")
  return "\n".join(lines)


def cards(data: dict) -> list[dict]:
  return [{"metric": f"prototype cards of the demo model (K {data['K']}) from the cache",
           "paper": "not reported",
           "ours": f"{data['cards_wall_s']:.1f} s wall; {data['cards_equal_brute_force']}/"
                   f"{data['K']} equal a brute-force ranking", "command": data["command"]}]


def cache_scale(data: dict) -> list[dict]:
  out = []
  for r in data["rows"]:
    if r["rank"] == 64:
      out.append({"metric": "attribution cache, rank 64, 0.5B / 10B tokens",
                  "paper": "not reported",
                  "ours": f"{r['store_GB_0.5B']:.0f} GB / {r['store_GB_10B']:.0f} GB "
                          f"({r['record_bytes_per_token']} bytes/token)",
                  "command": data["command"]})
  return out


def _ratio_at(r: dict) -> str:
  return (f"{100 * r['prism_over_dense']:.1f}% ({r['target']}, "
          f"remat {'on' if r['remat'] else 'off'})")


def scale_table(data: dict) -> list[dict]:
  """Paper-vs-ours rows of benchmarks/scale_table.py: predicted PRISM/dense throughput of a
  preset as the range over its targets and remat settings (not the best one alone)."""
  out = []
  for name in ("small", "xl"):
    hits = sorted((r for r in data["ratios"] if r["preset"] == name),
                  key=lambda r: r["prism_over_dense"])
    if not hits:
      continue
    ours = _ratio_at(hits[0])
    if len(hits) > 1:
      ours += f" to {_ratio_at(hits[-1])}"
    out.append({"metric": f"predicted PRISM/dense train tokens/s/chip, {name}, TPU roofline",
                "paper": "97.3% (H200, XL, measured)" if name == "xl" else "not reported",
                "ours": ours,
                "note": f"lowest to highest of {len(hits)} target x remat rows: compiler "
                        "estimates, not measurements",
                "command": data["command"]})
  return out


def scale_table_llama(data: dict) -> list[dict]:
  """The Llama recipe's rows of the scale table: each slice's batch a chip and predicted
  MFU (PRISM only: no dense twin compiled, so no PRISM/dense ratio)."""
  return [{"metric": f"llama_1b PRISM on {r['target']} (remat {'on' if r['remat'] else 'off'}),"
                     " TPU roofline: rows a chip, predicted MFU (full overlap - none)",
           "paper": "not reported",
           "ours": f"{r['per_chip_batch']} rows, {100 * r['mfu']:.0f}% - "
                   f"{100 * r['mfu_no_overlap']:.0f}%",
           "note": "compiler estimates, not measurements", "command": data["command"]}
          for r in data["rows"] if r.get("fits")]


def hessian_block(data: dict) -> list[dict]:
  """The row of experiments/hessian.py --workdir: one exact Hessian block of a trained bank."""
  return [{"metric": f"one exact D x D Hessian block of a trained bank (K {data['K']}, "
                     f"D {data['D']}, {data['tokens']} tokens), {data['D']} HVPs",
           "paper": "not reported",
           "ours": (f"{data['cpu_seconds_ii']:.1f} CPU-s with compilation, "
                    f"{data['cpu_seconds_ij']:.1f} compiled; cosine with K-FAC "
                    f"{data['cosine_ii']:.3f} (i, i), {data['cosine_ij']:.3f} (i, j)"),
           "note": "RESULTS 'Curvature'; CPU time: the box was shared",
           "command": data["command"]}]


def faithfulness(data: dict) -> list[dict]:
  """Issue 11's lever sweep (K 512): its rows, none the default's claim any more."""
  out = []
  for row in data["rows"]:
    row = {k: v for k, v in row.items() if k != "claim"}
    row["note"] = f"{row.get('note', '')}; {CAVEATS['faithfulness']}".lstrip("; ")
    out.append(row)
  return out


def prototype_defaults(data: dict) -> list[dict]:
  """Issue 44's test-half measurement of the old and today's tiny default: agreement and
  CE gap (the faithfulness claim for today's default) and grounding."""
  out = defaults_rows(data)
  out[-1]["claim"] = "faithfulness"
  new = data["rows"]["new"]
  out.append({"metric": f"grounding of today's tiny default ({data['settings']['new']}), "
                        "test half", "claim": "grounding",
              "ours": "; ".join(f"seed {s}: R̄1 {r['r1_bar']:.3f}, R̄2 {r['r2_bar']:.3f}"
                                for s, r in new.items()),
              "note": f"{data['backbone']} backbone, {data['steps']} steps from scratch",
              "command": data["command"]})
  return out


def with_caveat(reader: Callable[[dict], list[dict]], key: str):
  def read(data: dict) -> list[dict]:
    rows = reader(data)
    for r in rows:
      r["note"] = f"{r['note']}; {CAVEATS[key]}" if r.get("note") else CAVEATS[key]
    return rows
  return read


REHEARSAL_CHECKS = ("bank_set_from_data", "losses_finite", "losses_falling",
                    "resume_bit_exact", "preemption_same_step", "cache_equal_one_process",
                    "report_written")


def rehearsal(data: dict) -> list[dict]:
  """Paper-vs-ours row of experiments/rehearsal.py: the CPU pod rehearsal's checks."""
  c = data["checks"]
  passed = [k for k in REHEARSAL_CHECKS if c.get(k)]
  return [{"metric": f"CPU pod rehearsal ({data['config']} shape, {data['num_processes']} "
                     f"processes x {data['local_devices']} devices, gs://)",
           "paper": "not reported",
           "ours": f"{len(passed)}/{len(REHEARSAL_CHECKS)} checks pass, "
                   f"{data['total_s']:.0f} s",
           "command": data["command"]}]


def rehearsal_markdown(data: dict) -> str:
  """The "CPU pod rehearsal" section's tables (between its markers in docs/RESULTS.md)."""
  c = data["checks"]
  lines = [f"`{data['command']}` (commit `{data['commit'][:12]}`); overrides of the "
           f"`{data['config']}` recipe: `" + " ".join(data["overrides"]) + "`", "",
           "| stage | wall s |", "|---|---|"]
  lines += [f"| {k} | {v:.0f} |" for k, v in data["stages_s"].items()]
  lines += [f"| total | {data['total_s']:.0f} |", "", "| check | result |", "|---|---|"]
  details = {"bank_set_from_data": c.get("bank_init"),
             "losses_falling": ", ".join(f"{x:.3f}" for x in c.get("losses", [])),
             "resume_bit_exact": f"SIGTERM after step {c.get('sigterm_after_step')}, "
                                 f"resumed from checkpoint {c.get('resumed_from')}",
             "preemption_same_step": f"saved steps {c.get('preemption_saved_steps')}, exit "
                                     f"codes {c.get('preempted_exit_codes')}",
             "cache_equal_one_process": f"{c.get('cache_tokens')} tokens",
             "report_written": f"{c.get('report_bytes')} bytes of HTML, cards "
                               f"{'written' if c.get('cards') else 'missing'}"}
  for k in REHEARSAL_CHECKS:
    extra = details.get(k)
    lines.append(f"| {k} | {'yes' if c.get(k) else 'NO'}" + (f" ({extra})" if extra else "")
                 + " |")
  ev = c.get("eval", {})
  if ev:
    keys = [k for k in sorted(ev) if k in ("loss", "perplexity", "tokens", "agreement")
            or k.startswith(("r1", "r2", "r_bar", "residual", "dead", "acc_"))]
    lines += ["", "Evaluation at the last step: "
              + ", ".join(f"{k} {ev[k]:.4g}" for k in keys) + "."]
  return "\n".join(lines)


def capacity_seed_rows(data: dict) -> list[dict]:
  """The capacity sweep's k 8 column repeated over seeds: agreement per K, every seed."""
  out = []
  for backbone, per_setting in data["results"].items():
    parts = [f"K {setting.split(':')[0]}: " + " / ".join(
        f"{100 * r['agreement']:.1f}%" for _, r in sorted(per_seed.items()))
        for setting, per_seed in per_setting.items()]
    out.append({"metric": f"bank capacity {backbone}, frozen twin, k 8, seeds "
                          f"{', '.join(sorted(next(iter(per_setting.values()))))}",
                "paper": "not reported", "ours": "agreement " + "; ".join(parts),
                "command": data["command"]})
  return out


def capacity_setting_rows(data: dict) -> list[dict]:
  """Chosen capacity settings measured per seed: agreement (decisive, CE(W z_hat)/CE(W z))
  for each full setting string (the mixture and other overrides kept in its name)."""
  out = []
  for backbone, per_setting in data["results"].items():
    parts = [f"{setting}: " + " / ".join(
        f"{100 * r['agreement']:.1f}% ({100 * r['agreement_decisive']:.1f}%, "
        f"{r['proto_ce_ratio']:.3f})" for _, r in sorted(per_seed.items()))
        for setting, per_seed in per_setting.items()]
    seeds = ", ".join(sorted(next(iter(per_setting.values()))))
    out.append({"metric": f"bank capacity {backbone}, frozen twin, {data['half']} half, seeds "
                          f"{seeds}: agreement (decisive, CE ratio)",
                "paper": "not reported", "ours": "; ".join(parts),
                "command": data["command"]})
  return out


def repeat_markdown(data: dict) -> str:
  """experiments/repeat_test.py: a test's runs in a row beside busy cores."""
  walls = [r["wall_s"] for r in data["runs"]]
  failed = [r["run"] for r in data["runs"] if not r["passed"]]
  return (f"`{data['command']}` (commit `{data['commit'][:12]}`): **{data['passed']} of "
          f"{data['times']} passed** in a row beside {data['busy_processes']} spinning "
          f"core(s); wall {min(walls):.0f}-{max(walls):.0f} s per run"
          + (f"; failed runs: {failed}" if failed else "") + ".")


def repeat_rows(data: dict) -> list[dict]:
  return [{"metric": f"{data['test'].split('::')[-1]} beside a busy core",
           "paper": "not reported", "ours": f"{data['passed']}/{data['times']} passed",
           "command": data["command"]}]


# File stem -> reader; stems not listed must hold schema rows.
READERS: dict[str, Callable[[dict], list[dict]]] = {
    # the held-out protocol's planted row answers the claim; issue 16's runs stay rows,
    # flagged as the protocol it replaced
    "suppression": suppression_superseded,
    "suppression_heldout": suppression_heldout_headline,
    "suppression_heldout_doctest": suppression_heldout,
    "suppression_doctest": suppression_superseded,
    "mc_eval": mc_eval,
    "throughput": throughput,
    "cards": with_caveat(cards, "cards"),
    "cache_scale": with_caveat(cache_scale, "cache_scale"),
    "scale_table": scale_table,
    "scale_table_llama": scale_table_llama,
    "rehearsal": with_caveat(rehearsal, "rehearsal"),
    "faithfulness": faithfulness,
    "retrofit": retrofit,
    "lds": lds,
    "lds_default_k512": lds_default,
    "lds_lambda_proto1": lds,
    "bench_pack": bench_pack,
    "hessian_block": hessian_block,
    "bank_capacity_128x4": capacity_rows,
    "bank_capacity_256x6": capacity_rows,
    "size_trend": size_rows,
    "prototype_defaults": prototype_defaults,
    "bank_alive": alive_rows,
    "bank_alive_trained": alive_rows,
    "bank_alive_auto": alive_rows,
    "serve_load": serve_load_rows,
    "demo_time": demo_time_rows,
    "demo_time_cold": demo_time_rows,
    "suite_time": suite_time_rows,
    "lds_costs_d128x4": lds_costs,
    "preemption_repeat": repeat_rows,
    "bank_capacity_128x4_seeds": capacity_seed_rows,
    "bank_capacity_nnls": capacity_rows,
    "bank_capacity_nnls_test": capacity_setting_rows,
    "demo_recipe_choose": demo_recipe_rows,
    "demo_recipe_test": demo_recipe_rows,
    "hf_llama": hf_llama,
    "demo_recipe_llama": demo_recipe_rows,
    "llama_imported_retrofit": demo_recipe_rows,
}
# Variants recorded beside a headline file (other selections, the dense twin): detail in
# RESULTS.md's sections, not rows of the table.
DETAIL_PREFIXES = ("suppression_", "lds_")
# File stem -> (markdown of its own section, the marker name): reproduce.py writes it
# between `<!-- NAME:begin -->` and `<!-- NAME:end -->` in RESULTS.md.
SECTIONS: dict[str, tuple[Callable[[dict], str], str]] = {
    "scale_table": (scale_table_markdown, "scale_table"),
    "scale_table_llama": (scale_table_markdown, "scale_table_llama"),
    "rehearsal": (rehearsal_markdown, "rehearsal"),
    "bank_capacity_128x4": (capacity_markdown, "prototype_path_capacity_128x4"),
    "bank_capacity_256x6": (capacity_markdown, "prototype_path_capacity_256x6"),
    "prototype_defaults": (defaults_markdown, "prototype_path_test"),
    "size_trend": (size_markdown, "prototype_path_size"),
    "bank_alive": (alive_markdown, "prototype_path_alive"),
    "bank_alive_trained": (alive_markdown, "prototype_path_alive_trained"),
    "bank_alive_auto": (alive_markdown, "prototype_path_alive_auto"),
    "serve_load": (serve_load_markdown, "serve_load"),
    "demo_time": (demo_time_markdown, "demo_time"),
    "demo_time_cold": (demo_time_markdown, "demo_time_cold"),
    "suite_time": (suite_time_markdown, "suite_time"),
    "lds_costs_k128": (lds_markdown, "lds_costs_k128"),
    "lds_costs_d128x4": (lds_markdown, "lds_costs_d128x4"),
    "lds_default_k128": (lds_markdown, "prototype_path_lds_k128"),
    "lds_default_k512": (lds_markdown, "prototype_path_lds_k512"),
    "lds_groups_k128": (lds_markdown, "lds_groups_k128"),
    "lds_groups_d128x4": (lds_markdown, "lds_groups_d128x4"),
    "preemption_repeat": (repeat_markdown, "preemption_repeat"),
    "bank_capacity_128x4_seeds": (capacity_markdown, "prototype_path_capacity_seeds"),
    "bank_capacity_nnls": (capacity_markdown, "prototype_path_capacity_nnls"),
    "bank_capacity_nnls_test": (capacity_markdown, "prototype_path_capacity_nnls_test"),
    "demo_recipe_choose": (demo_recipe_markdown, "demo_recipe_choose"),
    "demo_recipe_test": (demo_recipe_markdown, "demo_recipe_test"),
    "demo_recipe_llama": (demo_recipe_markdown, "demo_recipe_llama"),
    "llama_imported_retrofit": (demo_recipe_markdown, "llama_imported_retrofit"),
    "lds": (lds_markdown, "lds_kl1"),
    "lds_lambda_proto1": (lds_markdown, "lds_lambda_proto1"),
    "retrofit": (retrofit_markdown, "retrofit"),
    "mc_eval": (mc_markdown, "mc_eval"),
    "suppression_heldout": (heldout_markdown, "suppression_heldout"),
}
# Marker name -> (file patterns under the results dir, markdown of those files): sections
# drawn from several results files.
MULTI_SECTIONS: dict[str, tuple[tuple[str, ...], Callable[[dict], str]]] = {
    "throughput_round4": (("throughput.json", "throughput_runs/round4_run*.json",
                           "throughput_runs/round4_final_B.json",
                           "throughput_runs/round4_small_C.json"), throughput_runs_markdown),
}
