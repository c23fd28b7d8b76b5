"""Programs whose model must not depend on the world size, one module each in same_model_programs/.

    python tests/api_scripts/same_model.py --output-dir OUT
    torchrun --standalone --nproc-per-node 2 tests/api_scripts/same_model.py --output-dir OUT
    horovodrun -np 2 --gloo python tests/api_scripts/same_model.py --output-dir OUT

Each module of same_model_programs/ (taken in name order) defines ``NAME``,
``run(job, out_dir)`` and ``check(saved, reference)`` (the test's own checks,
beyond the common ones of tests/test_same_model.py). ``run`` trains in float64 on
a global batch that 1, 2 and 3 ranks divide, and ends with ``finish(...)`` from
program_tools.py, which writes OUT/<NAME>.pt on rank 0: the weights before and
after, every rank's largest difference from rank 0's, the world size and the
backend. A violated expectation raises (non-zero exit).
"""
import argparse
import importlib
import pkgutil
import time
from pathlib import Path

import torch

import trainbridge as tb

FOLDER = Path(__file__).resolve().parent / "same_model_programs"
# Run before the others: it calls job.set_seed before the job's first prepare, where every rank seeds alike.
FIRST = ["ema_before"]


def programs() -> dict:
    """NAME -> module, FIRST first, then in module-name order."""
    found = {}
    names = sorted(pkgutil.iter_modules([str(FOLDER)]), key=lambda m: (m.name not in FIRST, m.name))
    for info in names:
        module = importlib.import_module(f"same_model_programs.{info.name}")
        found[module.NAME] = module
    return found


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--programs", default="", help="comma-separated subset (default: all)")
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)
    found = programs()
    job = tb.init(backend=args.backend, timeout=90)
    job.print(f"same model: backend {job.backend_name}, world size {job.world_size}")
    for name in args.programs.split(",") if args.programs else found:
        started = time.monotonic()
        found[name].run(job, args.output_dir)
        job.print(f"{name}: {time.monotonic() - started:.2f}s")
    job.exit(0)
