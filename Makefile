# Two commands do all set-up on a fresh machine (no GPU needed):
#   make run    compile the default tiny model and run it
#   make test   run the test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/python examples/quickstart.py

test: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build out
