# The two commands a newcomer needs: `make run` and `make test`. Both set up what they need.
.PHONY: bootstrap run cluster test test-unit lint bench bench-live bench-pipeline help

help:
	@echo "make run        run the whole stack locally (Kafka, Postgres, processors, API on :8000)"
	@echo "make cluster    the same as a cluster on this machine: 3 Kafka nodes, Spark master + 2 workers, 2 API nodes behind HAProxy"
	@echo "make test       run every test (unit, integration, e2e) against real Kafka/Postgres"
	@echo "make test-unit  only the fast unit tests"
	@echo "make lint       ruff + mypy"
	@echo "make bench      benchmarks (results in bench/results/; the figures on docs/benchmarks.md)"
	@echo "make bench-live websocket push benchmarks: freshness, 1,000-subscriber fan-out (with its raw ceiling), 10,000 idle sockets (memory, REST p99 beside them)"
	@echo "make bench-pipeline the whole pipeline's sustained commands/s beside the write side alone's, CPU per command per process"

bootstrap:
	@bash scripts/bootstrap.sh

run: bootstrap
	.venv/bin/logfold run

cluster: bootstrap
	.venv/bin/logfold run --cluster

test: bootstrap lint
	.venv/bin/pytest

test-unit: bootstrap
	.venv/bin/pytest tests/unit

lint: bootstrap
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy

bench: bootstrap
	.venv/bin/python bench/commands.py load --rates 50 200 500 800 1000 --duration 15 --repeats 3

bench-live: bootstrap
	.venv/bin/python bench/live.py freshness --rates 5 20 50 --duration 60 --repeats 3
	.venv/bin/python bench/live.py fanout --clients 1000 --client-procs 2 --rates 5 20 50 --duration 20 --repeats 3
	.venv/bin/python bench/live.py idle-sockets --requests 3000 --repeats 5

bench-pipeline: bootstrap
	.venv/bin/python bench/pipeline.py --rates 50 200 300 400 500 600 700 800 900 1000 1100 --duration 15 --repeats 3 --warmup 45
