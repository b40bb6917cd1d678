# The same targets for developers and CI. Everything is installed into .venv by `make install`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench

.PHONY: install run test lint typecheck format clean browser

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11) and "memstrata needs Python 3.11+")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

run: install
	$(BIN)/memstrata serve

# The memory browser's tests (tests/test_ui.py) drive Debian's Chromium through Playwright; as
# root, a missing one is installed with apt-get. Where it cannot be, those tests skip, saying why.
CHROMIUM := /usr/bin/chromium

browser:
	@test -x $(CHROMIUM) || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium) \
	      || echo "could not install chromium: the memory browser's tests will skip"; \
	  else \
	    echo "no $(CHROMIUM) and no way to install it (needs root and apt-get): the memory browser's tests will skip"; \
	  fi; }

test: install browser
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/pytest -q -p no:cacheprovider --numprocesses auto --dist loadfile

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache

# Performance benchmarks (bench/README.md): results in bench/results/, report in docs/benchmarks.md.
.PHONY: bench bench-quick

# The benchmarks' own packages (the `bench` extra) on top of `make install`'s.
$(BENCH_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -e '.[dev,bench]'
	@touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BIN)/python -m bench

bench-quick: $(BENCH_STAMP)
	$(BIN)/python -m bench --quick
