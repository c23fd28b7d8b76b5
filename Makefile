# The two README commands. Both run the idempotent set-up first.
VENV ?= .venv
NPROC ?= 2

.PHONY: setup run test bench clean

setup:
	bash scripts/setup.sh

# Main job: 2-process MNIST training (torchrun, DDP/gloo) on the embedded data.
run:
	bash scripts/setup.sh run
	$(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) -m trainbridge.train \
		--dataset auto --model convnet-dropout --epochs 10 --batch-size 64 --gamma 0.8 --no-progress \
		--output-dir runs/mnist

test: setup
	$(VENV)/bin/python -m pytest -v --durations=25 tests

clean:
	rm -rf runs .pytest_cache
