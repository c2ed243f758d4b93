# Two commands do everything on a fresh clone (Python >= 3.10, no network beyond PyPI):
#   make demo   - set up .venv and run the main job (apps/finetune.py on the bundled digits data)
#   make test   - set up .venv, lint (ruff) and run the whole test suite on the TensorFlow, JAX and
#                 torch backends
#   make test-fast - lint, then the tests not marked `slow` on one backend (BACKEND, default jax):
#                 the edit-test loop (4:50 for JAX on a quiet 2-core machine, 2026-11-25, as
#                 CONTRIBUTING.md says; 416 s before tests over 5 s became slow)
#   make docs   - build the documentation site strictly into site/ (a broken link or reference fails)
VENV ?= .venv
PYTHON ?= python3
BACKEND ?= jax
BACKENDS ?= jax tensorflow torch
PY := $(VENV)/bin/python

.PHONY: setup demo lint docs test test-fast $(addprefix test-,$(BACKENDS))

# pyproject.toml states ranges; constraints.txt pins the exact versions the tests run with.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[all,export,test,docs]" -c constraints.txt
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(PY) apps/finetune.py --backend $(BACKEND)

# Each backend's pass is two pytest processes (shards): its `slow` tests (end to end: apps and
# training runs in subprocesses, several processes, exports) and the rest. Each process keeps about
# one core busy (tracing and XLA compilation are single-threaded), so TEST_JOBS of the six run at a
# time, the slow ones first: with six shards instead of three passes, both cores of a 2-core
# machine stay busy until the last few minutes. Every process is told the run's backends
# (--backends), so a test that gives one answer whatever the pass runs in one pass only
# (tests/conftest.py). Each shard's output is printed whole when it ends (--output-sync), and each
# has its own pytest temporary directory. Any non-zero exit fails, including 5 ("no tests
# collected"). `make test-jax` runs one backend's two shards.
TEST_JOBS ?= 2
PYTEST_TMP ?= $(or $(TMPDIR),/tmp)/vit_keras-pytest
SLOW_SHARDS := $(addsuffix -slow,$(addprefix test-,$(BACKENDS)))
REST_SHARDS := $(addsuffix -rest,$(addprefix test-,$(BACKENDS)))
TEST_SHARDS := $(SLOW_SHARDS) $(REST_SHARDS)
comma := ,
empty :=
space := $(empty) $(empty)
.PHONY: $(TEST_SHARDS)

# $(call pytest,BACKEND,MARKER EXPRESSION,NAME,PYTEST OPTIONS): one pytest process, failing on
# any non-zero exit.
define pytest
@echo "=== pytest on the $(1) backend: $(3) ==="; start=$$(date +%s); \
	KERAS_BACKEND=$(1) TF_CPP_MIN_LOG_LEVEL=3 $(PY) -m pytest tests -m "$(2)" \
	  --basetemp=$(PYTEST_TMP)-$(1)-$(3) $(4) $(PYTEST_ARGS); \
	status=$$?; \
	echo "shard $(1) $(3): $$(( $$(date +%s) - start )) s (exit $$status)"; \
	if [ $$status -eq 5 ]; then echo "pytest collected no tests on $(1) ($(3)): failing"; exit 1; fi; \
	if [ $$status -ne 0 ]; then echo "tests failed on $(1) ($(3), exit $$status)"; exit 1; fi
endef

lint: setup
	$(VENV)/bin/ruff check .

docs: setup
	$(VENV)/bin/mkdocs build --strict --site-dir site

test: lint
	@$(MAKE) --no-print-directory -j$(TEST_JOBS) --output-sync=target $(TEST_SHARDS) \
	  && echo "all backends passed"

# One backend alone, every test it can run (no --backends: it also runs the tests that a run over
# all backends gives to another pass), without the slow ones.
test-fast: lint
	$(call pytest,$(BACKEND),not slow,fast)

$(addprefix test-,$(BACKENDS)): test-%: test-%-slow test-%-rest

$(SLOW_SHARDS): test-%-slow: setup
	$(call pytest,$*,slow,slow,--backends=$(subst $(space),$(comma),$(BACKENDS)))

$(REST_SHARDS): test-%-rest: setup
	$(call pytest,$*,not slow,rest,--backends=$(subst $(space),$(comma),$(BACKENDS)))
