# The two commands of the README. Both set everything up themselves (scripts/setup).
PY := .venv/bin/python

.PHONY: setup test demo bench lint

setup:
	@./scripts/setup

test: setup
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

lint: setup
	$(PY) -m ruff check src tests benchmarks examples
	$(PY) -m mypy

demo: setup
	$(PY) examples/resume_demo.py

bench: setup
	$(PY) benchmarks/bench_checkpoint.py $(BENCH_ARGS)
