# Everything sets itself up: a fresh machine needs only Python 3.11+ and make.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: demo test test-fast bench bench-quick soak typecheck dist clean screenshots

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,postgres,bench]'
	touch $(STAMP)

## demo: a scripted agent session that is killed mid-session, resumed, compacted and exported
## (its own venv with the package alone, no extras; pip's output goes to a log shown only if it fails)
DEMO_VENV := .venv-demo
$(DEMO_VENV)/.stamp: pyproject.toml $(shell find context_persistent -name '*.py')
	@rm -rf $(DEMO_VENV) && $(PYTHON) -m venv $(DEMO_VENV)
	@echo "installing context-persistent into $(DEMO_VENV) (no extras)..."
	@$(DEMO_VENV)/bin/python -m pip install --quiet --disable-pip-version-check . > $(DEMO_VENV)/install.log 2>&1 \
		|| { cat $(DEMO_VENV)/install.log; exit 1; }
	@touch $@
demo: $(DEMO_VENV)/.stamp
	@$(DEMO_VENV)/bin/context-persistent demo

## test: the whole suite, slow crash tests included (what CI runs), in TEST_WORKERS pytest-xdist workers;
## the bytecode is compiled first, once, for the many child processes the tests start, and so is pytest's
## assertion-rewritten bytecode of the test modules, which every worker would otherwise make for itself
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup
BYTECODE := $(PY) -m compileall -q context_persistent amplifier_module_context_persistent benchmarks tests \
	&& $(PY) tests/warm_rewrites.py
test: $(STAMP)
	@$(BYTECODE)
	$(PYTEST)

## test-fast: everything but the tests marked slow
test-fast: $(STAMP)
	@$(BYTECODE)
	$(PYTEST) -m "not slow"

## bench: the full benchmark suite (ratios against the floor and the peers, one run)
bench: $(STAMP)
	$(PY) -m benchmarks.run

## bench-quick: a short benchmark pass for use while developing (under a minute)
bench-quick: $(STAMP)
	$(PY) -m benchmarks.run --quick

## soak: the crash loop with many more kills than the test suite
soak: $(STAMP)
	CP_SOAK_KILLS=$${CP_SOAK_KILLS:-2000} $(PY) -m pytest -q -m slow tests/test_crash_loop.py

## screenshots: the viewer's screenshots in docs/images (docs/viewer.md), with Debian's chromium
screenshots: $(STAMP)
	$(PY) docs/screenshots.py

typecheck: $(STAMP)
	$(PY) -m mypy

## dist: build the sdist and the wheel into dist/ (install with `pip install dist/*.whl`, see README)
BUILD_VENV := .venv-build
$(BUILD_VENV)/.stamp:
	$(PYTHON) -m venv $(BUILD_VENV)
	$(BUILD_VENV)/bin/python -m pip install --quiet --disable-pip-version-check build
	touch $@
dist: $(BUILD_VENV)/.stamp
	rm -rf dist
	$(BUILD_VENV)/bin/python -m build --outdir dist .

clean:
	rm -rf $(VENV) $(BUILD_VENV) $(DEMO_VENV) .pytest_cache build dist *.egg-info
