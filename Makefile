# Two commands do all set-up on a fresh machine (no GPU needed):
#   make run    compile the default tiny model and run it
#   make test        run the whole test suite (what CI runs), slowest 25 tests listed
#   make test-quick  everything but the tests marked slow (end-to-end compile + interpret) or gpu
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-quick bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/python examples/quickstart.py

test: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q --durations=25

test-quick: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -m "not slow and not gpu" --durations=10

clean:
	rm -rf $(VENV) build out
