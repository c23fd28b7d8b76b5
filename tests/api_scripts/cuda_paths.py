"""The public API's CUDA paths, as a user's loop takes them (run under torchrun or plain python on a GPU).

    python cuda_paths.py DIR AMP      or      torchrun --nproc-per-node 1 cuda_paths.py DIR AMP

AMP is off, fp16 or bf16 (one job trains in one precision).

Lines for tests/test_cuda.py:
    JOB <repr(job)> pg=<torch.distributed backend or none>
    ALLREDUCE device=<device of the result> value=<sum over ranks of 1.0>
    LOADER pin_memory=<bool> workers=<n> batch_device=<device> labels_device=<device>
    TRAIN amp=<mode> scaler=<bool> scale=<loss scale or none> out_dtype=<dtype> first_loss=<f> last_loss=<f>
          finite=<bool>
    SAVE background=<bool> equal=<bool> file_device=<device of the tensors in the file>
"""
import faulthandler
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

import trainbridge as tb

out, amp = sys.argv[1], sys.argv[2]
faulthandler.dump_traceback_later(60, exit=True)  # a hang prints every thread's stack and ends the run
job = tb.init(timeout=60)
job.print(f"JOB {job!r} pg={dist.get_backend() if dist.is_initialized() else 'none'}")

# A metric kept on the CPU, reduced over nccl: it comes back where it was.
total = job.allreduce(torch.tensor([1.0]), "sum")
job.print(f"ALLREDUCE device={total.device} value={total.item()}")

generator = torch.Generator().manual_seed(0)
inputs = torch.randn(512, 32, generator=generator)
labels = (inputs[:, :4].sum(1) > 0).long() + 2 * (inputs[:, 4:8].sum(1) > 0).long()  # 4 learnable classes
dataset = TensorDataset(inputs, labels)

# Host batches go to the GPU from pinned memory, without blocking the host; workers read ahead.
loader = job.train_loader(dataset, batch_size=64, seed=0, num_workers=2)
x, y = next(iter(loader))
job.print(f"LOADER pin_memory={loader._loader.pin_memory} workers={loader._loader.num_workers} "
          f"batch_device={x.device} labels_device={y.device}")


def model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Dropout(0.1), nn.Linear(256, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


model, optimizer = job.prepare(*model_and_optimizer(), amp=amp)
losses, out_dtype = [], None
for _epoch in range(3):
    for x, y in loader:
        optimizer.zero_grad()
        with job.autocast():
            logits = model(x)
            loss = nn.functional.cross_entropy(logits, y)
        out_dtype = logits.dtype
        job.backward(loss)
        job.clip_grad_norm_(model.parameters(), 1.0)
        job.step(optimizer)
        losses.append(loss.item())
weights_finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
scale = job.scaler.get_scale() if job.scaler is not None else "none"
job.print(f"TRAIN amp={amp} scaler={job.scaler is not None} scale={scale} out_dtype={out_dtype} "
          f"first_loss={losses[0]:.4f} last_loss={sum(losses[-8:]) / 8:.4f} finite={weights_finite}")

# Checkpoints of CUDA state: written from host copies, loaded back onto this rank's GPU.
for background in (False, True):
    path = f"{out}/cuda_{'background' if background else 'sync'}.pt"
    job.save({"model": model, "optimizer": optimizer}, path, background=background)
    job.wait_for_saves()
    restored, restored_optimizer = job.prepare(*model_and_optimizer(), amp=amp)
    job.load(path, into={"model": restored, "optimizer": restored_optimizer})
    equal = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), restored.state_dict().values()))
    on_disk = torch.load(path, weights_only=True)
    file_device = next(iter(on_disk["model"].values())).device
    job.print(f"SAVE background={background} equal={equal} file_device={file_device} "
              f"restored_device={next(restored.parameters()).device}")
job.exit(0)
