# `make demo` and `make test` do all the set-up they need on a fresh machine (scripts/setup.sh).
PY := .venv/bin/python
# pytest-xdist workers of make check and make test (0: one process; docs/architecture.md, Tests)
TEST_WORKERS ?= 2
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: setup check test lint demo bench bench-quick clean

setup:
	@bash scripts/setup.sh

lint: setup
	$(PY) -m ruff check vllm_deltasync tests examples benchmarks
	$(PY) -m mypy

# Fast loop while working: lint, types and every test that starts no vLLM engine and no
# multi-rank torchrun job (~2-3 min in the test workers below). The full suite runs both.
check: lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not engine and not distributed" tests

# The full suite, engines included; what CI runs (.ci/run). Whole modules go to TEST_WORKERS
# pytest-xdist workers, engine modules first (tests/conftest.py); each worker's engines bind to
# cores of their own (tests/helpers/cores.py). TEST_WORKERS=0 runs it in this process.
test: lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30 tests

demo: setup
	$(PY) examples/demo.py

# Every benchmark at full size (< 20 min on 2 cores), into benchmarks/RESULTS.md.
bench: setup
	$(PY) -m benchmarks.run

# The headline rows at small sizes (< 5 min), to check a machine before quoting numbers; never
# overwrites RESULTS.md.
bench-quick: setup
	$(PY) -m benchmarks.run --quick --out benchmarks/RESULTS-quick.md

clean:
	rm -rf .venv .pytest_cache .mypy_cache .ruff_cache demo-out
