# Crowdtrain: `make demo` trains the demo campaign, `make test` runs the tests.
# Both build the virtual environment first; nothing else needs installing by hand.

PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PORT   ?= 8000
ARGS   ?=

.PHONY: demo serve test bench venv clean

venv: $(STAMP)

# torch goes in first and alone, pinned: pip then takes the CPU wheel from this
# machine's disk instead of pulling a multi-GB CUDA build for a looser range.
$(STAMP): pyproject.toml agent/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install --quiet --disable-pip-version-check -e ./agent -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python manage.py demo $(ARGS)

serve: $(STAMP)
	$(BIN)/python manage.py migrate --noinput
	$(BIN)/python manage.py serve --port $(PORT)

# Twice over: everything on the embedded defaults (SQLite, in-memory channel
# layer), then what touches the database and the channel layer on PostgreSQL
# and Redis (tests/services.py finds them or starts private ones).
test: $(STAMP)
	$(BIN)/python -m pytest -p no:cacheprovider $(ARGS)
	$(BIN)/python -m tests.services $(BIN)/python -m pytest -p no:cacheprovider tests/web tests/e2e $(ARGS)

bench: $(STAMP)
	$(BIN)/python -m tests.benchmarks.w1 $(ARGS)

clean:
	rm -rf $(VENV) var
