# Two jobs, each of which sets itself up on a fresh machine:
#   make demo   - virtual environment, install, run the main job
#   make test   - virtual environment with test extras, run the test suite
PYTHON_FOUND := $(shell scripts/find_python.sh)
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test install install-test clean

$(VENV)/.created:
	@test -n "$(PYTHON_FOUND)" || (echo "no Python >= 3.12 found; see scripts/find_python.sh" && exit 1)
	$(PYTHON_FOUND) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	touch $@

$(VENV)/.installed: $(VENV)/.created pyproject.toml
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.created pyproject.toml
	$(PY) -m pip install -q -e ".[test]"
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

demo: $(VENV)/.installed
	rm -rf build/demo
	$(VENV)/bin/specjax sweep configs/demo.yaml --set output_dir=build/demo
	$(VENV)/bin/specjax generate --draft default:draft --prompt "def fibonacci(n):" --max-new-tokens 48

test: $(VENV)/.installed-test
	$(PY) -m pytest -n 2 -q tests

clean:
	rm -rf $(VENV) build
