"""Hand-written DDP baseline, written the way the PyTorch DDP and MNIST tutorials do it.

DistributedSampler + DataLoader (per-sample indexing and default collate) over
the workload's dataset, DistributedDataParallel, and ``loss.item()`` logged
every step. Only the model, data and optimizer come from the bench's workload
entry, so that trainbridge and this script train the same thing, and the step
timer is the bench's, so that both are timed the same way.

    torchrun --standalone --nproc-per-node 2 benchmarks/baselines/ddp_tutorial.py \
        --workload mnist-convnet --threads 1 --steps 160 --warmup-steps 10 --output-dir runs/ddp
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, DistributedSampler

from trainbridge.cli.bench.configs import baseline_parser
from trainbridge.cli.bench.measure import StepTimer, rank_performance, write_final
from trainbridge.cli.bench.workloads import WORKLOADS


def main():
    args = baseline_parser("hand-written DDP baseline").parse_args()
    workload = WORKLOADS[args.workload]
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world_size = dist.get_rank(), dist.get_world_size()

    dataset = workload.dataset()
    # DDP: each process reads its own shard of the data.
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(dataset, batch_size=workload.batch_size, sampler=sampler)

    torch.manual_seed(args.seed)
    # DDP: broadcasts rank 0's weights, then averages gradients during backward.
    model = DDP(workload.model())
    optimizer = workload.optimizer(model.parameters())
    scheduler = StepLR(optimizer, step_size=1, gamma=0.7)

    timer = StepTimer(args.warmup_steps)
    losses = []
    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)  # DDP: a new shuffle each epoch
        model.train()
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            output = model(data)
            loss = F.cross_entropy(output, target)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if rank == 0 and batch_idx % args.log_interval == 0:
                print(f"Train Epoch: {epoch + 1} [{batch_idx * len(data)}/{len(sampler)}]\tLoss: {losses[-1]:.6f}")
            step += 1
            timer.tick(len(target))
            if step >= args.steps:
                break
        timer.pause()
        scheduler.step()
        epoch += 1

    per_rank = [None] * world_size
    dist.all_gather_object(per_rank, rank_performance(timer))
    if rank == 0:
        write_final(args.output_dir, per_rank, baseline="ddp_tutorial", world_size=world_size, step=step)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
