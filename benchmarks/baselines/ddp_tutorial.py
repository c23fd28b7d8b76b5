"""Hand-written DDP baseline, written the way the PyTorch DDP and MNIST tutorials do it.

DistributedSampler + DataLoader (per-sample indexing and default collate) over
the workload's dataset, DistributedDataParallel, and ``loss.item()`` logged
every step. At each epoch end it scores the validation set the tutorial way (a
DistributedSampler shard per rank, counts summed with ``all_reduce``: the
sampler pads the last shard, so some samples are counted twice) and rank 0
saves a checkpoint. Only the model, data and optimizer come from the bench's
workload entry, so that trainbridge and this script train the same thing, and
the step timer is the bench's, so that both are timed the same way.

    torchrun --standalone --nproc-per-node 2 benchmarks/baselines/ddp_tutorial.py \
        --workload mnist-convnet --threads 1 --steps 160 --warmup-steps 10 --output-dir runs/ddp
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, DistributedSampler

from benchmarks.bench.configs import baseline_parser
from benchmarks.bench.measure import StepTimer, leave, rank_performance, write_final
from benchmarks.bench.workloads import WORKLOADS


def evaluate(model, loader, device):
    """Accuracy and the number of samples counted, summed over ranks."""
    model.eval()
    counts = torch.zeros(2, device=device)  # correct, counted
    with torch.no_grad():
        for data, target in loader:
            data, target = data.to(device), target.to(device)
            counts += torch.tensor([(model(data).argmax(dim=1) == target).sum().item(), len(target)], device=device)
    dist.all_reduce(counts)
    model.train()
    return (counts[0] / counts[1]).item(), int(counts[1])


def main():
    args = baseline_parser("hand-written DDP baseline").parse_args()
    workload = WORKLOADS[args.workload]
    torch.set_num_threads(args.threads)
    # The tutorial's device choice: one GPU per process over nccl where there are GPUs, else the CPU over gloo.
    use_cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world_size = dist.get_rank(), dist.get_world_size()

    dataset = workload.dataset()
    # DDP: each process reads its own shard of the data.
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    workers = workload.workers(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    train_loader = DataLoader(
        dataset, batch_size=workload.batch_size, sampler=sampler, num_workers=workers, pin_memory=use_cuda
    )
    val_set = workload.eval_dataset()
    val_loader = DataLoader(
        val_set,
        batch_size=workload.batch_size,
        num_workers=workers,
        sampler=DistributedSampler(val_set, num_replicas=world_size, rank=rank, shuffle=False),
        pin_memory=use_cuda,
    )

    torch.manual_seed(args.seed)
    # DDP: broadcasts rank 0's weights, then averages gradients during backward.
    model = DDP(workload.model().to(device), device_ids=[device.index] if use_cuda else None)
    optimizer = workload.optimizer(model.parameters())
    scheduler = StepLR(optimizer, step_size=1, gamma=workload.gamma)

    timer = StepTimer(args.warmup_steps)
    losses = []
    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)  # DDP: a new shuffle each epoch
        model.train()
        for batch_idx, (data, target) in enumerate(train_loader):
            data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
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
        accuracy, val_samples = evaluate(model, val_loader, device)
        if rank == 0:
            print(f"Epoch {epoch + 1}: val accuracy {accuracy:.4f} ({val_samples} samples)")
            # DDP: every rank holds the same weights, so one rank saves them.
            torch.save(
                {
                    "model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "epoch": epoch,
                },
                os.path.join(args.output_dir, "checkpoint.pt"),
            )
        scheduler.step()
        epoch += 1

    per_rank = [None] * world_size
    dist.all_gather_object(per_rank, rank_performance(timer))
    if rank == 0:
        write_final(
            args.output_dir,
            per_rank,
            baseline="ddp_tutorial",
            world_size=world_size,
            step=step,
            val_samples=val_samples,
        )
    dist.barrier()
    dist.destroy_process_group()
    leave()


if __name__ == "__main__":
    main()
