"""What ``job.allreduce``'s agreement check costs per call, against the backend's bare allreduce.

    torchrun --standalone --nproc-per-node 2 benchmarks/allreduce_check_cost.py --calls 2000
    horovodrun -np 2 --gloo python benchmarks/allreduce_check_cost.py --calls 2000

Times ``--calls`` allreduces of a small tensor (``--numel`` float32 values) four ways, interleaved
per repeat: the backend's bare allreduce (for the torch backend, ``dist.all_reduce`` on a copy),
``job.allreduce`` (a digest of dtype and shape compared in one small max-allreduce first), the
object gather that ``job.allreduce`` ran before (``check_same_on_every_rank``, then the allreduce),
and the digest comparison alone. Prints one JSON line per repeat and the medians, in milliseconds
per call.
"""

import argparse
import json
import statistics
import time

import torch

import trainbridge as tb
from trainbridge.api.signature import same_on_every_rank


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--numel", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    job = tb.init()
    tensor = torch.ones(args.numel)
    signature = {"dtype": str(tensor.dtype), "shape": tuple(tensor.shape)}

    def object_check_then_allreduce():
        job.backend.check_same_on_every_rank("the bench's tensor", signature, "")
        job.backend.allreduce(tensor, "sum")

    ways = {
        "bare_allreduce": lambda: job.backend.allreduce(tensor, "sum"),
        "job_allreduce": lambda: job.allreduce(tensor, "sum"),
        "object_check_then_allreduce": object_check_then_allreduce,
        "digest_check_alone": lambda: same_on_every_rank(job.backend, signature, "bench.signature"),
    }
    rows = []
    for repeat in range(args.repeats):
        row = {"repeat": repeat}
        for name, call in ways.items():
            job.barrier()
            started = time.perf_counter()
            for _ in range(args.calls):
                call()
            row[name + "_ms"] = (time.perf_counter() - started) / args.calls * 1e3
        rows.append(row)
        job.print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}))
    medians = {k: round(statistics.median(r[k] for r in rows), 4) for k in rows[0] if k != "repeat"}
    job.print(json.dumps({"backend": job.backend_name, "world_size": job.world_size, "calls": args.calls, **medians}))
    job.exit(0)


if __name__ == "__main__":
    main()
