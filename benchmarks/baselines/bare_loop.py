"""Bare single-process loop: the fastest plain PyTorch loop, no distribution, no trainbridge.

The workload's data held in memory, batches gathered by index from one shuffled
permutation per epoch, no DataLoader, no per-step host sync (image-folder
workloads: a DataLoader with as many workers as trainbridge starts). Only the model,
data and optimizer come from the bench's workload entry, and the step timer is
the bench's.

    python benchmarks/baselines/bare_loop.py --workload mnist-convnet --threads 2 --steps 160 --output-dir runs/bare
"""
import torch
import torch.nn.functional as F

from torch.utils.data import DataLoader

from trainbridge.bench.configs import baseline_parser
from trainbridge.bench.measure import StepTimer, rank_performance, write_final
from trainbridge.bench.workloads import WORKLOADS, in_memory
from trainbridge.data.imagefolder import auto_workers


def main():
    args = baseline_parser("bare single-process loop").parse_args()
    workload = WORKLOADS[args.workload]
    torch.set_num_threads(args.threads)
    if workload.in_memory:
        images, labels = in_memory(workload.dataset())
        batches = lambda order: ((images.index_select(0, b), labels.index_select(0, b))  # noqa: E731
                                 for b in order.split(workload.batch_size))
    else:  # decoded and augmented per sample: a DataLoader with trainbridge's worker count
        loader = DataLoader(workload.dataset(), batch_size=workload.batch_size, shuffle=True,
                            num_workers=auto_workers(1), persistent_workers=True)
        batches = lambda order: loader  # noqa: E731

    torch.manual_seed(args.seed)
    model = workload.model()
    optimizer = workload.optimizer(model.parameters())
    generator = torch.Generator().manual_seed(args.seed)

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

    write_final(args.output_dir, [rank_performance(timer)], baseline="bare_loop", world_size=1, step=step)


if __name__ == "__main__":
    main()
