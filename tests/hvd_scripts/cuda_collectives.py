"""trainbridge.hvd's collectives on CUDA tensors, as a Horovod GPU script calls them (one GPU per process).

    torchrun --nproc-per-node N cuda_collectives.py     (N at most the GPUs; also plain python)

One line per check, for tests/test_cuda.py:
    RESULT <rank> PASS <name>     or     RESULT <rank> FAIL <name>: <error>
and ``INFO rank=<r> size=<n> real_horovod=<bool> cuda_built=<bool> nccl_built=<int>``.
Every result must come back on the input's GPU, with its dtype, and hold Horovod's value.
"""
import sys
import traceback

import torch
import torch.nn.functional as F

import trainbridge.hvd as hvd

hvd.init()
torch.cuda.set_device(hvd.local_rank())  # Horovod's GPU recipe: one GPU per local rank
rank, size, device = hvd.rank(), hvd.size(), torch.device("cuda", hvd.local_rank())
print(f"INFO rank={rank} size={size} real_horovod={hvd.using_real_horovod} cuda_built={hvd.cuda_built()} "
      f"nccl_built={hvd.nccl_built()}", flush=True)
failures = 0


def on_gpu(result, like):
    assert result.device == like.device, f"result on {result.device}, input on {like.device}"
    assert result.dtype == like.dtype, f"result {result.dtype}, input {like.dtype}"
    return result


def check_allreduce():
    for dtype in (torch.float32, torch.float16, torch.float64, torch.int32):
        x = torch.full((17, 3), rank + 1, dtype=dtype, device=device)
        total = size * (size + 1) // 2
        assert torch.equal(on_gpu(hvd.allreduce(x, op=hvd.Sum, name=f"sum_{dtype}"), x).cpu(),
                           torch.full((17, 3), total, dtype=dtype))
        if dtype.is_floating_point:
            average = on_gpu(hvd.allreduce(x, op=hvd.Average, name=f"avg_{dtype}"), x)
            assert torch.allclose(average.double().cpu(), torch.full((17, 3), total / size, dtype=torch.float64))
    x = torch.full((5,), float(rank + 1), device=device)
    scaled = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5, name="scaled")
    assert torch.allclose(on_gpu(scaled, x).cpu(), torch.full((5,), float(size * (size + 1) // 2)))
    assert torch.equal(hvd.allreduce(x, op=hvd.Max, name="max").cpu(), torch.full((5,), float(size)))
    assert torch.equal(hvd.allreduce(x, op=hvd.Min, name="min").cpu(), torch.full((5,), 1.0))


def check_in_place_and_async():
    x = torch.full((1000,), float(rank), device=device)
    pointer = x.data_ptr()
    hvd.allreduce_(x, op=hvd.Sum, name="in_place")
    assert x.data_ptr() == pointer and torch.equal(x.cpu(), torch.full((1000,), float(sum(range(size)))))
    handles = [hvd.allreduce_async(torch.full((4,), float(i), device=device), op=hvd.Sum, name=f"async_{i}")
               for i in range(8)]
    for i, handle in enumerate(handles):
        assert torch.equal(on_gpu(hvd.synchronize(handle), x).cpu(), torch.full((4,), float(i * size)))


def check_grouped():
    tensors = [torch.full((i + 1, 2), float(rank + i), device=device) for i in range(4)]
    results = hvd.grouped_allreduce(tensors, op=hvd.Sum, name="grouped")
    for i, (result, tensor) in enumerate(zip(results, tensors)):
        assert torch.equal(on_gpu(result, tensor).cpu(), torch.full((i + 1, 2), float(sum(range(size)) + i * size)))


def check_allgather_broadcast_alltoall_reducescatter():
    x = torch.full((rank + 1, 3), float(rank), device=device)  # a different first dimension per rank
    gathered = on_gpu(hvd.allgather(x, name="gather"), x)
    expected = torch.cat([torch.full((r + 1, 3), float(r)) for r in range(size)])
    assert torch.equal(gathered.cpu(), expected)
    y = torch.full((6,), float(rank), device=device)
    assert torch.equal(on_gpu(hvd.broadcast(y, root_rank=size - 1, name="bcast"), y).cpu(),
                       torch.full((6,), float(size - 1)))
    hvd.broadcast_(y, root_rank=0, name="bcast_")
    assert torch.equal(y.cpu(), torch.zeros(6))
    rows = torch.arange(2 * size, dtype=torch.float32, device=device) + 100 * rank
    received = hvd.alltoall(rows, name="alltoall")
    received = received[0] if isinstance(received, tuple) else received
    expected = torch.cat([torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) + 100 * r for r in range(size)])
    assert torch.equal(on_gpu(received, rows).cpu(), expected)
    z = torch.full((2 * size, 2), float(rank + 1), device=device)
    scattered = on_gpu(hvd.reducescatter(z, op=hvd.Sum, name="reducescatter"), z)
    assert torch.equal(scattered.cpu(), torch.full((2, 2), float(size * (size + 1) // 2)))


def check_distributed_optimizer():
    """Horovod's GPU training recipe, with fp16 compression of the gradients, against a hand-computed step."""
    torch.manual_seed(rank)  # different weights per rank until broadcast_parameters
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * size, momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    reference = [p.detach().clone() for p in model.parameters()]
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=hvd.Compression.fp16)
    inputs = torch.randn(4, 8, device=device, generator=torch.Generator(device).manual_seed(rank))
    loss = F.cross_entropy(model(inputs), torch.tensor([0, 1, 0, 1], device=device))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    for index, (parameter, before) in enumerate(zip(model.parameters(), reference)):
        assert parameter.device == device and not torch.equal(parameter, before)
        # Every rank leaves the step with the same weights: the averaged gradient was applied everywhere.
        assert torch.equal(hvd.broadcast(parameter.detach(), root_rank=0, name=f"same_{index}"), parameter)


def check_sync_batch_norm():
    norm = hvd.SyncBatchNorm(3).to(device)
    x = (torch.arange(4 * 3 * 5, dtype=torch.float32, device=device).reshape(4, 3, 5) + 10 * rank) / 7
    out = norm(x)
    everything = hvd.allgather(x, name="bn_inputs")
    expected = F.batch_norm(everything, None, None, training=True, eps=norm.eps)[rank * 4:(rank + 1) * 4]
    assert on_gpu(out, x).shape == x.shape and torch.allclose(out, expected, atol=1e-5)


for check in (check_allreduce, check_in_place_and_async, check_grouped,
              check_allgather_broadcast_alltoall_reducescatter, check_distributed_optimizer, check_sync_batch_norm):
    name = check.__name__[len("check_"):]
    try:
        check()
        torch.cuda.synchronize()
        print(f"RESULT {rank} PASS {name}", flush=True)
    except Exception as error:  # one line per failed check; the rest still run
        failures += 1
        print(f"RESULT {rank} FAIL {name}: {type(error).__name__}: {error}\n{traceback.format_exc()}", flush=True)
hvd.shutdown()
sys.exit(1 if failures else 0)
