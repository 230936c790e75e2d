# rankmeter — developer and CI entry points. `make test` works on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
SERVICES := scripts/services.sh
PYTEST_ARGS ?= -v

.PHONY: help venv services services-down test test-unit bench demo clean

help:
	@echo "make test           set everything up, start Kafka/Redis/Prometheus, run the whole suite, stop them"
	@echo "make services       start the real services on 127.0.0.1 and print their RANKMETER_* settings"
	@echo "make services-down  stop what 'make services' started"
	@echo "make bench          run the benchmarks in bench/ against the real services"
	@echo "make demo           the end-to-end demo (arrives with the operations issue)"

$(BIN)/rankmeter: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	@touch $@

venv: $(BIN)/rankmeter

services:
	@$(SERVICES) up

services-down:
	@$(SERVICES) down

# Starts the services unless they already answer, and stops only what it started.
test: venv
	@scripts/run-tests.sh $(BIN)/python -m pytest $(PYTEST_ARGS)

test-unit: venv
	$(BIN)/python -m pytest -m "not integration" $(PYTEST_ARGS)

bench: venv
	@scripts/run-tests.sh $(BIN)/python bench/bench_eval.py
	@scripts/run-tests.sh $(BIN)/python bench/bench_serve.py

demo: venv
	@echo "make demo arrives with the traffic simulator (the operations issue)."
	@echo "Until then: make services, then $(BIN)/rankmeter serve --create-topics 4 (see README)."

clean:
	rm -rf $(VENV) .cache .services .pytest_cache .hypothesis
