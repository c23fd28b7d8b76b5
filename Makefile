# The two README commands. Both run the idempotent set-up first.
VENV ?= .venv
NPROC ?= 2

.PHONY: setup run test test-e2e test-fast test-torch-versions lint bench clean

setup:
	bash scripts/setup.sh

# Main job: 2-process MNIST training (torchrun, DDP/gloo) on the embedded data.
run:
	bash scripts/setup.sh run
	$(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) -m trainbridge.train \
		--dataset auto --model convnet-dropout --epochs 10 --batch-size 64 --gamma 0.8 --no-progress \
		--output-dir runs/mnist

# Every test but the whole product runs of minutes (marker e2e) and the launcher matrix (marker matrix: a
# guarantee make test checks once per backend, again under the other launchers, on a third rank, across two
# hosts, on SLURM, against the real Horovod), which `make test-e2e` runs; CI (.ci/run) runs both, then
# `make test-torch-versions`.
# Three workers on 2 cores: a launch's time is mostly torch's start-up and waiting on other processes, and the
# cores sit a third idle with one. A worker takes a whole test file, so a file's shared runs start once; the
# costliest files first, in the order tests/conftest.py gives (--no-loadscope-reorder keeps it).
TEST_WORKERS ?= 3
test: setup
	$(MAKE) lint
	$(VENV)/bin/python -m pytest -v --durations=25 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		-m "not e2e and not matrix" tests

# Alone first, one test at a time: the bench's smoke runs (they time their runs, and under other load their 14
# runs outlast their limits) and the docs' pages (each a shell of several 2-rank trainings: three side by side
# with the matrix took 2.5-3x their time alone, and the DesignSafe page once ran past its limit). Then the other
# e2e runs and the launcher matrix on TEST_WORKERS workers, file by file as in make test.
ALONE_E2E = tests/test_bench.py tests/test_docs_literal.py
test-e2e: setup
	$(VENV)/bin/python -m pytest -v --durations=10 -m e2e $(ALONE_E2E); alone=$$?; \
	$(VENV)/bin/python -m pytest -v --durations=25 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		-m "e2e or matrix" $(addprefix --ignore ,$(ALONE_E2E)) tests && exit $$alone

# The fast inner loop: the in-process tests only (tests/unit, one file per source module, and the
# older files that start no launcher), about 80 s on 2 busy cores. It skips the set-up (scripts/setup.sh
# and its apt steps): it assumes the venv exists, so run `make setup` (or `make test`) once first.
FAST_TESTS = tests/unit tests/test_hvd_units.py tests/test_launch_detection.py tests/test_multihost_units.py \
	tests/test_sharding.py tests/test_models.py tests/test_loaders.py tests/test_designsafe_units.py \
	tests/test_cli_flags.py tests/test_train_options.py tests/test_architecture.py

test-fast:
	$(VENV)/bin/python -m pytest -q --durations=10 -m "not launch" $(FAST_TESTS)

# The API and trainbridge.hvd tests on other torch releases than the development pin: the oldest
# supported and the newest the package index serves here (each in a venv of its own, removed after).
TORCH_VERSIONS ?= 2.11.0 2.14.1
test-torch-versions:
	REMOVE_VENVS=1 bash scripts/test_torch_versions.sh $(TORCH_VERSIONS)

# The linter, the formatter's check and the type checker over the package and the bench: ruff (settings in
# ruff.toml), then mypy (setup.cfg's [mypy]). The tests get the linter too. Both come with the test extra;
# `make test` runs it first.
lint:
	$(VENV)/bin/python -m ruff check trainbridge benchmarks tests
	$(VENV)/bin/python -m ruff format --check trainbridge benchmarks
	$(VENV)/bin/python -m mypy trainbridge benchmarks/bench

# The peer bench's smoke run (the bench lives in the checkout, benchmarks/bench; docs/guides/benchmarks.md).
bench: setup
	$(VENV)/bin/python -m benchmarks --quick

clean:
	rm -rf runs .pytest_cache
