"""`prism`: one console script, one subcommand per user command (setup.cfg entry point).

  prism train --workdir=runs/tiny [--config=tiny] [--data=...] [--set KEY=VALUE ...]
  prism demo
  prism <command> --help          # that command's flags

Only the named subcommand's module is imported (absl flags are process-wide, and two
commands define flags of the same name), then run by launcher.run: a user error is one
`error: ...` line and exit status 2. `python -m prism_jax.cli` is the same program.
"""

import importlib
import sys

from prism_jax.cli import launcher

# subcommand -> (module under prism_jax.cli, one-line summary)
COMMANDS = {
    "train": ("train", "train (or resume) a PRISM model or its dense twin into --workdir"),
    "generate": ("generate", "sample from a trained run, with each token's top prototypes"),
    "attribute": ("attribute", "generate and trace every token to training text (builds the "
                  "attribution cache)"),
    "report": ("report", "write the interactive HTML report of a prompt's generation"),
    "cards": ("cards", "build the prototype cards of a trained run (top training contexts)"),
    "suppress": ("suppress", "suppress a behaviour by editing prototypes; rates before/after"),
    "evaluate": ("evaluate", "multiple-choice accuracy of a PRISM run, its dense twin and "
                 "sparse controllers"),
    "lm-eval": ("lm_eval_cli", "lm-evaluation-harness on a run: its model 'prism', then "
                "lm-eval's own command line after -- (the lm-eval extra)"),
    "model-card": ("model_card", "parameter counts and FLOPs per token of every preset, and "
                   "the recipes (GPT-2 sizes, llama_1b)"),
    "import-hf": ("import_hf", "import a Hugging Face GPT-2 / Llama / Qwen2 / Mistral "
                  "directory as a run (dense, or PRISM with its bank to set)"),
    "export-hf": ("export_hf", "export a run's backbone as a Hugging Face transformers "
                  "directory"),
    "export": ("export", "export a run: --format=hub, the whole PRISM model for the Hugging "
               "Face Hub (prism_jax.load opens it); --format=hf, the backbone"),
    "config": ("config", "print the resolved config of a preset or a config file with --set "
               "overrides (what `prism train` would train)"),
    "serve": ("serve", "the live explorer in the browser: generate, see why, steer (the "
              "serve extra)"),
    "demo": ("demo", "train the tiny PRISM on the embedded corpus, then show a sample"),
}


def usage() -> str:
  width = max(map(len, COMMANDS))
  lines = ["usage: prism <command> [--flags]   (prism <command> --help: its flags)", "",
           "commands:"]
  lines += [f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items()]
  return "\n".join(lines)


def main(argv=None) -> None:
  argv = list(sys.argv if argv is None else argv)
  if len(argv) < 2 or argv[1] in ("-h", "--help", "--helpshort", "help"):
    print(usage(), file=sys.stdout if len(argv) >= 2 else sys.stderr)
    sys.exit(0 if len(argv) >= 2 else launcher.USAGE_EXIT)
  name = argv[1]
  if name not in COMMANDS:
    print(f"error: unknown command {name!r}; choose one of {', '.join(COMMANDS)}",
          file=sys.stderr)
    sys.exit(launcher.USAGE_EXIT)
  module = importlib.import_module(f"prism_jax.cli.{COMMANDS[name][0]}")
  if hasattr(module, "define_flags"):  # commands whose flags are defined on demand
    module.define_flags()
  launcher.run(module.main, [f"prism {name}"] + argv[2:])


if __name__ == "__main__":
  main()
