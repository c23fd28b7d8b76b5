"""Drives trainbridge's shared-memory gradient exchange in real processes (tests/test_shm_allreduce.py).

    python tests/speed_scripts/shm_probe.py average N    # N ranks average several tensors in tiny chunks
    python tests/speed_scripts/shm_probe.py small N      # N ranks: asynchronous small allreduces between averages
    python tests/speed_scripts/shm_probe.py exit         # rank 1 exits before the exchange
    python tests/speed_scripts/shm_probe.py stall        # rank 1 stays alive but never arrives

Ranks are multiprocessing children joined by a gloo process group over a
FileStore; the parent reports each rank's exit code and last output line as
JSON. The parent joins a child only after rank 0 finished, so an exited rank 1
is a zombie meanwhile, as it would be under a launcher that has not reaped it yet.
"""
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from trainbridge.backends.shm_allreduce import PeerGone, ShmAllreduce

CHUNK = 256  # bytes: forces many chunks and reuse of both slot sets


def rank_main(rank, world_size, tmp, scenario):
    store_path = os.path.join(tmp, "store")

    def report(line):  # a file per rank: written before os._exit, unlike a Queue's feeder thread
        with open(os.path.join(tmp, f"rank{rank}.part"), "w") as f:
            f.write(line)
        os.rename(os.path.join(tmp, f"rank{rank}.part"), os.path.join(tmp, f"rank{rank}.txt"))

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)

    def broadcast(obj):
        box = [obj]
        dist.broadcast_object_list(box)
        return box[0]

    def allgather(obj):
        out = [None] * world_size
        dist.all_gather_object(out, obj)
        return out

    exchange, why = ShmAllreduce.open(rank, world_size, CHUNK, 3.0, broadcast, allgather)
    if exchange is None:
        report(f"refused: {why}")
        os._exit(2)
    if scenario == "average":
        gen = torch.Generator().manual_seed(rank)
        tensors = [torch.randn(n, generator=gen) for n in (1, 63, 64, 1000, 12345)]
        tensors.append(torch.randn(777, generator=gen).to(torch.bfloat16))
        before = [t.clone() for t in tensors]
        for t in tensors:
            exchange.average_(t)
        # Expected: the float64 mean of every rank's input; every rank must hold the same bits.
        everyone = allgather(before)
        errors = []
        for i, t in enumerate(tensors):
            mean = torch.stack([b[i].double() for b in everyone]).mean(0)
            errors.append(float((t.double() - mean).abs().max()))
        same = all(all(torch.equal(a, b) for a, b in zip(tensors, other)) for other in allgather(tensors))
        report(json.dumps({"max_error_fp32": max(errors[:-1]), "max_error_bf16": errors[-1],
                                       "identical_on_all_ranks": same, "chunks": exchange.seq}))
        os._exit(0)
    if scenario == "small":
        # Many asynchronous sum/mean/max allreduces, each waited one "step" later
        # (as the loop's stop flag), interleaved with gradient averages, rank-skewed
        # in time so that both mailbox sets are reused while a peer is behind.
        gen = torch.Generator().manual_seed(100 + rank)
        sent, got, pending = [], [], None
        for step in range(300):
            op = ("sum", "mean", "max")[step % 3]
            value = torch.randn(1 + step % 8, generator=gen)
            if pending is not None:
                got.append(pending())
            pending = exchange.allreduce_small_async(value, op)
            sent.append((op, value))
            exchange.average_(torch.randn(100, generator=gen))
            if step % 50 == rank:
                time.sleep(0.01)
        got.append(pending())
        everyone = allgather(sent)
        errors = []
        for i, (op, _) in enumerate(sent):
            values = torch.stack([theirs[i][1].double() for theirs in everyone])
            expected = values.amax(0) if op == "max" else values.sum(0) / (world_size if op == "mean" else 1)
            errors.append(float((got[i].double() - expected).abs().max()))
        same = all(all(torch.equal(a, b) for a, b in zip(got, other)) for other in allgather(got))
        report(json.dumps({"max_error": max(errors), "identical_on_all_ranks": same, "count": len(got),
                           "dtypes": sorted({str(g.dtype) for g in got})}))
        os._exit(0)
    if rank == 1:
        if scenario in ("exit", "small-exit"):
            os._exit(3)
        time.sleep(30)  # "stall": alive, never arrives
        os._exit(0)
    started = time.monotonic()
    try:
        if scenario.startswith("small"):
            exchange.allreduce_small_async(torch.ones(1), "max")()
        else:
            exchange.average_(torch.ones(1000))
        report("no error")
        os._exit(0)
    except PeerGone as exc:
        report(json.dumps({"error": str(exc), "seconds": time.monotonic() - started}))
        os._exit(1)


def main():
    scenario = sys.argv[1]
    world_size = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=rank_main, args=(r, world_size, tmp, scenario)) for r in range(world_size)]
        for p in procs:
            p.start()
        expected = range(world_size) if scenario in ("average", "small") else [0]
        deadline = time.monotonic() + 60
        while not all(os.path.exists(os.path.join(tmp, f"rank{r}.txt")) for r in expected):
            if time.monotonic() > deadline:
                raise SystemExit(f"no answer from ranks {list(expected)} within 60 s")
            time.sleep(0.05)
        out = {}
        for r in expected:
            with open(os.path.join(tmp, f"rank{r}.txt")) as f:
                out[r] = f.read()
        procs[0].join(10)
        for p in procs:
            p.kill()
            p.join()
        print(json.dumps({"results": out, "exitcodes": [p.exitcode for p in procs], "pids": [p.pid for p in procs]}))

if __name__ == "__main__":
    main()
