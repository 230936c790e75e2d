# rankmeter — developer and CI entry points. `make test` works on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
SERVICES := scripts/services.sh
PYTEST_ARGS ?= -v --durations=30
# The suite's files on two workers, the long ones first (tests/conftest.py): most integration
# tests wait on the services, not the CPU.
PARALLEL ?= -n 2 --dist loadfile --no-loadscope-reorder

.PHONY: help venv services services-down test test-unit bench bench-scrape bench-freshness bench-soak bench-replicas bench-summary bench-debias-cost bench-alerts demo demo-full docs clean

help:
	@echo "make test           set everything up, start Kafka/Redis/Prometheus, run the whole suite, stop them"
	@echo "make services       start the real services on 127.0.0.1 and print their RANKMETER_* settings"
	@echo "make services-down  stop what 'make services' started"
	@echo "make bench          every benchmark of issues 10 and 24 against the real services, then one table of the targets (~25 min)"
	@echo "make bench-scrape   /metrics scrape cost, 100 rankers, 1,000 vs 100,000 open queries (~1 min)"
	@echo "make bench-freshness  production-to-/metrics delay per Kafka backend, Redis bytes per open query (~3 min)"
	@echo "make bench-soak     serve's RSS over 5,000,000 events per Kafka backend (~8 min; BENCH_ARGS=\"--events 500000\")"
	@echo "make bench-replicas 1, 2, 3 serve replicas: events/s and the CPU split serve/broker/Redis (~6 min)"
	@echo "make bench-summary  the table of issue-24 targets from what bench/results/ holds"
	@echo "make bench-alerts   alert quality on a simulated week (BENCH_ARGS=\"--seed 12 --days 7\")"
	@echo "make docs           build docs/ as a site in strict mode (a broken link or a page missing from nav fails)"
	@echo "make demo           simulator + live pipeline + /metrics in one process, with a live table"
	@echo "make demo-full      the same on the real Kafka and Redis of 'make services'"

$(BIN)/rankmeter: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	@touch $@

# rankmeter eval's C reader of plain TREC files, compiled next to its source (a second; without
# a compiler the pure-Python reader reads the same, slower). On every run: the source may change.
venv: $(BIN)/rankmeter
	@$(BIN)/python scripts/build_native.py

services:
	@$(SERVICES) up

services-down:
	@$(SERVICES) down

# Starts the services unless they already answer, and stops only what it started.
# The docs build first: it takes seconds and fails on a broken link before the suite's minutes.
test: venv docs
	@scripts/run-tests.sh $(BIN)/python -m pytest $(PARALLEL) $(PYTEST_ARGS)

test-unit: venv
	$(BIN)/python -m pytest -m "not integration" $(PYTEST_ARGS)

# Each benchmark writes its figures to bench/results/<name>.json; bench/summary.py prints
# one table of issue 24's targets from them (docs/benchmarks.md).
bench: venv
	@scripts/run-tests.sh $(BIN)/python bench/bench_eval.py
	@scripts/run-tests.sh $(BIN)/python bench/bench_serve.py
	@$(BIN)/python bench/bench_scrape.py
	@scripts/run-tests.sh $(BIN)/python bench/bench_freshness.py
	@scripts/run-tests.sh $(BIN)/python bench/bench_soak.py
	@scripts/run-tests.sh $(BIN)/python bench/bench_replicas.py
	@$(BIN)/python bench/bench_debias_cost.py
	@$(BIN)/python bench/summary.py

# Each on its own (docs/benchmarks.md): the scrape needs no services, freshness needs them.
bench-scrape: venv
	$(BIN)/python bench/bench_scrape.py

bench-freshness: venv
	@scripts/run-tests.sh $(BIN)/python bench/bench_freshness.py

bench-soak: venv
	@scripts/run-tests.sh $(BIN)/python bench/bench_soak.py $(BENCH_ARGS)

bench-replicas: venv
	@scripts/run-tests.sh $(BIN)/python bench/bench_replicas.py $(BENCH_ARGS)

bench-summary:
	@$(BIN)/python bench/summary.py

# Position-bias correction: the estimator's costs and the pipeline's µs per event with it off and on.
bench-debias-cost: venv
	$(BIN)/python bench/bench_debias_cost.py

# Alert quality on a simulated week per seed (about 15 minutes each): docs/benchmarks.md.
bench-alerts: venv
	@scripts/run-tests.sh $(BIN)/python bench/alert_quality.py $(or $(BENCH_ARGS),--seed 11 --days 7)

# The whole pipeline in one process: simulator, consumer, join, metrics, /metrics on :9108.
# Embedded (in-process bus, in-memory store) unless RANKMETER_KAFKA_BOOTSTRAP_SERVERS and
# RANKMETER_REDIS_URL are set. Ctrl-C stops it.
demo: venv
	$(BIN)/rankmeter demo $(DEMO_ARGS)

# The same on the harness's real Kafka and Redis (started, then stopped, unless running).
demo-full: venv
	@scripts/run-tests.sh $(BIN)/rankmeter demo $(DEMO_ARGS)

# docs/ as a site (mkdocs.yml): strict, so a link to a missing page or anchor, or a page
# left out of nav, fails the build. Nothing is fetched: default theme, no plugins.
docs: venv
	$(BIN)/mkdocs build --strict --site-dir .cache/site

clean:
	rm -rf $(VENV) .cache .services .pytest_cache .hypothesis
