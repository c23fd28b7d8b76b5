"""trainbridge.backends.torch_ddp: the torch backend on a one-rank gloo group in this process.

One rank averages over itself, so these tests check what one rank can show: the wrapper
keeps the user's module, the gradient hooks are the ones asked for, the collectives give
their documented shapes and copies, and a failure is worded. Averaging over several ranks
is the launches' (tests/test_parity.py, tests/test_real_programs.py).
"""
import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from one_rank_job import one_rank_env
from torch.nn.parallel import DistributedDataParallel
from torch.optim.swa_utils import AveragedModel

from trainbridge.backends.base import GradientExchange
from trainbridge.backends.torch_ddp import PreparedDDP, TorchBackend
from trainbridge.errors import UserError
from trainbridge.launch import detect_launch


@pytest.fixture(scope="module")
def backend():
    with one_rank_env():
        backend = TorchBackend(detect_launch(), timeout=60.0)
        backend.init()
        try:
            yield backend
        finally:
            backend.shutdown()
    assert not dist.is_initialized()


class Tagged(torch.nn.Module):
    """A user's module with an attribute and a method of its own."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 2)
        self.tag = "mine"

    def init_hidden(self, n):
        return torch.zeros(n, 2)

    def forward(self, x):
        return self.layer(x)


def test_init_joins_a_gloo_group_of_one_on_the_cpu(backend):
    assert dist.is_initialized() and dist.get_backend() == "gloo" and dist.get_world_size() == 1
    assert (backend.pg_backend, backend.device, backend.rank, backend.world_size) == ("gloo", torch.device("cpu"), 0, 1)
    assert backend.env.launcher == "env" and backend.is_main


def test_an_unknown_dist_backend_is_one_line_before_anything_starts():
    with one_rank_env():
        other = TorchBackend(detect_launch(), dist_backend="mpi", timeout=5.0)
        with pytest.raises(UserError, match="mpi.? is not supported; use auto, nccl or gloo"):
            other.init()


@pytest.mark.skipif(torch.cuda.is_available(), reason="nccl is refused only without CUDA")
def test_nccl_without_cuda_is_refused_at_construction():
    with one_rank_env(), pytest.raises(UserError, match="nccl was requested but CUDA is not available"):
        TorchBackend(detect_launch(), dist_backend="nccl", timeout=5.0)


def test_the_wrapped_model_still_looks_like_the_users_module(backend):
    module = Tagged()
    model = backend.wrap(module)
    assert isinstance(model, PreparedDDP)
    assert model.tag == "mine" and model.init_hidden(4).shape == (4, 2)  # attributes and methods forwarded
    assert list(model.state_dict()) == ["layer.weight", "layer.bias"]  # no "module." prefix
    model.load_state_dict({"layer.weight": torch.zeros(2, 3), "layer.bias": torch.ones(2)})
    assert torch.equal(module.layer.bias, torch.ones(2))
    assert backend.unwrap(model) is module and backend.unwrap(module) is module
    assert backend.shm_exchange is None  # one process: nothing to average in shared memory
    assert not hasattr(model, "not_there")  # and a name neither has is still an AttributeError


@pytest.mark.parametrize("make_copy", [copy.deepcopy, lambda m: AveragedModel(m).module])
def test_a_copy_of_the_wrapped_model_is_a_copy_of_the_users_module(backend, make_copy):
    module = Tagged()
    model = backend.wrap(module)
    copied = make_copy(model)  # DDP itself cannot be copied: its process group holds a lock
    assert type(copied) is Tagged and copied.tag == "mine"
    assert all(torch.equal(p, q) and p is not q for p, q in zip(copied.parameters(), module.parameters()))


def test_compiled_after_wrapping_it_breaks_the_graph_only_where_torch_breaks_a_plain_ddp(backend):
    """torch.compile(DDP(m)) breaks the graph in DDP's own forward; the wrapper adds no break of its own."""
    import torch._dynamo

    breaks = {}
    for kind in ("plain", "prepared"):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        module = Tagged()
        ddp = DistributedDataParallel(module) if kind == "plain" else backend.wrap(module)
        compiled = torch.compile(ddp, backend="eager")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            compiled(torch.randn(4, 3)).sum().backward()
        breaks[kind] = dict(torch._dynamo.utils.counters["graph_break"])
        assert not [w for w in seen if "monotonic" in str(w.message)]
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the module inside was compiled
    assert breaks["prepared"] == breaks["plain"]
    torch._dynamo.reset()


def test_gradients_after_backward_and_step_are_those_of_the_plain_model(backend):
    torch.manual_seed(0)
    plain = torch.nn.Linear(3, 2)
    module = copy.deepcopy(plain)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    model = backend.wrap(module, [optimizer])
    reference = torch.optim.SGD(plain.parameters(), lr=0.1)
    for _step in range(3):
        x = torch.randn(8, 3)
        for net, opt in ((model, optimizer), (plain, reference)):
            opt.zero_grad()
            net(x).pow(2).sum().backward()
        assert torch.equal(module.weight.grad, plain.weight.grad)
        backend.step(optimizer)
        backend.step(reference)
    assert torch.equal(module.weight, plain.weight) and torch.equal(module.bias, plain.bias)


def test_no_sync_accumulates_and_the_next_backward_adds_to_it(backend):
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 1)
    plain = copy.deepcopy(module)
    model = backend.wrap(module)
    first, second = torch.randn(4, 3), torch.randn(4, 3)
    with backend.no_sync(model):
        model(first).sum().backward()
    model(second).sum().backward()
    plain(torch.cat([first, second])).sum().backward()
    assert torch.allclose(module.weight.grad, plain.weight.grad, atol=1e-6)


@pytest.mark.parametrize("compression, dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_compression_averages_the_gradients_in_that_dtype(backend, compression, dtype):
    torch.manual_seed(0)
    module = torch.nn.Linear(5, 1)
    plain = copy.deepcopy(module)
    model = backend.wrap(module, (), GradientExchange(compression=compression))
    x = torch.randn(7, 5) * 3
    model(x).sum().backward()
    plain(x).sum().backward()
    assert module.weight.grad.dtype == torch.float32
    assert torch.equal(module.weight.grad, plain.weight.grad.to(dtype).float())  # rounded to the dtype on the way
    assert not torch.equal(module.weight.grad, plain.weight.grad)


class Recommender(torch.nn.Module):
    """A sparse table (its gradient a sparse tensor) and a dense layer after it."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(6, 3, sparse=True)
        self.out = torch.nn.Linear(3, 1)

    def forward(self, ids):
        return self.out(self.table(ids)).sum()


@pytest.mark.parametrize("compression, dtype", [("none", None), ("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_a_sparse_gradient_stays_sparse_and_travels_uncompressed(backend, compression, dtype):
    torch.manual_seed(0)
    module = Recommender()
    plain = copy.deepcopy(module)
    model = backend.wrap(module, (), GradientExchange(compression=compression))
    ids = torch.tensor([1, 4, 4, 0])
    model(ids).backward()
    plain(ids).backward()
    grad = module.table.weight.grad
    assert grad.is_sparse and torch.equal(grad.to_dense(), plain.table.weight.grad.to_dense())  # not rounded
    expected = plain.out.weight.grad if dtype is None else plain.out.weight.grad.to(dtype).float()
    assert torch.equal(module.out.weight.grad, expected)  # the dense bucket as the compression says
    torch.optim.SparseAdam([module.table.weight]).step()  # which refuses a dense gradient


def test_a_forward_without_a_backward_before_the_next_is_one_line(backend):
    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)

        def forward(self, x):
            return self.used(x)

    model = backend.wrap(TwoHeads())
    model(torch.ones(1, 2)).sum().backward()  # self.unused got no gradient: the reduction never finished
    with pytest.raises(UserError, match="rank 0: the prepared model's previous forward pass never finished a "
                                        "backward pass.*find_unused_parameters=True"):
        model(torch.ones(1, 2))


def test_find_unused_parameters_allows_a_part_of_the_model_to_sit_out(backend):
    model = backend.wrap(torch.nn.ModuleDict({"a": torch.nn.Linear(2, 1), "b": torch.nn.Linear(2, 1)}), (),
                         GradientExchange(find_unused_parameters=True))
    for _ in range(2):
        model.module["a"](torch.ones(1, 2)).sum().backward()  # through the module: DDP sees no forward at all
    assert model.module["b"].weight.grad is None


@pytest.mark.parametrize("op", ["sum", "mean", "max"])
def test_allreduce_of_one_rank_is_a_new_tensor_with_the_value(backend, op):
    tensor = torch.tensor([1.0, -2.0, 3.5])
    out = backend.allreduce(tensor, op)
    assert torch.equal(out, tensor) and out is not tensor and out.data_ptr() != tensor.data_ptr()
    assert torch.equal(backend.allreduce_async(tensor, op, "test")(), tensor)


def test_object_collectives_and_broadcast_in_place(backend):
    assert backend.allgather_object({"rank": 0, "s": "x"}) == [{"rank": 0, "s": "x"}]
    assert backend.broadcast_object([1, "two"]) == [1, "two"]
    tensor = torch.arange(4.0)
    backend.broadcast_(tensor)
    assert torch.equal(tensor, torch.arange(4.0))
    backend.barrier()
    assert backend.decide_on_main(lambda: "decided") == "decided"
    backend.check_same_on_every_rank("a value", {"a": 1}, "no fix needed")


@pytest.mark.parametrize("error, peer", [
    (RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:4444\nmore lines"), True),
    (RuntimeError("Application timeout caused pair closure"), True),
    (dist.DistError("anything"), True),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
    (ValueError("timeout"), False),
])
def test_describe_failure_words_a_peers_failure_and_leaves_bugs_alone(backend, error, peer):
    line = backend.describe_failure(error)
    if not peer:
        assert line is None
        return
    first = str(error).splitlines()[0]
    assert line == (f"rank 0: a collective failed ({first}); another rank died, stalled or called a different "
                    f"operation (timeout 60s): compare with the other ranks' lines")
