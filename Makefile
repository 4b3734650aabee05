# The two commands a newcomer runs: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# torch 2.13.0 (CPU) lies on disk on the development machines; pin it so pip does not fetch a CUDA build.
TORCH ?= torch==2.13.0
PYTEST_ARGS ?= -n 2

.PHONY: install serve test test-fast demo screenshots clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/ds4serve serve $(ARGS)

demo: install
	$(VENV)/bin/ds4serve generate --raw --max-tokens 60 "def fibonacci(n):"

test: install
	$(PY) -m pytest $(PYTEST_ARGS) tests

# The edit loop: everything but the tests marked slow (tests/conftest.py); a few minutes on 2 cores.
test-fast: install
	$(PY) -m pytest $(PYTEST_ARGS) -m "not slow" tests

# The README's pictures of the browser page (docs/img/web-*.png), taken in headless chromium.
screenshots: install
	$(PY) -m bench.screenshots

clean:
	rm -rf $(VENV) build *.egg-info
