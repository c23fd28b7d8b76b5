"""Hugging Face Accelerate peer, written the way Accelerate's documentation recommends.

``Accelerator.prepare`` on the model, optimizer and both DataLoaders,
``accelerator.backward``, ``gather_for_metrics`` to score the validation set at
each epoch end, and ``save_state`` for the checkpoint. Only the model, data and
optimizer come from the bench's workload entry, and the step timer is the
bench's, so that every row trains and is timed the same way.

On a machine without a GPU, Accelerate under a bare torchrun comes up
undistributed (every rank trains alone) unless ``ACCELERATE_USE_CPU=1`` is set;
the bench sets it for this row.

    ACCELERATE_USE_CPU=1 torchrun --standalone --nproc-per-node 2 benchmarks/baselines/accelerate_loop.py \
        --workload mnist-convnet --threads 1 --steps 300 --warmup-steps 10 --output-dir runs/accelerate
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader

from benchmarks.bench.configs import baseline_parser
from benchmarks.bench.measure import StepTimer, leave, rank_performance, write_final
from benchmarks.bench.workloads import WORKLOADS


def evaluate(accelerator, model, loader):
    """Accuracy and the number of samples counted, over all ranks."""
    model.eval()
    correct = counted = 0
    for data, target in loader:
        with torch.no_grad():
            predictions = model(data).argmax(dim=-1)
        # Gathers every rank's predictions and drops the samples the last shard repeats.
        predictions, references = accelerator.gather_for_metrics((predictions, target))
        correct += (predictions == references).sum().item()
        counted += references.numel()
    model.train()
    return correct / counted, counted


def main():
    args = baseline_parser("Hugging Face Accelerate peer").parse_args()
    workload = WORKLOADS[args.workload]
    torch.set_num_threads(args.threads)
    accelerator = Accelerator()  # ACCELERATE_USE_CPU=1 on a CPU; torchrun's variables give the ranks
    if accelerator.num_processes != int(os.environ.get("WORLD_SIZE", 1)):
        raise SystemExit(
            f"Accelerate runs {accelerator.num_processes} process(es) under a launcher of "
            f"{os.environ.get('WORLD_SIZE')}: set ACCELERATE_USE_CPU=1 on a machine without a GPU"
        )
    set_seed(args.seed)

    workers = workload.workers(int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    train_loader = DataLoader(workload.dataset(), batch_size=workload.batch_size, shuffle=True, num_workers=workers)
    val_loader = DataLoader(workload.eval_dataset(), batch_size=workload.batch_size, num_workers=workers)
    model = workload.model()
    optimizer = workload.optimizer(model.parameters())
    # The scheduler steps once per epoch here; a prepared scheduler would step once per process.
    scheduler = StepLR(optimizer, step_size=1, gamma=workload.gamma)
    model, optimizer, train_loader, val_loader = accelerator.prepare(model, optimizer, train_loader, val_loader)

    timer = StepTimer(args.warmup_steps)
    step, epoch = 0, 0
    while step < args.steps:
        model.train()
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            accelerator.backward(loss)
            optimizer.step()
            if batch_idx % args.log_interval == 0:
                accelerator.print(
                    f"Train Epoch: {epoch + 1} [{batch_idx}/{len(train_loader)}]\tLoss: {loss.item():.6f}"
                )
            step += 1
            timer.tick(len(target))
            if step >= args.steps:
                break
        timer.pause()
        accuracy, val_samples = evaluate(accelerator, model, val_loader)
        accelerator.print(f"Epoch {epoch + 1}: val accuracy {accuracy:.4f} ({val_samples} samples)")
        accelerator.save_state(os.path.join(args.output_dir, "checkpoint"))
        scheduler.step()
        epoch += 1

    accelerator.wait_for_everyone()
    per_rank = [None] * accelerator.num_processes
    dist.all_gather_object(per_rank, rank_performance(timer))
    if accelerator.is_main_process:
        write_final(
            args.output_dir,
            per_rank,
            baseline="accelerate",
            world_size=accelerator.num_processes,
            step=step,
            val_samples=val_samples,
        )
    # gloo aborts a process that destroys its group while a peer still uses it: wait for every rank first.
    accelerator.wait_for_everyone()
    accelerator.end_training()  # also destroys the process group
    leave()


if __name__ == "__main__":
    main()
