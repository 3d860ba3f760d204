# Crowdtrain: `make demo` trains the demo campaign, `make test` runs the tests, `make cluster` runs
# several site processes behind HAProxy on PostgreSQL and Redis (deploy/'s topology, without Docker).
# They build the virtual environment first; nothing else needs installing by hand.

PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PORT   ?= 8000
ARGS   ?=
# Browser tests drive Debian's Chromium; Playwright's own browser download is not reachable here.
CHROMIUM := /usr/bin/chromium
# Their own pytest process (a sync Playwright page breaks later async tests), on PostgreSQL and
# Redis like the second pass; failure screenshots go next to the tests' own, in test-artifacts/browser.
BROWSER_PASS := $(BIN)/python -m tests.services $(BIN)/python -m pytest -p no:cacheprovider tests/browser \
	--output test-artifacts/browser --screenshot only-on-failure
# The balancer in front of several site processes (make cluster, and the end-to-end test that runs it).
HAPROXY := /usr/sbin/haproxy
# Debian's Prometheus (promtool comes with it): the deploy tests check deploy/prometheus/ with it and run it
# against a live site and aggregator.
PROMETHEUS := /usr/bin/prometheus
# That test brings its own database and needs PostgreSQL and Redis: it runs in the second pass only.
CLUSTER_TEST := tests/e2e/test_site_processes_behind_a_balancer_share_a_campaign.py
# Brings its own PostgreSQL and Redis to kill: it runs in the second pass only.
ENGINES_TEST := tests/e2e/test_site_redis_and_postgres_killed.py
# The chart bundle the dashboards load (uPlot, from npm, wrapped by frontend/src/charts.js): built, never committed.
NODE_STAMP := frontend/node_modules/.installed
CHARTS := frontend/static/build/charts.js

.PHONY: demo serve cluster lint test test-browser bench venv charts chromium haproxy prometheus clean

venv: $(STAMP)

charts: $(CHARTS)

chromium: $(CHROMIUM)

haproxy: $(HAPROXY)

prometheus: $(PROMETHEUS)

# torch goes in first and alone, pinned: pip then takes the CPU wheel from this
# machine's disk instead of pulling a multi-GB CUDA build for a looser range.
$(STAMP): pyproject.toml agent/pyproject.toml deploy/launcher/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install --quiet --disable-pip-version-check -e ./agent -e ./deploy/launcher -e '.[test]'
	touch $(STAMP)

# npm ci installs exactly the committed lock file; it runs again only when the package files change.
$(NODE_STAMP): frontend/package.json frontend/package-lock.json
	cd frontend && npm ci --no-audit --no-fund
	touch $@

# esbuild writes charts.js and charts.css together, and the browser tab's page, worker and ort/ files;
# charts.js stands for all of them.
$(CHARTS): $(NODE_STAMP) $(wildcard frontend/src/*) $(wildcard frontend/src/tab/*) $(wildcard frontend/scripts/*)
	cd frontend && npm run build

# The join pages tell volunteers to pip install the agent wheel the site serves: built from agent/ first.
demo: $(STAMP) $(CHARTS)
	$(BIN)/python manage.py build_agent_wheel
	$(BIN)/python manage.py demo $(ARGS)

serve: $(STAMP) $(CHARTS)
	$(BIN)/python manage.py migrate --noinput
	$(BIN)/python manage.py build_agent_wheel
	$(BIN)/python manage.py serve --port $(PORT)

# Until Ctrl-C: PostgreSQL and Redis (DATABASE_URL, REDIS_URL, or private ones), 2 daphne processes behind
# HAProxy at https://127.0.0.1:8443/, Celery worker and beat, one aggregator. ARGS="--sites 3 --port 9443"
cluster: $(STAMP) $(CHARTS) $(HAPROXY)
	PYTHONPATH=platform:agent/src:deploy/launcher $(BIN)/python -m crowdtrain_launcher.cluster $(ARGS)

# Debian packages the tests need, installed once (file targets: nothing runs once the binary is there).
# CI runs as root; elsewhere sudo, if any. A fresh machine may have empty package lists, so one failed
# install is retried after an update. $(1): the binary, $(2): the package, $(3): what needs it.
define debian_package
	@if [ "$$(id -u)" -eq 0 ]; then sudo=; \
	elif command -v sudo >/dev/null 2>&1; then sudo=sudo; \
	else echo "$(3) needs $(1): as root, run apt-get install -y --no-install-recommends $(2)" >&2; \
	     exit 1; fi; \
	command -v apt-get >/dev/null 2>&1 \
	  || { echo "$(3) needs Debian's $(2) at $(1), and apt-get is missing" >&2; exit 1; }; \
	export DEBIAN_FRONTEND=noninteractive; \
	$$sudo apt-get install -y --no-install-recommends $(2) \
	  || { $$sudo apt-get update && $$sudo apt-get install -y --no-install-recommends $(2); }
	@test -x $(1) || { echo "apt-get installed $(2) but $(1) is missing" >&2; exit 1; }
endef

$(CHROMIUM):
	$(call debian_package,$@,chromium,the browser tests)

# Its service is not started: the cluster runs its own HAProxy.
$(HAPROXY):
	$(call debian_package,$@,haproxy,the cluster)

# The tests never use the package's own service (policy-rc.d keeps it from starting in containers; where it
# does start, on :9090, nothing reads it): they run their own Prometheus on a free port, with a generated
# config and storage in their temporary folder.
$(PROMETHEUS):
	$(call debian_package,$@,prometheus,the deploy tests)

# The house rules a machine checks (settings in pyproject.toml): lint findings everywhere, tests included;
# formatting and types in the site, the aggregator and the agent.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check platform agent deploy/launcher
	$(BIN)/mypy

# The end-to-end tests run in the second pass, on PostgreSQL and Redis; the first pass keeps one, the swarm
# training the demo's GPT, for the embedded defaults `make demo` runs on (together they would pass 20 minutes).
E2E_SECOND_PASS_ONLY := $(filter-out tests/e2e/test_swarm_trains_a_gpt.py,$(wildcard tests/e2e/test_*.py))

# The first pass runs on TEST_WORKERS pytest-xdist workers (one per core here), a test file per worker at a
# time: on the embedded defaults each worker's database, channel layer and scheduler state are its own. In
# the second pass tests/web runs on the same workers, each with a PostgreSQL database (pytest-django's) and
# a Redis database (tests/redis_per_worker.py) of its own: 3:45 instead of 7:38 here. Its end-to-end tests
# run one at a time after it: each starts several processes of its own, and timing matters to some.
TEST_WORKERS ?= 2
# The trust runs (five agents, a site and an aggregator each) bound the harm hostile volunteers do while the
# referee rules; beside another worker's tests on two cores the referee fell behind and the bound was missed
# (a loss ratio of 1.077 against 1.05). They run alone, on the embedded defaults, right after the first pass.
TRUST_TESTS := tests/trust
PARALLEL := -n $(TEST_WORKERS) --dist loadfile
SECOND_PASS := CELERY_TASK_ALWAYS_EAGER=true $(BIN)/python -m tests.services $(BIN)/python -m pytest -p no:cacheprovider

# Lint first, then three passes: everything on the embedded defaults (SQLite, in-memory channel
# layer), then what touches the database and the channel layer on PostgreSQL
# and Redis (tests/services.py finds them or starts private ones), then the
# browser tests, which the first pass skips (tests/conftest.py). In the second
# pass the test process runs Celery tasks in-process (it has no worker), while
# the sites the end-to-end tests start get a real Celery worker on Redis.
test: lint $(STAMP) $(CHARTS) $(CHROMIUM) $(HAPROXY) $(PROMETHEUS)
	$(BIN)/python -m pytest -p no:cacheprovider $(PARALLEL) --ignore $(CLUSTER_TEST) --ignore $(ENGINES_TEST) \
		--ignore $(TRUST_TESTS) $(addprefix --ignore ,$(E2E_SECOND_PASS_ONLY)) $(ARGS)
	$(BIN)/python -m pytest -p no:cacheprovider $(TRUST_TESTS) $(ARGS)
	$(SECOND_PASS) $(PARALLEL) -p tests.redis_per_worker tests/web $(ARGS)
	$(SECOND_PASS) tests/e2e $(ARGS)
	$(BROWSER_PASS) $(ARGS)

test-browser: $(STAMP) $(CHARTS) $(CHROMIUM)
	$(BROWSER_PASS) $(ARGS)

# W1 (throughput against plain PyTorch), W1 on a GPU (one CUDA agent against plain PyTorch on the same GPU;
# a line saying it was skipped where PyTorch sees no CUDA device), then W1 over a home link (one agent at
# 20 Mbit/s up and 100 down in a network namespace of its own: needs root, as CI has; without it its lines say
# skipped), int8's loss gaps over
# several seeds in one process (sync gradients and DiLoCo pseudo-gradients, with and without error feedback),
# then the scale phases
# (simulated agents against two site processes on PostgreSQL + Redis; tests/services.py's checks, a database of
# its own), then the leasing and overload phases on the embedded default (one site process on SQLite) at the
# issue's sizes, and last the browser-compute gate of each registry family (crowdtrain.browser.report): each
# runs alone too. ARGS go to w1, HOMELINK_ARGS to homelink, SCALE_ARGS and SQLITE_SCALE_ARGS
# to scale, e.g. HOMELINK_ARGS="--w1-samples 65536 --local-samples 16384 --gpt-samples 0",
# SCALE_ARGS="--agents 100 --cpu-agents 100,1000 --idle-agents 2000".
HOMELINK_ARGS ?=
SCALE_ARGS ?=
FAULT_ARGS ?=
SIZE_ARGS ?=
SQLITE_SCALE_ARGS ?= --phases wide,w1like,overload --agents 10,100,300,1000 --cpu-agents 10,100,300,1000 \
	--cpu-rate 25 --overload-agents 1000
bench: $(STAMP) $(CHARTS)
	$(BIN)/python -m tests.benchmarks.protocol
	$(BIN)/python -m tests.benchmarks.leaderboard
	$(BIN)/python -m tests.benchmarks.commit
	$(BIN)/python -m tests.benchmarks.w1 $(ARGS)
	$(BIN)/python -m tests.benchmarks.gpu
	$(BIN)/python -m tests.benchmarks.homelink $(HOMELINK_ARGS)
	$(BIN)/python -m tests.benchmarks.int8_gaps
	$(BIN)/python -m tests.benchmarks.scale $(SCALE_ARGS)
	$(BIN)/python -m tests.benchmarks.scale --backend sqlite $(SQLITE_SCALE_ARGS)
	$(BIN)/python -m tests.benchmarks.faults $(FAULT_ARGS)
	$(BIN)/python -m tests.benchmarks.sizes $(SIZE_ARGS)
	$(BIN)/python -m crowdtrain.browser.report
	$(BIN)/python -m tests.benchmarks.browser_tab

clean:
	rm -rf $(VENV) var frontend/node_modules frontend/static/build
