"""Bare single-process loop: the fastest plain PyTorch loop, no distribution, no trainbridge.

The workload's data held in memory, batches gathered by index from one shuffled
permutation per epoch, no DataLoader, no per-step host sync. Only the model,
data and optimizer come from the bench's workload entry, and the step timer is
the bench's.

    python benchmarks/baselines/bare_loop.py --workload mnist-convnet --threads 2 --steps 160 --output-dir runs/bare
"""
import torch
import torch.nn.functional as F

from trainbridge.bench.configs import baseline_parser
from trainbridge.bench.measure import StepTimer, rank_performance, write_final
from trainbridge.bench.workloads import WORKLOADS, in_memory


def main():
    args = baseline_parser("bare single-process loop").parse_args()
    workload = WORKLOADS[args.workload]
    torch.set_num_threads(args.threads)
    images, labels = in_memory(workload.dataset())

    torch.manual_seed(args.seed)
    model = workload.model()
    optimizer = workload.optimizer(model.parameters())
    generator = torch.Generator().manual_seed(args.seed)

    timer = StepTimer(args.warmup_steps)
    step = 0
    while step < args.steps:
        order = torch.randperm(len(labels), generator=generator)
        model.train()
        for start in range(0, len(order), workload.batch_size):
            batch = order[start:start + workload.batch_size]
            data, target = images.index_select(0, batch), labels.index_select(0, batch)
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
