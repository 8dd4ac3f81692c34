# `make run`: set up and run the main job (speculative vs plain decoding on the default preset pair).
# `make test`: set up and run the test suite (what CI runs).
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
PROMPT ?= Write a Python function `is_prime(n)` that checks whether n is a prime number, with a docstring and a short example.

.PHONY: setup run test bench
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e ".[test,bench]"
	touch $@

run: setup
	$(BIN)/sparrow generate '$(PROMPT)' --chat --compare --draft-quant int4

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python benchmarks/speculative_vs_transformers.py --out benchmarks/results/foundation
