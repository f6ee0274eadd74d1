# Two jobs, each of which sets itself up on a fresh machine:
#   make demo   - virtual environment, install, run the main job (every drafter on the bundled models;
#                 on a GPU also the 8B-shaped speed table: random weights, synthetic acceptance)
#   make test   - virtual environment with test extras, run the test suite (every tier)
#   make test-fast - the fast tier: no decoding loop compiled, nothing trained, no end-to-end run
#                 (docs/testing.md says what each tier holds and takes)
# Where nothing can be installed but the packages are there (e.g. a GPU machine's image), name the
# interpreter: no virtual environment is made, and it runs this checkout with PYTHONPATH=.
#   make demo SYSTEM_PYTHON=python3
PYTHON_FOUND = $(shell scripts/find_python.sh)
VENV ?= .venv
PY := $(VENV)/bin/python
SYSTEM_PYTHON ?=
ifeq ($(SYSTEM_PYTHON),)
RUN := $(PY)
DEMO_SETUP := $(VENV)/.installed
TEST_SETUP := $(VENV)/.installed-test
else
RUN := PYTHONPATH=$(CURDIR) $(SYSTEM_PYTHON)
DEMO_SETUP :=
TEST_SETUP :=
endif

# For the bundled models, whose GPU steps are bound by kernel launches: XLA's autotuning of Triton
# matrix products is most of their GPU compile time and buys them nothing (docs/performance.md).
# CPUs ignore it; the 8B-shaped table (`specjax speed`) keeps XLA's defaults.
BUNDLED_XLA_FLAGS := --xla_gpu_enable_triton_gemm=false

.PHONY: demo test test-fast install install-test clean

$(VENV)/.created:
	@test -n "$(PYTHON_FOUND)" || (echo "no Python >= 3.12 found; see scripts/find_python.sh" && exit 1)
	$(PYTHON_FOUND) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	touch $@

# PYTHONWARNINGS: setuptools warns at every editable install whatever its mode (lenient: "folders named like
# your package"; strict and compat their own boxes), nothing a user of this checkout can act on.
$(VENV)/.installed: $(VENV)/.created pyproject.toml
	PYTHONWARNINGS=ignore $(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.created pyproject.toml
	PYTHONWARNINGS=ignore $(PY) -m pip install -q -e ".[test]"
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

demo: $(DEMO_SETUP)
	rm -rf build/demo
	XLA_FLAGS="$(BUNDLED_XLA_FLAGS) $$XLA_FLAGS" $(RUN) -m specjax.cli sweep configs/demo.yaml --set output_dir=build/demo
	$(RUN) -m specjax.cli speed --output build/demo
	XLA_FLAGS="$(BUNDLED_XLA_FLAGS) $$XLA_FLAGS" $(RUN) -m specjax.cli generate --draft default:draft \
		--prompt "def fibonacci(n):" --max-new-tokens 48

test: $(TEST_SETUP)
	$(RUN) -m pytest -n 2 --dist loadgroup -q tests

test-fast: $(TEST_SETUP)
	$(RUN) -m pytest -n 2 -q -m fast tests

clean:
	rm -rf $(VENV) build
