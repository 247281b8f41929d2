# The README's two commands: `make demo` and `make test`. Everything they need is installed here.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell sha256sum requirements.txt | cut -c1-12)
NODE_STAMP := node_modules/.installed-$(shell cat package.json package-lock.json 2>/dev/null | sha256sum | cut -c1-12)

.PHONY: install demo serve rehearsal test lint typecheck pytest bench bench-hosts clean

$(STAMP): requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements.txt
	rm -f $(VENV)/.installed-*
	touch $@

# anvil (local EVM chain) and solc come from the npm registry; no other download.
$(NODE_STAMP): package.json package-lock.json
	npm ci --no-audit --no-fund --ignore-scripts --loglevel=error
	rm -f node_modules/.installed-*
	touch $@

install: $(STAMP) $(NODE_STAMP)

# The browser tests (tests/browser) drive Debian's chromium; playwright never downloads one.
# CI runs as root on a fresh Debian machine, where apt works; elsewhere sudo, if it needs no
# password, or a message saying what to install.
CHROMIUM := /usr/bin/chromium
$(CHROMIUM):
	@if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO=sudo; \
	else echo "make test: the browser tests need Debian's chromium: sudo apt-get install chromium" >&2; \
	exit 1; fi; \
	$$SUDO apt-get update -qq && \
	$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium

# The PgBouncer tests (tests/integration/test_pgbouncer.py) start Debian's pgbouncer in
# transaction pooling, installed the same way (they start a private one on a free port).
PGBOUNCER := /usr/sbin/pgbouncer
$(PGBOUNCER):
	@if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO=sudo; \
	else echo "make test: the PgBouncer tests need Debian's pgbouncer: sudo apt-get install pgbouncer" >&2; \
	exit 1; fi; \
	$$SUDO apt-get update -qq && \
	$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pgbouncer

# The restore drill (tests/test_restore_drill.py, docs/going-live.md) runs pg_dump,
# pg_restore, createdb and dropdb: Debian's postgresql-client, installed the same way. Debian
# 12's client is PostgreSQL 15, as is its server; pg_dump refuses a newer server than itself.
PG_DUMP := /usr/bin/pg_dump
$(PG_DUMP):
	@if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO=sudo; \
	else echo "make test: the restore drill needs Debian's postgresql-client: sudo apt-get install postgresql-client" >&2; \
	exit 1; fi; \
	$$SUDO apt-get update -qq && \
	$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql-client

demo: install
	$(BIN)/python scripts/demo.py

# Production: gunicorn, a Celery worker and beat on PostgreSQL and Redis (docs/deployment.md).
# ROLES picks what this host runs: any of migrate, web, worker, beat (default: all).
ROLES ?=
serve: install
	$(BIN)/python scripts/serve.py $(ROLES)

# Production's shape against a local chain impersonating Base mainnet (docs/rehearsal.md):
# anvil as chain 8453 at 2 s blocks, the test token at Base's USDC address, Tollbooth on
# production settings (PostgreSQL and Redis from DATABASE_URL and REDIS_URL: it uses its own
# tollbooth_rehearsal database and Redis db 15 there), a stock x402 client paying direct and
# through the CDP-authenticated facilitator double, a refund paid back. Prints what it proved.
rehearsal: install
	$(BIN)/python scripts/rehearsal.py

# One table of every benchmark figure, each a ratio against an anchor measured in the same
# run (docs/benchmarks.md). Needs DATABASE_URL (PostgreSQL: its server gets a tollbooth_bench
# database) and REDIS_URL. BENCH_SCALE=smoke: tiny and once, as CI runs it.
# DEMO_CHAIN_BLOCK_TIME=2: the x402 figures on a chain mining every 2 seconds (as `make demo`).
BENCH_SCALE ?= full
bench: install
	$(BIN)/python bench/run.py --scale $(BENCH_SCALE) $(BENCH_ARGS)

# The production shape across hosts (docs/deployment.md): network namespaces for a load
# balancer (Debian's haproxy, installed as chromium and pgbouncer are), two web hosts, two
# worker hosts and a private PostgreSQL and Redis host, a delay proxy on every link; then a
# web host and a worker host cut off mid-load. Needs root (ip netns), as CI runs.
# BENCH_SCALE=smoke: one repeat of one call per agent, one web fault.
HAPROXY := /usr/sbin/haproxy
$(HAPROXY):
	@if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO=sudo; \
	else echo "make bench-hosts: needs Debian's haproxy: sudo apt-get install haproxy" >&2; \
	exit 1; fi; \
	$$SUDO apt-get update -qq && \
	$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq haproxy

bench-hosts: install $(HAPROXY)
	$(BIN)/python bench/hosts.py --scale $(BENCH_SCALE) $(BENCH_HOSTS_ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

typecheck: install
	$(BIN)/mypy .

# Twice: the whole suite (on PostgreSQL when DATABASE_URL says so), then every test that
# does not need PostgreSQL or a worker in another process again, on a file SQLite database
# as `make demo` uses: the embedded default runs everything (PostgreSQL-only SQL has crashed
# there before). Each `postgres` mark says why the test needs PostgreSQL.
SQLITE_TEST_URL := sqlite:///$(CURDIR)/var/concurrency.sqlite3
pytest: install $(CHROMIUM) $(PGBOUNCER) $(PG_DUMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)
	mkdir -p var
	DATABASE_URL=$(SQLITE_TEST_URL) $(BIN)/python -m pytest -m "not postgres and not worker" $(PYTEST_ARGS)

test: lint typecheck pytest

clean:
	rm -rf $(VENV) node_modules var
