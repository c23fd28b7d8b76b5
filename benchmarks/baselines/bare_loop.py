"""Bare single-process loop: the fastest plain PyTorch loop, no distribution, no trainbridge.

The workload's data held in memory, batches gathered by index from one shuffled
permutation per epoch, no DataLoader, no per-step host sync (image-folder
workloads: a DataLoader with as many workers as trainbridge starts), the same
optimizer kernels as trainbridge. Only the model, data and optimizer come from
the bench's workload entry, and the step timer is the bench's.

    python benchmarks/baselines/bare_loop.py --workload mnist-convnet --threads 2 --steps 160 --output-dir runs/bare

Under torchrun it runs N independent copies, one per rank, that never exchange
gradients: the same work as N-process training without the communication, which is
the most that N processes can reach on this machine (they still share its caches,
memory bandwidth and cores). The process group only gathers their timings at the end.

    torchrun --standalone --nproc-per-node 2 benchmarks/baselines/bare_loop.py --threads 1 --output-dir runs/indep
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

from benchmarks.bench.configs import baseline_parser
from benchmarks.bench.measure import StepTimer, rank_performance, write_final
from benchmarks.bench.workloads import WORKLOADS, in_memory
from trainbridge.data.imagefolder import auto_workers
from trainbridge.launch import detect_launch
from trainbridge.training.optimizers import fused_kernels


def main():
    args = baseline_parser("bare single-process loop").parse_args()
    workload = WORKLOADS[args.workload]
    torch.set_num_threads(args.threads)
    launch = detect_launch()  # one copy per rank under torchrun; plain python: one
    rank = launch.rank
    if workload.in_memory:
        images, labels = in_memory(workload.dataset())

        def batches(order):
            return ((images.index_select(0, b), labels.index_select(0, b)) for b in order.split(workload.batch_size))

    else:  # decoded and augmented per sample: a DataLoader with trainbridge's worker count
        loader = DataLoader(
            workload.dataset(),
            batch_size=workload.batch_size,
            shuffle=True,
            num_workers=auto_workers(launch.local_size),
            persistent_workers=True,
        )
        batches = lambda order: loader  # noqa: E731

    torch.manual_seed(args.seed + rank)
    model = workload.model()
    # The optimizer kernels trainbridge picks (fused where torch has them): the
    # bare loop is the reference for the loop's overhead, not for the optimizer's.
    optimizer = workload.optimizer(model.parameters(), **fused_kernels(workload.optimizer_name, torch.device("cpu")))
    generator = torch.Generator().manual_seed(args.seed + rank)

    timer = StepTimer(args.warmup_steps)
    step = 0
    while step < args.steps:
        order = torch.randperm(len(labels), generator=generator) if workload.in_memory else None
        model.train()
        for data, target in batches(order):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
            step += 1
            timer.tick(len(target))
            if step >= args.steps:
                break
        timer.pause()

    copies = launch.world_size
    per_rank = [rank_performance(timer)]
    if copies > 1:  # only now do the copies talk: rank 0 writes every copy's timings
        dist.init_process_group("gloo")
        per_rank = [None] * copies
        dist.all_gather_object(per_rank, rank_performance(timer))
        dist.destroy_process_group()
    if rank == 0:
        write_final(args.output_dir, per_rank, baseline="bare_loop", world_size=copies, step=step)


if __name__ == "__main__":
    main()
