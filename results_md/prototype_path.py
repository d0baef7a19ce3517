"""The "Prototype path" sections of docs/RESULTS.md (issue 44), from the results JSONs of
experiments.bank_capacity and experiments.size_trend (which print them too); no flags."""

import os

import numpy as np

TARGETS = {"agreement": 0.90, "agreement_decisive": 0.97, "ce_gap": 0.02}


def parse_setting(text: str, flag: str = "grid") -> tuple[int, int, tuple[str, ...]]:
  """'K:k[:key=value...]' -> (K, k, overrides); errors name --`flag`."""
  parts = text.split(":")
  try:
    big_k, k = int(parts[0]), int(parts[1])
  except (ValueError, IndexError):
    raise ValueError(f"--{flag} entry {text!r}: write K:k[:model.X=v...], e.g. 2048:16"
                     ) from None
  extra = tuple(parts[2:])
  bad = [e for e in extra if "=" not in e or not e.startswith(("model.", "loss."))]
  if bad or not 0 < k <= big_k:
    raise ValueError(f"--{flag} entry {text!r}: need 0 < k <= K and model.*/loss.* overrides")
  return big_k, k, extra


def meets(key: str, value: float) -> bool:
  return value <= TARGETS[key] if key == "ce_gap" else value >= TARGETS[key]


LEVELS = (("agreement", (0.5, 0.6, 0.7, 0.8, 0.9)), ("agreement_decisive", (0.9, 0.95, 0.97)))


def smallest_reaching(per_setting: dict, key: str, level: float) -> str:
  """The setting of smallest k (then K) whose seed-mean `key` reaches `level`."""
  best = None
  for setting, per_seed in per_setting.items():
    big_k, k, extra = parse_setting(setting)
    if np.mean([r[key] for r in per_seed.values()]) >= level:
      if best is None or (k, big_k, len(extra)) < best[0]:
        best = ((k, big_k, len(extra)), setting)
  return "not reached" if best is None else best[1]


def capacity_markdown(data: dict) -> str:
  """The "Prototype path: bank capacity" section (experiments.reproduce writes it)."""
  lines = [f"`{data['command']}` (commit `{data['commit'][:12]}`); measured on the "
           f"**{data['half']}** half of the val documents (seed {data['half_seed']}).", ""]
  for backbone, twins in data["twins"].items():
    lines.append(f"- dense twin {backbone}: val CE on the half "
                 + ", ".join(f"seed {s} {r['loss']:.4f}" for s, r in twins.items())
                 + " (every bank row's full CE equals it: frozen backbone, logits W z)")
  lines += ["", data["table"], "", "Smallest k (then K) reaching each level (seed mean):", "",
            "| backbone | " + " | ".join(f"{key.replace('agreement_', '')} ≥ {lv:.0%}"
                                         for key, lvs in LEVELS for lv in lvs) + " |",
            "|---|" + "---|" * sum(len(lvs) for _, lvs in LEVELS)]
  for backbone, per_setting in data["results"].items():
    lines.append(f"| {backbone} | " + " | ".join(
        smallest_reaching(per_setting, key, lv) for key, lvs in LEVELS for lv in lvs) + " |")
  if data.get("plot"):
    lines += ["", f"![agreement against K]({os.path.relpath(data['plot'], 'docs')})"]
  return "\n".join(lines)


def size_markdown(data: dict) -> str:
  lines = [f"`{data['command']}` (commit `{data['commit'][:12]}`); PRISM {data['setting']} "
           f"from scratch beside its dense twin, {data['steps']} steps each on the same "
           f"batches; measured on the **{data['half']}** half of the val documents.", "",
           "| backbone | params | dense val CE | PRISM val CE | CE gap | agreement | decisive "
           "(share) | proto CE ratio | R̄1 / R̄2 | dead |", "|" + "---|" * 10]
  for r in data["rows"]:
    lines.append(f"| {r['backbone']} | {r['backbone_params']:,} | {r['dense_loss']:.4f} | "
                 f"{r['loss']:.4f} | {100 * r['ce_gap']:+.1f}% | {100 * r['agreement']:.1f}% | "
                 f"{100 * r['agreement_decisive']:.1f}% ({100 * r['decisive_share']:.1f}%) | "
                 f"{r['proto_ce_ratio']:.3f} | {r['r1_bar']:.3f} / {r['r2_bar']:.3f} | "
                 f"{r['dead_prototypes']:.0f} |")
  lines += ["", "Linear fit in log10(backbone parameters) through these points (an "
            "extrapolation from few points):", ""]
  for key, target in TARGETS.items():
    at = data["crossings"].get(key)
    met = [r["backbone"] for r in data["rows"] if meets(key, r[key])]
    lines.append(f"- {key} target {target:g}: " + (
        f"met (measured) at {', '.join(met)}" if met else
        "the fit does not move towards it" if at is None else
        f"the fit reaches it at ~10^{at:.1f} backbone parameters"))
  if data.get("plot"):
    lines += ["", f"![agreement and CE gap against size]({os.path.relpath(data['plot'], 'docs')})"]
  return "\n".join(lines)


def alive_markdown(data: dict) -> str:
  lines = [f"`{data['command']}` (commit `{data['commit'][:12]}`)", "",
           "| run | bank set at | revive every | val tokens | val CE | alive | agreement | "
           "decisive | R̄1 / R̄2 | cos to mean direction |", "|" + "---|" * 10]
  for name, r in data["runs"].items():
    lines.append(f"| {name} | {r['init_step']} | {r['revive_every'] or '–'} | "
                 f"{r['val_tokens']:,.0f} | {r['loss']:.4f} | {r['alive']:,.0f} "
                 f"({100 * r['alive_frac']:.1f}%) | {100 * r['agreement']:.1f}% | "
                 f"{100 * r['agreement_decisive']:.1f}% | {r['r1_bar']:.3f} / "
                 f"{r['r2_bar']:.3f} | {r['common_direction_cos']:.3f} |")
  return "\n".join(lines)


def defaults_markdown(data: dict) -> str:
  """Old and new tiny defaults on the test half, two seeds each, beside the targets."""
  lines = [f"`{data['command']}` (commit `{data['commit'][:12]}`); backbone "
           f"{data['backbone']}, {data['steps']} steps from scratch beside the dense twin; "
           f"measured once on the **{data['half']}** half.", "",
           "| default | bank | seed | val CE vs dense | agreement | decisive (share) | proto CE "
           "ratio | R̄1 / R̄2 | step s (dense) |", "|" + "---|" * 9]
  for label, per_seed in data["rows"].items():
    for seed, r in per_seed.items():
      lines.append(f"| {label} | {data['settings'][label]} | {seed} | {100 * r['ce_gap']:+.1f}% | "
                   f"{100 * r['agreement']:.1f}% | {100 * r['agreement_decisive']:.1f}% "
                   f"({100 * r['decisive_share']:.1f}%) | {r['proto_ce_ratio']:.3f} | "
                   f"{r['r1_bar']:.3f} / {r['r2_bar']:.3f} | {r['step_s']:.3f} "
                   f"({r['dense_step_s']:.3f}) |")
  lines += [f"| target | | | ≤ +{100 * TARGETS['ce_gap']:.0f}% | ≥ {100 * TARGETS['agreement']:.0f}% | "
            f"≥ {100 * TARGETS['agreement_decisive']:.0f}% | ≤ 1.05 | ≥ 0.9 | |", "",
            f"Steady training step time, new / old default (seed means, this run): "
            f"{data['step_time_ratio']:.3f}."]
  return "\n".join(lines)



DEMO_TARGETS = {"agreement": 0.70, "agreement_decisive": 0.97, "proto_ce_ratio": 1.05,
                "ce_gap": 0.02}  # issue 53's acceptance for the demo


def demo_recipe_markdown(data: dict) -> str:
  """experiments.demo_recipe's candidates, one row per candidate and seed."""
  lines = [f"`{data['command']}` (commit `{data['commit'][:12]}`); backbone "
           f"{data['backbone']}, {data['steps']} steps from scratch on the tiny corpus, each "
           f"candidate beside the dense twin at equal tokens; measured on the "
           f"**{data['half']}** half of the val documents (seed {data['half_seed']}).", "",
           "| candidate | seed | val CE (dense) | CE gap | agreement | decisive (share) | "
           "proto CE ratio | R̄1 / R̄2 | carriers 90% (median / p90) | train wall s (CPU s) |",
           "|" + "---|" * 10]
  for name, cand in data["rows"].items():
    for seed, r in cand["seeds"].items():
      lines.append(
          f"| {name} | {seed} | {r['loss']:.4f} ({r['dense_loss']:.4f}) | "
          f"{100 * r['ce_gap']:+.1f}% | {100 * r['agreement']:.1f}% | "
          f"{100 * r['agreement_decisive']:.1f}% ({100 * r['decisive_share']:.1f}%) | "
          f"{r['proto_ce_ratio']:.3f} | {r['r1_bar']:.3f} / {r['r2_bar']:.3f} | "
          f"{r['carriers90_median']:g} / {r['carriers90_p90']:g} | "
          f"{r['wall_s']:.0f} ({r['cpu_s']:.0f}) |")
  lines.append(f"| target | | | ≤ +{100 * DEMO_TARGETS['ce_gap']:.0f}% | "
               f"≥ {100 * DEMO_TARGETS['agreement']:.0f}% | "
               f"≥ {100 * DEMO_TARGETS['agreement_decisive']:.0f}% | "
               f"≤ {DEMO_TARGETS['proto_ce_ratio']} | | | |")
  twins = ", ".join(f"seed {s}: {t['wall_s']:.0f} s ({t['cpu_s']:.0f} CPU s)"
                    for s, t in data["twins"].items())
  lines += ["", f"The dense twins' training: {twins}. Overrides on the tiny preset of that "
            "commit:", ""]
  lines += [f"- {name}: `{','.join(c['overrides'])}`" for name, c in data["rows"].items()]
  return "\n".join(lines)


def demo_recipe_rows(data: dict) -> list[dict]:
  """One summary row per candidate: agreement (decisive), CE ratio and CE gap per seed."""
  out = []
  for name, cand in data["rows"].items():
    parts = [f"seed {s}: {100 * r['agreement']:.1f}% ({100 * r['agreement_decisive']:.1f}%), "
             f"{r['proto_ce_ratio']:.3f}, {100 * r['ce_gap']:+.1f}%"
             for s, r in cand["seeds"].items()]
    on = (f" on {data['backbone_sets'][0].split('=')[1]} (twin alike)"
          if data.get("backbone_sets") else "")
    out.append({"metric": f"demo recipe {name}{on}, {data['half']} half: agreement (decisive), "
                          "CE(W z_hat)/CE(W z), full CE vs dense twin",
                "paper": "not reported", "ours": "; ".join(parts),
                "command": data["command"]})
  return out

# experiments.reproduce's rows (the paper-vs-ours table) from the same JSONs.
TARGET_TEXT = ("targets (issue 44): agreement >= 90%, decisive >= 97%, CE(W z_hat)/CE(W z) "
               "<= 1.05, full CE <= +2% vs dense")


def capacity_rows(data: dict) -> list[dict]:
  out = []
  for backbone, per_setting in data["results"].items():
    mean = lambda per_seed, key: float(np.mean([r[key] for r in per_seed.values()]))
    best = max(per_setting, key=lambda s: mean(per_setting[s], "agreement"))
    ps = per_setting[best]
    out.append({"metric": f"prototype path, bank alone on a frozen d {backbone} dense twin: "
                          "best agreement all / decisive, CE(W z_hat)/CE(W z)",
                "paper": "not reported",
                "ours": f"K:k {best}: {100 * mean(ps, 'agreement'):.1f}% / "
                        f"{100 * mean(ps, 'agreement_decisive'):.1f}%, "
                        f"{mean(ps, 'proto_ce_ratio'):.3f}",
                "note": f"{data['half']} half; {len(per_setting)} settings; {TARGET_TEXT}",
                "command": data["command"]})
  return out


def size_rows(data: dict) -> list[dict]:
  return [{"metric": "PRISM from scratch against backbone size: agreement all / decisive, "
                     "full-CE gap to the dense twin",
           "paper": "not reported",
           "ours": "; ".join(f"{r['backbone']}: {100 * r['agreement']:.1f}% / "
                             f"{100 * r['agreement_decisive']:.1f}%, {100 * r['ce_gap']:+.1f}%"
                             for r in data["rows"]),
           "note": f"bank {data['setting']}, {data['half']} half; {TARGET_TEXT}",
           "command": data["command"]}]


def defaults_rows(data: dict) -> list[dict]:
  out = []
  for label, per_seed in data["rows"].items():
    out.append({"metric": f"tiny PRISM, {label} default bank {data['settings'][label]}: "
                          "agreement all / decisive, full-CE gap to dense",
                "paper": "not reported",
                "ours": "; ".join(f"seed {s}: {100 * r['agreement']:.1f}% / "
                                  f"{100 * r['agreement_decisive']:.1f}%, "
                                  f"{100 * r['ce_gap']:+.1f}%" for s, r in per_seed.items()),
                "note": f"test half, measured once; {TARGET_TEXT}",
                "command": data["command"]})
  return out


def alive_rows(data: dict) -> list[dict]:
  first = next(iter(data["runs"].values()))
  how = "by the recipe (auto) " if "auto" in data["runs"] else ""
  return [{"metric": "`small`-shape bank alive (selected on >= 8,192 val tokens), bank set "
                     f"{how}at step {first['init_step']} of {first['steps']}",
           "paper": "not reported",
           "ours": ", ".join(f"{name} {100 * r['alive_frac']:.1f}%"
                             for name, r in data["runs"].items()),
           "note": "target >= 95%; cut run, see RESULTS 'Prototype path'",
           "command": data["command"]}]



def lds_markdown(data: dict) -> str:
  """One pinned-recipe LDS run (experiments/lds.py's JSON): its command and its table, the
  top-100 retention line included."""
  return (f"`{data['command']}` (commit `{data['commit'][:12]}`)\n\n"
          + data["table"].replace("\n\nremoval curves: off (--removal_queries=0)", ""))
