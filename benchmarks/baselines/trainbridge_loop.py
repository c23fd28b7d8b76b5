"""trainbridge's public API in a loop of one's own: the row to set beside the Accelerate and Fabric peers.

``tb.init``, ``job.prepare``, ``job.train_loader`` (reshuffled every pass, no
``set_epoch``), ``job.eval_loader`` (an unpadded shard: every validation sample
counted once) and ``job.save(..., background=True)`` at each epoch end, written
while training goes on. Only the model, data and optimizer come from the
bench's workload entry, and the step timer is the bench's, so that every row
trains and is timed the same way.

    torchrun --standalone --nproc-per-node 2 benchmarks/baselines/trainbridge_loop.py \
        --workload mnist-convnet --threads 1 --steps 300 --warmup-steps 10 --output-dir runs/tb-loop
"""

import os

import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import StepLR

import trainbridge as tb
from benchmarks.bench.configs import baseline_parser
from benchmarks.bench.measure import StepTimer, rank_performance, write_final
from benchmarks.bench.workloads import WORKLOADS


@torch.no_grad()
def evaluate(job, model, dataset, batch_size, workers):
    """Accuracy and the number of samples counted, over all ranks."""
    model.eval()
    counts = torch.zeros(2, device=job.device)  # correct, counted
    for data, target in job.eval_loader(dataset, batch_size, num_workers=workers):
        counts += torch.stack(
            [(model(data).argmax(dim=-1) == target).sum(), torch.tensor(len(target), device=job.device)]
        ).float()
    model.train()
    correct, counted = job.allreduce(counts, "sum").tolist()
    return correct / counted, int(counted)


def main():
    args = baseline_parser("trainbridge API loop").parse_args()
    workload = WORKLOADS[args.workload]
    job = tb.init(threads=args.threads)
    workers = workload.workers(int(os.environ.get("LOCAL_WORLD_SIZE", job.world_size)))

    torch.manual_seed(args.seed)
    model = workload.model()
    model, optimizer = job.prepare(model, workload.optimizer(model.parameters()))
    scheduler = StepLR(optimizer, step_size=1, gamma=workload.gamma)
    loader = job.train_loader(workload.dataset(), workload.batch_size, seed=args.seed, num_workers=workers)
    val_set = workload.eval_dataset()
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader}

    timer = StepTimer(args.warmup_steps)
    step = 0
    while step < args.steps:
        for batch_idx, (data, target) in enumerate(loader):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            job.backward(loss)
            job.step(optimizer)
            if batch_idx % args.log_interval == 0:
                job.print(f"Train Epoch: {loader.epoch + 1} [{batch_idx}/{len(loader)}]\tLoss: {loss.item():.6f}")
            step += 1
            timer.tick(len(target))
            if step >= args.steps:
                break
        timer.pause()
        accuracy, val_samples = evaluate(job, model, val_set, workload.batch_size, workers)
        job.print(f"Epoch {loader.epoch}: val accuracy {accuracy:.4f} ({val_samples} samples)")
        job.save(state, os.path.join(args.output_dir, "last.pt"), background=True)
        scheduler.step()

    per_rank = job.allgather_object(rank_performance(timer))
    if job.is_main:
        write_final(
            args.output_dir,
            per_rank,
            baseline="trainbridge_loop",
            world_size=job.world_size,
            step=step,
            val_samples=val_samples,
        )
    job.exit(0)


if __name__ == "__main__":
    main()
