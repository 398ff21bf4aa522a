# The two set-up commands from the README:  make demo  and  make test.
# Both create the virtualenv and install on first use; nothing else is needed.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DURATION ?= 60
PYTEST_ARGS ?=
# The Python of the fresh virtualenv `make wheel-smoke` installs the wheel into.
SMOKE_PYTHON ?= $(PYTHON)
DURABLE_TEST_DATABASE_URL ?= postgres://durable:durable@127.0.0.1:5432/durable
SQLITE_TEST_URL := sqlite:///$(CURDIR)/.test-db.sqlite3
# The PostgreSQL pass's own arguments (CI leaves out the unit tier there: it needs no
# database and ran in the SQLite pass).
PG_PYTEST_ARGS ?= $(PYTEST_ARGS)
export DURABLE_TEST_DATABASE_URL

.PHONY: venv demo test test-sqlite test-postgres wheel-smoke lint docs pg-setup clean chaos

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

venv: $(BIN)/.installed

demo: venv
	$(BIN)/python manage.py migrate --noinput -v 0
	$(BIN)/python manage.py demo --duration $(DURATION)

test: test-sqlite test-postgres

test-sqlite: venv
	@echo "== test suite on SQLite ($(shell $(BIN)/python -c 'import django,sys;print("Django",django.__version__,"Python",sys.version.split()[0])'))"
	DATABASE_URL=$(SQLITE_TEST_URL) $(BIN)/python -m pytest $(PYTEST_ARGS)

test-postgres: venv
	@if $(BIN)/python scripts/pg_reachable.py "$(DURABLE_TEST_DATABASE_URL)"; then \
		echo "== test suite on PostgreSQL"; \
		DATABASE_URL="$(DURABLE_TEST_DATABASE_URL)" DURABLE_EXPECT_POSTGRES=1 \
			$(BIN)/python -m pytest $(PG_PYTEST_ARGS); \
	elif [ "$(DURABLE_REQUIRE_POSTGRES)" = "1" ]; then \
		echo "PostgreSQL is required (DURABLE_REQUIRE_POSTGRES=1) but not reachable"; exit 1; \
	else \
		echo "== PostgreSQL run skipped: not reachable (run 'make pg-setup' to create the role)"; \
	fi

# The chaos run (chaos/): workers, load and a nemesis at once, then a history checker.
# Its own database (durable_chaos beside DURABLE_TEST_DATABASE_URL's), recreated each run.
MINUTES ?= 2
SEED ?= $(shell date -u +%Y%m%d)
WORKERS ?= 3
# fail: lateness past the documented bounds fails the run; report: printed only.
LATENESS ?= fail
# RAFT=1: the workers run Raft behind the run's proxy, with partitions and link delays.
RAFT ?=
# CELERY=0: no Celery dispatch in the load. Otherwise the broker (RabbitMQ on 127.0.0.1:5672,
# or CHAOS_CELERY_BROKER) must answer, or the run stops and says so.
CELERY ?= 1
CHAOS_DATABASE_URL ?= $(patsubst %/,%,$(dir $(DURABLE_TEST_DATABASE_URL)))/durable_chaos
CHAOS_ARGS ?=

chaos: venv
	$(BIN)/python -m chaos --minutes $(MINUTES) --seed $(SEED) --workers $(WORKERS) \
		--lateness $(LATENESS) --database-url "$(CHAOS_DATABASE_URL)" $(if $(RAFT),--raft) \
		$(if $(filter 0,$(CELERY)),--no-celery) $(CHAOS_ARGS)

# The installed package works: the wheel, a fresh virtualenv without the dev extras, a new
# startproject outside the checkout (scripts/wheel_smoke.sh says what it checks).
wheel-smoke: venv
	PYTHON=$(SMOKE_PYTHON) BUILD_PYTHON=$(BIN)/python bash scripts/wheel_smoke.sh

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

docs: venv
	$(BIN)/mkdocs build --strict --site-dir site

pg-setup:
	bash scripts/pg_setup.sh

clean:
	rm -rf $(VENV) site build dist .test-db.sqlite3 db.sqlite3 test_db.sqlite3
