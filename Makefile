# The two commands of the README. Both set everything up themselves (scripts/setup).
PY := .venv/bin/python

.PHONY: setup test demo bench lint fuzz

setup:
	@./scripts/setup

test: setup lint
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

lint: setup
	$(PY) -m ruff check src tests benchmarks examples
	$(PY) -m mypy

demo: setup
	$(PY) examples/resume_demo.py

bench: setup
	$(PY) benchmarks/bench_checkpoint.py $(BENCH_ARGS)

# The scheduled fuzz run of the manifest and header parsers (10^5 cases, a few minutes).
fuzz: setup
	$(PY) tests/reliability/fuzz_manifest.py --cases 100000
