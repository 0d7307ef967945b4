# Two commands on a fresh machine: `make run` and `make test`. Both create .venv when needed.
SHELL := /bin/bash
PY_SYS ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1
# Python caches the package's bytecode (in __pycache__, git-ignored): a host or image that
# turns that off made every worker, agent, driver and CLI start compile the package again
# (0.17 CPU-s a process here), and a warm standby's hand-off compile the worker's module.
unexport PYTHONDONTWRITEBYTECODE
export NO_MKDOCS_2_WARNING = 1

# CI runs the subset that fits in its budget; `make test-all` runs every test. `-n auto`:
# one test file at a time unless PYTEST_XDIST_AUTO_NUM_WORKERS=2 (tests/conftest.py says why).
# Files side by side: the tests marked `alone` then run by themselves (PYTEST_ALONE= skips
# them); one at a time they are in the one pass. Not when PYTEST_ARGS was given (`make test
# PYTEST_ARGS=tests/unit` runs what it names, nothing more).
SIDE_BY_SIDE := $(filter-out 0 1,$(strip $(PYTEST_XDIST_AUTO_NUM_WORKERS)))
PYTEST_ARGS ?= -m "not slow$(if $(SIDE_BY_SIDE), and not alone)" -x --durations=15 -n auto --dist loadfile
PYTEST_ALONE ?= $(if $(and $(SIDE_BY_SIDE),$(filter file,$(origin PYTEST_ARGS))),-m "alone and not slow" -x --durations=5)

.PHONY: run test test-all chaos proto lint bench bench-% clean venv docs docs-api docs-bench dist

venv: $(STAMP)

# Re-install only when pyproject.toml changes; a second run is quick.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PY_SYS) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	@# torch first, pinned to the CPU build this machine has: the package asks only for a range
	@# (pyproject.toml), which this satisfies, so the editable install pulls no CUDA wheel.
	$(PY) -m pip install -q torch==2.13.0
	@# the adapters' libraries (transformers, accelerate, lightning) must not move torch off the pin
	$(PY) -m pip install -q -c <(echo torch==2.13.0) -e '.[dev,adapters]'
	@touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/unbroken up $(ARGS)

test: $(STAMP)
	$(PY) proto/generate.py --check
	$(PY) -m mkdocs build --strict --quiet
	$(PY) -m pytest $(PYTEST_ARGS)
	$(if $(strip $(PYTEST_ALONE)),$(PY) -m pytest $(PYTEST_ALONE))

# The docs site (into site/), warnings (broken links, missing pages and anchors) as errors.
docs: $(STAMP)
	$(PY) -m mkdocs build --strict

# Regenerate the generated pages: the gRPC reference from proto/, the benchmark tables from
# bench/results/*.json (tests/unit/test_docs_generated.py fails when either is stale).
docs-api: $(STAMP)
	$(PY) docs/gen_api.py

docs-bench: $(STAMP)
	$(PY) docs/gen_benchmarks.py

# A wheel and an sdist in dist/.
dist: $(STAMP)
	$(PY) -m build --outdir dist .

# The whole chaos suite: every seed of tests/chaos (slow ones too); ~25 min on the shared 2 cores.
chaos: $(STAMP)
	$(PY) -m pytest tests/chaos --durations=0 -rA $(CHAOS_ARGS)

test-all: $(STAMP)
	$(PY) -m pytest --durations=25

proto: $(STAMP)
	$(PY) proto/generate.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	@# mypy cannot follow the editable install's package-dir mapping: give it a symlink tree.
	@mkdir -p build/typecheck/unbroken
	@for d in proto common driver agent diagnostics recovery trainer cli; do ln -sfn ../../../$$d build/typecheck/unbroken/$$d; done
	MYPYPATH=build/typecheck $(VENV)/bin/mypy --explicit-package-bases \
		-p unbroken.driver -p unbroken.agent -p unbroken.diagnostics -p unbroken.recovery -p unbroken.trainer -p unbroken.cli -p unbroken.common

# scale_e2e.py is the e2e section of scale.py (`make bench-scale` runs it): not run twice;
# ab.py compares another bench at two commits (it needs its arguments: `make bench-ab ARGS=`).
BENCH_PARTS := bench/scale_e2e.py bench/ab.py
bench: $(STAMP)
	@for b in $(filter-out $(BENCH_PARTS),$(wildcard bench/*.py)); do echo "== $$b"; $(PY) $$b || exit 1; done

bench-%: $(STAMP)
	$(PY) bench/$*.py $(ARGS)

clean:
	rm -rf $(VENV) build dist site *.egg-info .pytest_cache .mypy_cache .ruff_cache
