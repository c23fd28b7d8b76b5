"""What a rank holds with ``job.prepare(..., shard=True)`` against DDP, and what a step costs.

    torchrun --standalone --nproc-per-node 2 benchmarks/sharded_memory.py            # DDP
    torchrun --standalone --nproc-per-node 2 benchmarks/sharded_memory.py --shard    # FSDP2
    (and --nproc-per-node 3)

A transformer-ish stack (``--blocks`` blocks of attention and a 4x MLP, width ``--dim``, float32)
with AdamW, ``--steps`` timed steps after two warm-up steps. Prints one JSON line (rank 0): per
rank, the bytes of parameters, gradients and optimizer state this rank holds after training
(local shards when sharded), its RSS after training and its peak RSS (which includes the whole
model each rank builds before ``prepare``), and the median step time.
"""

import argparse
import json
import resource
import statistics
import time

import psutil
import torch
import torch.nn.functional as F
from torch import nn

import trainbridge as tb


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attention = nn.MultiheadAttention(dim, 8, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


def local_bytes(tensors) -> int:
    """Bytes of the tensors this rank holds (a DTensor's local shard)."""
    total = 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shard", action="store_true")
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--batch", type=int, default=12, help="sequences per step over all ranks")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--malloc-tuning", default="auto", help="auto or off (tb.init's; off returns freed heap memory)")
    args = p.parse_args()
    job = tb.init(malloc_tuning=args.malloc_tuning)
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(args.dim) for _ in range(args.blocks)], nn.Linear(args.dim, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = job.prepare(model, optimizer, shard=args.shard)
    per_rank = args.batch // job.world_size
    x = torch.randn(per_rank, args.tokens, args.dim)
    y = torch.randn(per_rank, args.tokens, 1)
    times = []
    for step in range(args.steps + 2):
        job.barrier()
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=False)  # the gradients stay allocated: they are part of what a rank holds
        job.backward(F.mse_loss(model(x), y))
        job.step(optimizer)
        job.barrier()
        if step >= 2:
            times.append(time.perf_counter() - started)
    params = list(model.parameters())
    held = {
        "parameters_mb": local_bytes(params) / 2**20,
        "gradients_mb": local_bytes(p.grad for p in params) / 2**20,
        "optimizer_state_mb": local_bytes(v for state in optimizer.state.values() for v in state.values()) / 2**20,
        "rss_after_mb": psutil.Process().memory_info().rss / 2**20,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "step_s": statistics.median(times),
    }
    everyone = job.allgather_object(held)
    if job.is_main:
        whole = sum(p.numel() for p in model.parameters()) if not args.shard else None
        print(
            json.dumps(
                {
                    "shard": args.shard,
                    "world_size": job.world_size,
                    "parameters": whole,
                    "per_rank": [{k: round(v, 3) for k, v in r.items()} for r in everyone],
                }
            )
        )
    job.exit(0)


if __name__ == "__main__":
    main()
