# The two quick-start commands: `make demo` (set up, then run the main job, `rlmm train`, on the built-in default)
# and `make test` (set up, then run the tests). Both create .venv on first use (scripts/setup.sh).
VENV ?= .venv
PYTEST_ARGS ?=

.PHONY: setup demo test test-all clean-cache

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/bin/rlmm train

test: setup
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

# Also the heavier checks (every sampler x trainer x precision combination), see README.
test-all: setup
	$(VENV)/bin/python -m pytest -m "slow or not slow" $(PYTEST_ARGS)

clean-cache:
	rm -rf $${RLMM_CACHE:-$$HOME/.cache/rlmm}/models
