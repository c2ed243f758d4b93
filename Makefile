# Two commands do everything on a fresh clone (Python >= 3.10, no network beyond PyPI):
#   make demo   - set up .venv and run the main job (apps/finetune.py on the bundled digits data)
#   make test   - set up .venv and run the test suite on the TensorFlow, JAX and torch backends
VENV ?= .venv
PYTHON ?= python3
BACKEND ?= jax
BACKENDS ?= jax tensorflow torch
PY := $(VENV)/bin/python

.PHONY: setup demo test

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[all,export,test]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(PY) apps/finetune.py --backend $(BACKEND)

# One pytest process per backend. Any non-zero exit fails, including 5 ("no tests collected").
test: setup
	@for backend in $(BACKENDS); do \
	  echo "=== pytest on the $$backend backend ==="; \
	  KERAS_BACKEND=$$backend TF_CPP_MIN_LOG_LEVEL=3 $(PY) -m pytest tests $(PYTEST_ARGS); \
	  status=$$?; \
	  if [ $$status -eq 5 ]; then echo "pytest collected no tests on $$backend: failing"; exit 1; fi; \
	  if [ $$status -ne 0 ]; then echo "tests failed on $$backend (exit $$status)"; exit 1; fi; \
	done; echo "all backends passed"
