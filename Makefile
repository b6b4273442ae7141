# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: demo test install install-test redis clean bench

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# CPU torch from the pinned version first: a looser pin pulls gigabytes of CUDA packages here;
# on a GPU machine the same pin gets the CUDA build.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	touch $@

$(TEST_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $@ $(STAMP)

install: $(STAMP)
install-test: $(TEST_STAMP)

# redis-server from Debian's packages when it is missing (tests start private instances of it).
redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server (Debian package)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server >/dev/null; }
	@command -v redis-server >/dev/null 2>&1 || { echo "redis-server is required"; exit 1; }

demo: install redis
	$(BIN)/tailspec demo

test: install-test redis
	$(BIN)/python -m pytest -q

bench: install redis
	bash benchmarks/run_all.sh

clean:
	rm -rf $(VENV) build *.egg-info
