"""What the test modules share: Horovod's test inputs and checks, its even/odd process sets, its models.

Each test runs on every rank; a check that does not apply raises ``NotApplicable`` (the runner
prints an NA line), any other exception fails it.
"""

import inspect

import torch
import torch.nn.functional as F

import trainbridge.hvd as hvd

# The dtypes and dimensions Horovod's tests loop over.
INT_TYPES = [torch.int32, torch.int64]
ALL_TYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float32, torch.float64,
             torch.float16]
REDUCE_TYPES = [torch.int32, torch.int64, torch.float32, torch.float64, torch.float16]
GRAD_TYPES = [torch.float32, torch.float64]
DIMS = [1, 2, 3]


class NotApplicable(Exception):
    """Horovod's own test does not apply here (unittest's skipTest there)."""


# A second hvd.init() of the real Horovod under horovodrun --gloo can connect to a port of the first
# and abort ("connect [127.0.0.1]:N: Connection refused", exit 134): Horovod 0.28.1's rendezvous server
# (runner/http/http_server.py, do_DELETE) clears every scope's list of finished ranks when any scope
# completes, so the one-rank cross_<local rank> scopes can keep the local scope from ever being emptied,
# and the re-init reads a peer's old address. Horovod's own tests re-initialize in fresh processes.
REAL_HOROVOD_REINIT = "the real Horovod's re-init under horovodrun --gloo can read a peer's old address"


def multi_rank_only():
    if hvd.size() == 1:
        raise NotApplicable("needs more than one process")


def fp32(*values):
    return [v.float() if v.dtype == torch.float16 else v for v in values]


def expect_error(fn, *errors):
    try:
        fn()
    except errors:
        return
    raise AssertionError(f"{fn} did not raise {errors}")


def threshold(dtype):
    """Horovod's tolerance: exact up to 3 ranks and for integers, else 1e-4."""
    return 0 if hvd.size() <= 3 or dtype in INT_TYPES else 1e-4


# ----- inputs ----------------------------------------------------------------------------------
def random_tensor(dim, dtype=torch.float32, side=17):
    """Horovod's reduction input: side**dim random integers in [-100, 100), drawn in float32, then cast."""
    return torch.FloatTensor(*([side] * dim)).random_(-100, 100).to(dtype)


def filled(shape, value, dtype):
    """Horovod's gather and broadcast input: a tensor of ``value`` (a rank), made in float32, then cast."""
    return torch.FloatTensor(*shape).fill_(1).mul_(value).to(dtype)


def dtype_differs_by_rank():
    """Horovod's type-error input: int32 on even ranks, float32 on odd ones."""
    return torch.IntTensor(*[17] * 3) if hvd.rank() % 2 == 0 else torch.FloatTensor(*[17] * 3)


def alltoall_input(dim, dtype, size):
    """Horovod's alltoall input for ``size`` receivers: rank + 1 rows for each, row i holding i."""
    tensor = torch.Tensor([i for i in range(size) for _ in range(hvd.rank() + 1)])
    for _ in range(dim - 1):
        tensor = torch.cat((tensor.unsqueeze(1), tensor.unsqueeze(1)), dim=1)
    return tensor.to(dtype)


def reducescatter_input(rows, rank, dtype):
    """A (rows, 4) tensor that differs by rank: 0 ... rows * 4 - 1, plus the rank."""
    return (torch.arange(rows * 4).reshape(rows, 4) + rank).to(dtype)


def reducescatter_reference(rows, members, position, dtype):
    """The sum of ``members``' inputs, and the rows of it that reducescatter gives the ``position``-th member
    (the first rows % len(members) members get one row more)."""
    total = sum(reducescatter_input(rows, r, torch.int64) for r in members).to(dtype)
    counts = [rows // len(members) + (1 if i < rows % len(members) else 0) for i in range(len(members))]
    start = sum(counts[:position])
    return total, slice(start, start + counts[position])


def scale_reference(tensor, factor, dtype):
    """``tensor`` times ``factor`` by Horovod's rules: integers in float64, truncated; float16 (on CPU) in float32."""
    work = torch.float32 if dtype == torch.float16 else torch.float64 if dtype in INT_TYPES else dtype
    return (torch.tensor(factor, dtype=torch.float64).to(work) * tensor.to(work)).to(dtype)


def sum_of_equal_terms(term, count):
    """The sum of ``count`` copies of ``term`` in its own dtype, as a reduction adds them: Horovod's
    ``multiplied * size`` in float32 is the same for 2 ranks, but a float16 sum of 3 rounds where float32 does not."""
    total = term.clone()
    for _ in range(count - 1):
        total = total + term
    return total


# ----- checks ------------------------------------------------------------------------------------
def expect_duplicate_name_error(submit_async):
    """A second operation under the name of one still in flight raises ValueError; then finish the first.

    The ranks take turns: a rank submits its operation and the duplicate while the others have not
    submitted theirs, so the operation cannot finish in between. (An operation finishes once every
    rank has submitted it: with all ranks at once, a rank descheduled before its duplicate, on a busy
    machine, saw the first finish and its duplicate start a new operation no other rank matched, and
    the real Horovod's job hung at the next check.)"""
    if not hvd.using_real_horovod:
        return expect_duplicate_name_queued(submit_async)
    handles = []
    for turn in range(hvd.size()):
        name = f"duplicate_name_{turn}"
        if hvd.rank() == turn:
            handles.append(submit_async(name))
            expect_error(lambda name=name: submit_async(name), ValueError)
        hvd.barrier()  # the other ranks submit theirs only now
        if hvd.rank() != turn:
            handles.append(submit_async(name))
    for handle in handles:
        hvd.synchronize(handle)


def expect_duplicate_name_queued(submit_async):
    """trainbridge's difference: the second operation waits behind the first, as each rank's n-th operation of a name
    goes with the others' n-th; both finish (the same turns as above; the inputs are Horovod's uninitialized tensors,
    so only the results' shapes can be compared)."""
    handles = []
    for turn in range(hvd.size()):
        name = f"duplicate_name_{turn}"
        if hvd.rank() == turn:
            handles.append((submit_async(name), submit_async(name)))
        hvd.barrier()  # the other ranks submit theirs only now
        if hvd.rank() != turn:
            handles.append((submit_async(name), submit_async(name)))
    for first, second in handles:
        assert hvd.synchronize(first).shape == hvd.synchronize(second).shape


# ----- process sets (Horovod's *_process_sets tests; every rank adds the even and the odd set) -----
class EvenOddSets:
    """Horovod's even/odd process sets, added dynamically and removed afterwards."""

    def __enter__(self):
        multi_rank_only()
        rank, size = hvd.rank(), hvd.size()
        self.even_ranks = [r for r in range(size) if r % 2 == 0]
        self.odd_ranks = [r for r in range(size) if r % 2 == 1]
        self.even_set = hvd.add_process_set(self.even_ranks)
        self.odd_set = hvd.add_process_set(self.odd_ranks)
        self.ranks, self.set = ((self.even_ranks, self.even_set) if rank % 2 == 0 else
                                (self.odd_ranks, self.odd_set))
        self.size = len(self.ranks)
        return self

    def __exit__(self, *exc):
        assert hvd.remove_process_set(self.odd_set) and hvd.remove_process_set(self.even_set)
        assert self.even_set.process_set_id is None and not hvd.remove_process_set(self.even_set)


# ----- models and optimizers -----------------------------------------------------------------
# LBFGS cannot be broadcast (Horovod refuses it), SparseAdam needs sparse gradients and Muon
# (new in torch 2.9) accepts only 2-D parameters: each has its own check in broadcast_state.py.
EXCLUDED_OPTIMIZERS = ("LBFGS", "SparseAdam", "Muon")
# Horovod's two option sets for every optimizer (each takes the options its constructor accepts).
OPTIMIZER_OPTIONS = [dict(lr=0.2, momentum=0.9, weight_decay=0.1, centered=True), dict(lr=0.2)]
# Horovod's regression problem: N samples, D_in inputs, H hidden units, D_out outputs.
N, D_IN, H, D_OUT = 64, 100, 10, 10


def optimizer_classes():
    """torch.optim's optimizers, by name, but EXCLUDED_OPTIMIZERS."""
    classes = [(c.__name__, c) for c in torch.optim.Optimizer.__subclasses__()
               if c.__module__.startswith("torch.optim") and c.__name__ not in EXCLUDED_OPTIMIZERS]
    return sorted(classes, key=lambda nc: nc[0])


def new_optimizer(cls, opt_params, model):
    accepted = inspect.signature(cls.__init__).parameters
    return cls(model.parameters(), **{k: v for k, v in opt_params.items() if k in accepted})


def regression_batch():
    return torch.randn(N, D_IN).requires_grad_(), torch.randn(N, D_OUT).requires_grad_()


def regression_model():
    return torch.nn.Sequential(torch.nn.Linear(D_IN, H), torch.nn.ReLU(), torch.nn.Linear(H, D_OUT))


def mse_step(model, optimizer, x, y):
    """One step of Horovod's tests: the summed squared error, backward, step."""
    loss = F.mse_loss(model(x), y, reduction="sum")
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def distributed_sgd(model, lr=0.1, **options):
    """SGD under hvd.DistributedOptimizer, with the model's parameter names."""
    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                    named_parameters=model.named_parameters(), **options)
