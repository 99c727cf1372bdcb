# Two commands do all set-up on a fresh machine (no GPU needed):
#   make run    compile the default tiny model and run it
#   make test   run the test suite (installs the system packages it uses when root: graphviz, chromium)
#   make test-quick   the suite without the tests marked slow (full-size models)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

SYSDEPS := dot:graphviz chromium:chromium

.PHONY: run test test-quick sysdeps bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/python examples/quickstart.py

# graphviz renders SVG drawings; chromium loads the HTML report in its test. Installed with apt-get when missing
# and running as root; otherwise listed (the tests that need them are skipped). A no-op when both are there.
sysdeps:
	@missing=""; for d in $(SYSDEPS); do command -v $${d%%:*} >/dev/null 2>&1 || missing="$$missing $${d##*:}"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	else echo "system packages missing:$$missing (apt-get install$$missing); their tests are skipped"; fi

test: $(STAMP) sysdeps
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q

test-quick: $(STAMP) sysdeps
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) build out
