# polyrl developer entry points. `make test` and `make demo` are the two commands the README gives.
# Everything is installed into .venv; nothing outside it is touched.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# On a machine with no torch, this build is installed (a CPU build where the local wheel cache has one).
# Vendor stacks: create .venv with their own torch first (see docs/install.md); it is never replaced.
TORCH_SPEC ?= torch==2.13.0
TRITON_SPEC ?= triton
STAMP := $(VENV)/.polyrl-installed

.PHONY: venv test lint demo gpu-test clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(PY) -c "import triton" 2>/dev/null || $(PIP) install -q "$(TRITON_SPEC)" || echo "triton not installable here: Triton kernels are tested only where it is"
	$(PIP) install -q -e ".[serve,data,plot,track,envs,eval,dev,agents]"
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check polyrl tests
	$(PY) -m ruff format --check polyrl tests

# The run viewer's test drives a headless chromium and fails (never skips) without one: installed here where apt-get
# works (Debian CI runs as root); elsewhere a notice, and tests/run/test_viewer.py says how to install it.
BROWSER_CHECK := command -v chromium || command -v chromium-browser || command -v google-chrome
# The CPU suite runs in TEST_WORKERS pytest-xdist processes (the CI host has 2 cores; tests/conftest.py gives each worker
# its share of them as torch threads). Whole files go to a worker (a module's fixtures run once), in collection order,
# the files with a slow test first (tests/conftest.py). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
XDIST_ARGS = $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
# pytest exits 5 when a selection holds no test (e.g. `make gpu-test` on a CPU-only machine): reported, not failed.
test: lint
	@($(BROWSER_CHECK)) >/dev/null || (command -v apt-get >/dev/null && (apt-get update -qq && \
	apt-get install -y -qq chromium) >/dev/null 2>&1) || echo "no chromium and apt-get could not install it: \
	tests/run/test_viewer.py will fail (install chromium, or set POLYRL_CHROMIUM)"
	$(PY) -m pytest -q --timeout=900 $(XDIST_ARGS) $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no test for this selection"; exit 0; fi; exit $$rc

gpu-test: $(STAMP)
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "no gpu test collected"; exit 0; fi; exit $$rc

demo: $(STAMP)
	$(VENV)/bin/polyrl demo

clean:
	rm -rf $(VENV) runs build *.egg-info
