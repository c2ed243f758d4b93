# Two commands do everything on a fresh clone (Python >= 3.10, no network beyond PyPI):
#   make demo   - set up .venv and run the main job (apps/finetune.py on the bundled digits data)
#   make test   - set up .venv, lint (ruff) and run the test suite on the TensorFlow, JAX and torch
#                 backends
#   make docs   - build the documentation site strictly into site/ (a broken link or reference fails)
VENV ?= .venv
PYTHON ?= python3
BACKEND ?= jax
BACKENDS ?= jax tensorflow torch
PY := $(VENV)/bin/python

.PHONY: setup demo lint docs test $(addprefix test-,$(BACKENDS))

# pyproject.toml states ranges; constraints.txt pins the exact versions the tests run with.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[all,export,test,docs]" -c constraints.txt
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(PY) apps/finetune.py --backend $(BACKEND)

# One pytest process per backend, TEST_JOBS of them at a time: a pass keeps about one core busy
# (tracing and XLA compilation are single-threaded), so two passes at once use both cores of a
# 2-core machine. Each pass's output is printed whole when it ends (--output-sync), and each gets
# its own pytest temporary directory. Any non-zero exit fails, including 5 ("no tests collected").
TEST_JOBS ?= 2
PYTEST_TMP ?= $(or $(TMPDIR),/tmp)/vit_keras-pytest

lint: setup
	$(VENV)/bin/ruff check .

docs: setup
	$(VENV)/bin/mkdocs build --strict --quiet --site-dir site

test: lint
	@$(MAKE) --no-print-directory -j$(TEST_JOBS) --output-sync=target \
	  $(addprefix test-,$(BACKENDS)) && echo "all backends passed"

$(addprefix test-,$(BACKENDS)): test-%: setup
	@echo "=== pytest on the $* backend ==="; \
	KERAS_BACKEND=$* TF_CPP_MIN_LOG_LEVEL=3 $(PY) -m pytest tests --basetemp=$(PYTEST_TMP)-$* \
	  $(PYTEST_ARGS); \
	status=$$?; \
	if [ $$status -eq 5 ]; then echo "pytest collected no tests on $*: failing"; exit 1; fi; \
	if [ $$status -ne 0 ]; then echo "tests failed on $* (exit $$status)"; exit 1; fi
