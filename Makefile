# The two quick-start commands: `make demo` (set up, then run the main job, `rlmm train`, on the built-in default)
# and `make test` (set up, then run the tests). Both create .venv on first use (scripts/setup.sh).
VENV ?= .venv
PYTEST_ARGS ?=
# One test worker a core, at most 4 (pytest-xdist, each file's tests on one worker: tests/conftest.py): the suite
# alone keeps one core busy. TEST_WORKERS=0 runs it in this one process.
TEST_WORKERS ?= $(shell n=$$(nproc); echo $$(( n < 4 ? n : 4 )))
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

.PHONY: setup demo test test-all clean-cache

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/bin/rlmm train

test: setup
	$(VENV)/bin/python -m pytest $(XDIST) $(PYTEST_ARGS)

# Also the heavier checks (every sampler x trainer x precision combination), see README.
test-all: setup
	$(VENV)/bin/python -m pytest $(XDIST) -m "slow or not slow" $(PYTEST_ARGS)

clean-cache:
	rm -rf $${RLMM_CACHE:-$$HOME/.cache/rlmm}/models
