"""Hand-written Horovod baseline, written the way Horovod's ``examples/pytorch/pytorch_mnist.py`` does it.

DistributedSampler + DataLoader (per-sample indexing and default collate) over
the workload's dataset, ``hvd.DistributedOptimizer``, and ``loss.item()`` logged
every step. Only the model, data and optimizer come from the bench's workload
entry, and the step timer is the bench's, so that trainbridge and this script
train the same thing and are timed the same way.

    horovodrun -np 2 --gloo python benchmarks/baselines/horovod_tutorial.py \
        --workload mnist-convnet --threads 1 --steps 160 --warmup-steps 10 --output-dir runs/hvd
"""

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, DistributedSampler

from benchmarks.bench.configs import baseline_parser
from benchmarks.bench.measure import StepTimer, rank_performance, write_final
from benchmarks.bench.workloads import WORKLOADS


def main():
    args = baseline_parser("hand-written Horovod baseline").parse_args()
    workload = WORKLOADS[args.workload]
    # Horovod: initialize library.
    hvd.init()
    # Horovod: limit # of CPU threads to be used per worker.
    torch.set_num_threads(args.threads)

    dataset = workload.dataset()
    # Horovod: use DistributedSampler to partition the training data.
    sampler = DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=args.seed)
    train_loader = DataLoader(dataset, batch_size=workload.batch_size, sampler=sampler)

    torch.manual_seed(args.seed)
    model = workload.model()
    optimizer = workload.optimizer(model.parameters())
    # Horovod: broadcast parameters & optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    # Horovod: wrap optimizer with DistributedOptimizer.
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), op=hvd.Average)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.7)

    timer = StepTimer(args.warmup_steps)
    losses = []
    step, epoch = 0, 0
    while step < args.steps:
        # Horovod: set epoch to sampler for shuffling.
        sampler.set_epoch(epoch)
        model.train()
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            output = model(data)
            loss = F.cross_entropy(output, target)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if hvd.rank() == 0 and batch_idx % args.log_interval == 0:
                print(f"Train Epoch: {epoch + 1} [{batch_idx * len(data)}/{len(sampler)}]\tLoss: {losses[-1]:.6f}")
            step += 1
            timer.tick(len(target))
            if step >= args.steps:
                break
        timer.pause()
        scheduler.step()
        epoch += 1

    per_rank = hvd.allgather_object(rank_performance(timer))
    if hvd.rank() == 0:
        write_final(args.output_dir, per_rank, baseline="horovod_tutorial", world_size=hvd.size(), step=step)
    hvd.barrier()
    hvd.shutdown()


if __name__ == "__main__":
    main()
