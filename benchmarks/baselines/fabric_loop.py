"""Lightning Fabric peer, written the way Fabric's documentation recommends.

``Fabric.setup`` on the model and optimizer, ``setup_dataloaders`` (which adds
the DistributedSampler), ``fabric.backward``, validation counts summed with
``fabric.all_reduce`` at each epoch end, and ``fabric.save`` for the checkpoint.
Only the model, data and optimizer come from the bench's workload entry, and
the step timer is the bench's, so that every row trains and is timed the same way.

    torchrun --standalone --nproc-per-node 2 benchmarks/baselines/fabric_loop.py \
        --workload mnist-convnet --threads 1 --steps 300 --warmup-steps 10 --output-dir runs/fabric
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader

from benchmarks.bench.configs import baseline_parser
from benchmarks.bench.measure import StepTimer, leave, rank_performance, write_final
from benchmarks.bench.workloads import WORKLOADS


def evaluate(fabric, model, loader):
    """Accuracy and the number of samples counted, summed over ranks."""
    model.eval()
    counts = torch.zeros(2, device=fabric.device)  # correct, counted
    with torch.no_grad():
        for data, target in loader:
            counts += torch.tensor(
                [(model(data).argmax(dim=-1) == target).sum().item(), len(target)], device=fabric.device
            )
    counts = fabric.all_reduce(counts, reduce_op="sum")
    model.train()
    return (counts[0] / counts[1]).item(), int(counts[1])


def main():
    args = baseline_parser("Lightning Fabric peer").parse_args()
    workload = WORKLOADS[args.workload]
    torch.set_num_threads(args.threads)
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    # Under torchrun Fabric joins the launched processes instead of starting its own.
    fabric = Fabric(
        accelerator="cuda" if torch.cuda.is_available() else "cpu",
        strategy="ddp",
        devices=local_size,
        num_nodes=int(os.environ.get("WORLD_SIZE", 1)) // local_size,
    )
    fabric.launch()
    fabric.seed_everything(args.seed)

    workers = workload.workers(local_size)
    train_loader = DataLoader(workload.dataset(), batch_size=workload.batch_size, shuffle=True, num_workers=workers)
    val_loader = DataLoader(workload.eval_dataset(), batch_size=workload.batch_size, num_workers=workers)
    model = workload.model()
    optimizer = workload.optimizer(model.parameters())
    model, optimizer = fabric.setup(model, optimizer)
    train_loader, val_loader = fabric.setup_dataloaders(train_loader, val_loader)
    scheduler = StepLR(optimizer, step_size=1, gamma=workload.gamma)

    timer = StepTimer(args.warmup_steps)
    step, epoch = 0, 0
    while step < args.steps:
        model.train()
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            fabric.backward(loss)
            optimizer.step()
            if batch_idx % args.log_interval == 0:
                fabric.print(f"Train Epoch: {epoch + 1} [{batch_idx}/{len(train_loader)}]\tLoss: {loss.item():.6f}")
            step += 1
            timer.tick(len(target))
            if step >= args.steps:
                break
        timer.pause()
        accuracy, val_samples = evaluate(fabric, model, val_loader)
        fabric.print(f"Epoch {epoch + 1}: val accuracy {accuracy:.4f} ({val_samples} samples)")
        fabric.save(
            os.path.join(args.output_dir, "checkpoint.ckpt"),
            {"model": model, "optimizer": optimizer, "scheduler": scheduler, "epoch": epoch},
        )
        scheduler.step()
        epoch += 1

    fabric.barrier()
    per_rank = [None] * fabric.world_size
    dist.all_gather_object(per_rank, rank_performance(timer))
    if fabric.is_global_zero:
        write_final(
            args.output_dir,
            per_rank,
            baseline="fabric",
            world_size=fabric.world_size,
            step=step,
            val_samples=val_samples,
        )
    # gloo aborts a process that destroys its group while a peer still uses it: wait for every rank first.
    fabric.barrier()
    dist.destroy_process_group()
    leave()


if __name__ == "__main__":
    main()
