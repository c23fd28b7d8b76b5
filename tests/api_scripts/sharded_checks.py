"""Sharded models beyond the same-model program, in one torchrun job: ``torchrun ... sharded_checks.py OUT``.

- bf16: ``shard=True, amp="bf16"`` (parameters gathered and computed in bf16, gradients averaged
  in float32) against DDP with ``amp="bf16"`` (autocast): the weights after 8 steps within BF16_TOLERANCE.
- ``cpu_offload=True`` and ``shard=[Block]`` (the classes named): float64, within 1e-12 of the DDP run.
- ``job.export``: one plain file; loaded into an unsharded model it gives the sharded model's outputs.
- ``job.save`` of a model sharded by the user (``fully_shard`` without ``prepare``): a folder of both
  ranks' shards, which ``job.load`` puts whole into an unsharded model; ``model.state_dict()`` (DTensors)
  given to ``job.save`` is one line, never half the weights.
Writes OUT/checks.pt on rank 0 (the numbers) and OUT/user_sharded (a sharded checkpoint) for the test.
"""
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

import trainbridge as tb

BF16_TOLERANCE = 1e-3  # measured 2.1e-4, as far as DDP bf16 is from float32 (2.1e-4): bf16 rounds in other places


class Block(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def build(dtype):
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(8, 16), *[Block() for _ in range(3)], nn.Linear(16, 1)).to(dtype)


def train(job, dtype, sgd=False, autocast=True, **prepare_options):
    model = build(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05) if sgd else torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = job.prepare(model, optimizer, **prepare_options)
    g = torch.Generator().manual_seed(6)
    x, y = torch.randn(8, 24, 8, generator=g, dtype=dtype), torch.randn(8, 24, 1, generator=g, dtype=dtype)
    per_rank = 24 // job.world_size
    for step in range(8):
        mine = slice(job.rank * per_rank, (job.rank + 1) * per_rank)
        optimizer.zero_grad()
        with job.autocast() if autocast else torch.autocast("cpu", enabled=False):
            loss = F.mse_loss(model(x[step, mine]), y[step, mine])
        job.backward(loss)
        job.clip_grad_norm_(model, 1.0)
        job.step(optimizer)
    return model, {k: v.float().cpu() for k, v in job.state_dict(model).items()}


def largest_difference(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def bf16(job, out: str) -> None:
    """One job trains in one precision: the bf16 runs are a job of their own."""
    # SGD: AdamW's normalised steps would turn rounding in near-zero gradients into whole steps. The float32
    # run is DDP prepared with amp="bf16" but trained outside autocast: the scale of bf16's own rounding.
    _, fp32 = train(job, torch.float32, sgd=True, autocast=False, amp="bf16")
    _, ddp_bf16 = train(job, torch.float32, sgd=True, amp="bf16")
    _, sharded_bf16 = train(job, torch.float32, sgd=True, amp="bf16", shard=True)
    numbers = {"bf16": largest_difference(ddp_bf16, sharded_bf16), "ddp_bf16_vs_fp32": largest_difference(
        ddp_bf16, fp32), "sharded_bf16_vs_fp32": largest_difference(sharded_bf16, fp32)}
    job.print(f"sharded checks: {numbers}")
    assert numbers["bf16"] < BF16_TOLERANCE, numbers
    if job.is_main:
        torch.save(numbers, os.path.join(out, "bf16.pt"))
    job.exit(0)


def main(out: str) -> None:
    job = tb.init()
    if "--bf16" in sys.argv:
        bf16(job, out)
    numbers = {}

    _, ddp64 = train(job, torch.float64)
    _, offloaded = train(job, torch.float64, shard=True, cpu_offload=True)
    sharded_model, named = train(job, torch.float64, shard=[Block])
    numbers["cpu_offload"], numbers["named_blocks"] = largest_difference(ddp64, offloaded), largest_difference(
        ddp64, named)
    assert numbers["cpu_offload"] < 1e-12 and numbers["named_blocks"] < 1e-12, numbers
    assert len([m for m in sharded_model.modules() if hasattr(m, "unshard")]) == 4  # 3 blocks and the root

    # job.export: one file the unsharded model loads, with the sharded model's outputs.
    exported = os.path.join(out, "exported.pt")
    job.export(sharded_model, exported)
    probe = torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = sharded_model(probe)
    plain = build(torch.float64)
    plain.load_state_dict(torch.load(exported, weights_only=True))
    with torch.no_grad():
        numbers["export"] = (plain(probe) - expected).abs().max().item()
    assert numbers["export"] == 0.0, numbers

    # A model the user sharded without prepare: job.save writes every rank's shards.
    user = build(torch.float64)
    for block in user[1:4]:
        fully_shard(block)
    fully_shard(user)
    whole = job.state_dict(user)
    if job.is_main:
        torch.save(whole, os.path.join(out, "user_whole.pt"))  # what trainbridge export must write
    assert all(v.shape == p.shape for v, p in zip(whole.values(), build(torch.float64).state_dict().values()))
    folder = os.path.join(out, "user_sharded")
    job.save({"model": user, "step": 3}, folder)
    plain = build(torch.float64)
    nn.init.zeros_(plain[0].weight)
    state = {"model": plain, "step": 0}
    job.load(folder, into=state)
    numbers["user_sharded"] = largest_difference(plain.state_dict(), whole)
    assert numbers["user_sharded"] == 0.0 and state["step"] == 3, numbers
    try:
        job.save({"model": user.state_dict()}, os.path.join(out, "half.pt"))
        raise AssertionError("job.save wrote a dict of DTensors")
    except tb.UserError as error:
        numbers["dtensor_dict"] = str(error)
    assert not os.path.exists(os.path.join(out, "half.pt"))
    if job.is_main:
        torch.save(numbers, os.path.join(out, "checks.pt"))
    job.print(f"sharded checks: {numbers}")
    job.exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
