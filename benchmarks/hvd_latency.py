"""Small-collective latency of trainbridge.hvd against the real Horovod, from interleaved runs.

    python benchmarks/hvd_latency.py --rounds 4 [--np 2] [--json out.json]

Each round launches the same worker twice, one launch after the other: under
``horovodrun -np N --gloo`` (there ``import trainbridge.hvd`` *is* the real ``horovod.torch``)
and under ``torchrun --standalone --nproc-per-node N`` (the torch backend). Interleaving
spreads the machine's ups and downs over both. The worker times, on rank 0, after a warm-up:

* ``allreduce_1``: a blocking 1-element float32 allreduce, the same name every time;
* ``fused_32x1KB``: 32 async 1 KB allreduces under fixed names, then their synchronize (one fused buffer);
* ``broadcast_1KB``: a blocking 1 KB broadcast from rank 0;
* ``allreduce_4MB``: a blocking 4 MB allreduce.

Prints, per case, the median milliseconds per operation of each launch, then the median over the
rounds with its range (min-max) and the ratio trainbridge / Horovod.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

BIN = Path(sys.executable).parent
CASES = ("allreduce_1", "fused_32x1KB", "broadcast_1KB", "allreduce_4MB")


def worker(iterations: int) -> None:
    import torch

    import trainbridge.hvd as hvd

    hvd.init()
    torch.set_num_threads(1)
    one = torch.ones(1)
    small = [torch.ones(256) for _ in range(32)]  # 32 x 1 KB
    bcast = torch.ones(256)
    large = torch.ones(1024 * 1024)  # 4 MB

    def fused() -> None:
        handles = [hvd.allreduce_async_(t, name=f"lat.k{i}", op=hvd.Sum) for i, t in enumerate(small)]
        for handle in handles:
            hvd.synchronize(handle)

    cases: Dict[str, Callable[[], object]] = {
        "allreduce_1": lambda: hvd.allreduce(one, name="lat.one"),
        "fused_32x1KB": fused,
        "broadcast_1KB": lambda: hvd.broadcast_(bcast, root_rank=0, name="lat.bcast"),
        "allreduce_4MB": lambda: hvd.allreduce(large, name="lat.large"),
    }
    result = {"real_horovod": hvd.using_real_horovod}
    for case, run in cases.items():
        count = iterations if case != "allreduce_4MB" else max(10, iterations // 10)
        for _ in range(max(5, count // 10)):  # warm-up: connections, caches
            run()
        hvd.barrier()
        times: List[float] = []
        for _ in range(count):
            started = time.perf_counter()
            run()
            times.append(time.perf_counter() - started)
        result[case] = statistics.median(times) * 1000
    if hvd.rank() == 0:
        print("HVDLAT " + json.dumps(result), flush=True)
    hvd.shutdown()


def launch(kind: str, np: int, iterations: int) -> Dict[str, float]:
    script = [str(Path(__file__).resolve()), "--worker", "--iterations", str(iterations)]
    if kind == "horovod":
        command = [str(BIN / "horovodrun"), "-np", str(np), "--gloo", sys.executable, *script]
    else:
        command = [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={np}", *script]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    lines = [line for line in done.stdout.splitlines() if "HVDLAT " in line]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{kind} run failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    result = json.loads(lines[0].split("HVDLAT ", 1)[1])
    assert result.pop("real_horovod") == (kind == "horovod"), (kind, result)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--iterations", type=int, default=300)
    p.add_argument("--json", help="also write the rows and the summary to this file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.iterations)
        return
    rows: List[Dict] = []
    for round_ in range(args.rounds):
        for kind in ("horovod", "trainbridge"):
            row = {"round": round_, "kind": kind, **launch(kind, args.np, args.iterations)}
            rows.append(row)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    summary = {}
    for case in CASES:
        per_kind = {kind: [r[case] for r in rows if r["kind"] == kind] for kind in ("horovod", "trainbridge")}
        medians = {kind: statistics.median(values) for kind, values in per_kind.items()}
        summary[case] = {
            **{f"{kind}_ms": round(medians[kind], 3) for kind in per_kind},
            **{f"{kind}_range_ms": [round(min(v), 3), round(max(v), 3)] for kind, v in per_kind.items()},
            "ratio": round(medians["trainbridge"] / medians["horovod"], 2),
        }
        print(
            f"{case:15s} horovod {summary[case]['horovod_ms']:7.3f} ms {summary[case]['horovod_range_ms']}  "
            f"trainbridge {summary[case]['trainbridge_ms']:7.3f} ms {summary[case]['trainbridge_range_ms']}  "
            f"ratio {summary[case]['ratio']}",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"np": args.np, "rows": rows, "summary": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
