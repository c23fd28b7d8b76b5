"""Horovod's collective operations (``hvd.allreduce`` ... ``hvd.barrier``) on the engine.

Same names, signatures, defaults and results as ``horovod.torch`` 0.28.1. The
``*_async`` forms return an integer handle for ``poll``/``synchronize``; the
blocking forms are differentiable and use the same gradients as Horovod 0.28.1:

* allreduce: the gradient is the allreduce of the incoming gradient with the same
  op and factors (so a Sum allreduce has gradient ``size``);
* allgather: the averaged gradient, narrowed to this rank's rows;
* broadcast: the averaged gradient on the root, zeros elsewhere;
* alltoall: the gradient sent back with the received splits;
* reducescatter: the allgathered gradient (times ``size`` for Sum).

Every operation takes ``process_set=`` (:mod:`.process_sets`): it then runs among
that set's ranks, ``size`` above meaning the set's size. Inputs are checked on the
calling rank before anything is sent (:func:`_validating`); a rejected input
raises there *and* is announced, so that peers which submitted the same operation
raise the same exception type instead of waiting for this rank.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from .compression import Compression
from .engine import SUPPORTED_DTYPES, Engine
from .errors import ScalarInputError
from .negotiation import Announcement
from .process import runtime
from .process_sets import ProcessSet, global_process_set, set_ranks
from .reduce_ops import Average, Sum, resolve_op, resolve_reducescatter_op

_handles: Dict[int, Any] = {}
_handle_ids = itertools.count(1)
_handles_lock = threading.Lock()
REJECTED = (ValueError, TypeError, NotImplementedError)


def _check(tensor: torch.Tensor) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError(
            f"Tensor type {tensor.type()} is not supported ({tensor.layout} tensors: convert with "
            f".to_dense(), or use hvd.sparse_allreduce_async)"
        )
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"Tensor type {tensor.type()} is not supported.")
    if not tensor.is_contiguous():
        raise ValueError("Tensor is required to be contiguous.")
    return tensor


def _needs_rows(kind: str, tensors: Sequence[torch.Tensor]) -> None:
    if any(isinstance(t, torch.Tensor) and t.dim() == 0 for t in tensors):
        raise ScalarInputError(
            f"{kind.capitalize()} does not support scalar inputs: it splits or concatenates "
            f"along the first dimension (reshape with .view(1))"
        )


class _Target:
    """Where a validated operation goes: this rank's engine, one process set."""

    def __init__(self, engine: Engine, set_id: int, members: Tuple[int, ...]) -> None:
        self.engine, self.set_id, self.members = engine, set_id, members

    def announce(self, kind: str, tensors: Sequence[torch.Tensor], **fields: Any) -> Announcement:
        tensors = [_check(t) for t in tensors]
        return Announcement(
            kind,
            tuple(tuple(t.shape) for t in tensors),
            tuple(str(t.dtype) for t in tensors),
            tensors[0].device.type if tensors else "cpu",
            process_set=self.set_id,
            **fields,
        )


@contextlib.contextmanager
def _validating(kind: str, name: Optional[str], process_set: ProcessSet) -> Iterator[_Target]:
    """Checks of one operation's input; a rejection is announced to the peers, then raised here."""
    engine = runtime().engine
    try:
        set_id, members = set_ranks(process_set, engine.rank)
    except ValueError as exc:
        # Not a member, or not registered: the peers that may wait for this name are in the global set.
        engine.reject(name, kind, 0, exc)
        raise
    try:
        yield _Target(engine, set_id, members)
    except REJECTED as exc:
        engine.reject(name, kind, set_id, exc)
        raise


def _enqueue(
    target: _Target, name: Optional[str], announcement: Announcement, inputs, outputs=None, grouped=False
) -> int:
    return _register(target.engine.submit(name, announcement, list(inputs), outputs, grouped))


def _register(handle: Any) -> int:
    with _handles_lock:
        handle_id = next(_handle_ids)
        _handles[handle_id] = handle
    return handle_id


def poll(handle: int) -> bool:
    """True once the operation behind ``handle`` has finished (``synchronize`` will not block)."""
    with _handles_lock:
        entry = _handles.get(handle)
    if entry is None:
        raise ValueError(f"Handle {handle} was not created or has been cleared.")
    return entry.done()


def synchronize(handle: int) -> Any:
    """Wait for ``handle`` and return its result (a tensor, or a tuple for grouped ops)."""
    with _handles_lock:
        entry = _handles.pop(handle, None)
    return None if entry is None else entry.wait()


def _set_size(process_set: ProcessSet) -> int:
    return len(set_ranks(process_set, runtime().rank)[1])


def _set_rank(process_set: ProcessSet) -> int:
    return set_ranks(process_set, runtime().rank)[1].index(runtime().rank)


# ----- allreduce --------------------------------------------------------------
def _allreduce_async(
    tensors, outputs, grouped, average, name, op, prescale_factor, postscale_factor, process_set
) -> int:
    with _validating("allreduce", name, process_set) as target:
        announcement = target.announce(
            "allreduce",
            tensors,
            op=resolve_op(op, average),
            prescale=float(prescale_factor),
            postscale=float(postscale_factor),
        )
    return _enqueue(target, name, announcement, tensors, outputs() if callable(outputs) else outputs, grouped)


def allreduce_async(
    tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set
) -> int:
    """Start :func:`allreduce` without waiting; returns a handle for :func:`synchronize` or :func:`poll`."""
    return _allreduce_async(
        [tensor],
        lambda: [torch.empty_like(tensor)],
        False,
        average,
        name,
        op,
        prescale_factor,
        postscale_factor,
        process_set,
    )


def allreduce_async_(
    tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set
) -> int:
    """Start an in-place :func:`allreduce_` without waiting; returns a handle for :func:`synchronize`."""
    return _allreduce_async(
        [tensor], [tensor], False, average, name, op, prescale_factor, postscale_factor, process_set
    )


def allreduce_(
    tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set
) -> torch.Tensor:
    """In-place :func:`allreduce`: ``tensor`` is overwritten with the result, which is also returned."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, average, op, name, prescale_factor, postscale_factor, process_set):
        result = synchronize(allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor, process_set))
        ctx.op, ctx.factors, ctx.process_set = resolve_op(op, average), (prescale_factor, postscale_factor), process_set
        return result

    @staticmethod
    def backward(ctx, grad_output):
        grad = allreduce(
            grad_output.contiguous(),
            op=ctx.op,
            prescale_factor=ctx.factors[0],
            postscale_factor=ctx.factors[1],
            process_set=ctx.process_set,
        )
        return grad, None, None, None, None, None, None


def allreduce(
    tensor,
    average=None,
    name=None,
    compression=Compression.none,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
) -> torch.Tensor:
    """Average (default) or Sum/Min/Max/Product of ``tensor`` over the set's ranks; the input is not modified."""
    compressed, ctx = compression.compress(tensor)
    reduced = _Allreduce.apply(compressed, average, op, name, prescale_factor, postscale_factor, process_set)
    return compression.decompress(reduced, ctx)


def grouped_allreduce_async(
    tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set
) -> int:
    """Start :func:`grouped_allreduce` without waiting; returns a handle for :func:`synchronize`."""
    return _allreduce_async(
        list(tensors),
        lambda: [torch.empty_like(t) for t in tensors],
        True,
        average,
        name,
        op,
        prescale_factor,
        postscale_factor,
        process_set,
    )


def grouped_allreduce_async_(
    tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set
) -> int:
    """Start an in-place :func:`grouped_allreduce_` without waiting; returns a handle."""
    return _allreduce_async(
        list(tensors), list(tensors), True, average, name, op, prescale_factor, postscale_factor, process_set
    )


def grouped_allreduce_(
    tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set
):
    """In-place :func:`grouped_allreduce`: every tensor of ``tensors`` is overwritten with its result."""
    return synchronize(
        grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor, process_set)
    )


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, average, op, name, prescale_factor, postscale_factor, process_set, *tensors):
        result = synchronize(
            grouped_allreduce_async(list(tensors), average, name, op, prescale_factor, postscale_factor, process_set)
        )
        ctx.op, ctx.factors, ctx.process_set = resolve_op(op, average), (prescale_factor, postscale_factor), process_set
        return result

    @staticmethod
    def backward(ctx, *grad_outputs):
        grads = grouped_allreduce(
            [g.contiguous() for g in grad_outputs],
            op=ctx.op,
            prescale_factor=ctx.factors[0],
            postscale_factor=ctx.factors[1],
            process_set=ctx.process_set,
        )
        return (None, None, None, None, None, None, *grads)


def grouped_allreduce(
    tensors,
    average=None,
    name=None,
    compression=Compression.none,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
) -> List[torch.Tensor]:
    """``allreduce`` of a list of tensors as one operation (one name, fused)."""
    compressed, ctxs = zip(*[compression.compress(t) for t in tensors]) if tensors else ((), ())
    reduced = _GroupedAllreduce.apply(average, op, name, prescale_factor, postscale_factor, process_set, *compressed)
    return [compression.decompress(t, ctx) for t, ctx in zip(reduced, ctxs)]


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Horovod's sparse allreduce: allgather the indices and the values; returns a callable that
    waits and gives the aggregated sparse tensor (duplicate indices are summed when it is coalesced)."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        with _validating("allgather", f"{name}.indices", process_set):
            raise ValueError(
                f"sparse_allreduce_async needs a sparse COO tensor, got "
                f"{tensor.type() if isinstance(tensor, torch.Tensor) else type(tensor).__name__}"
            )
    # allgather concatenates along dim 0: gather the indices transposed, as Horovod does.
    indices_handle = allgather_async(
        tensor._indices().transpose(0, 1).contiguous(), name=f"{name}.indices", process_set=process_set
    )
    values_handle = allgather_async(tensor._values(), name=f"{name}.values", process_set=process_set)
    set_size = _set_size(process_set)

    def handle():
        values = synchronize(values_handle)
        indices = synchronize(indices_handle)
        values = (values / set_size) if op == Average else values
        if indices.dim() == 0 or values.dim() == 0:
            return tensor.new().resize_as_(tensor)
        return torch.sparse_coo_tensor(indices.transpose(0, 1), values, tensor.size(), check_invariants=False)

    return handle


# ----- allgather --------------------------------------------------------------
def allgather_async(tensor, name=None, process_set=global_process_set) -> int:
    """Start :func:`allgather` without waiting; returns a handle for :func:`synchronize`."""
    with _validating("allgather", name, process_set) as target:
        _needs_rows("allgather", [tensor])
        announcement = target.announce("allgather", [tensor])
    return _enqueue(target, name, announcement, [tensor])


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> int:
    """Start :func:`grouped_allgather` without waiting; returns a handle for :func:`synchronize`."""
    with _validating("allgather", name, process_set) as target:
        _needs_rows("allgather", tensors)
        announcement = target.announce("allgather", tensors)
    return _enqueue(target, name, announcement, tensors, grouped=True)


def _my_rows(grad: torch.Tensor, rows: int, process_set: ProcessSet) -> torch.Tensor:
    """This rank's slice of a gathered gradient: offsets come from every member's row count."""
    counts = allgather(torch.tensor([rows], dtype=torch.int32), process_set=process_set).view(-1)
    offset = int(counts[: _set_rank(process_set)].sum())
    return grad.narrow(0, offset, rows)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.rows, ctx.process_set = (tensor.shape[0] if tensor.dim() else 0), process_set
        return synchronize(allgather_async(tensor, name=name, process_set=process_set))

    @staticmethod
    def backward(ctx, grad_output):
        reduced = allreduce(grad_output.contiguous(), op=Average, process_set=ctx.process_set)
        return _my_rows(reduced, ctx.rows, ctx.process_set), None, None


def allgather(tensor, name=None, process_set=global_process_set) -> torch.Tensor:
    """Concatenation along dim 0 of every member's tensor, in rank order; dim 0 may differ between ranks."""
    return _Allgather.apply(tensor, name, process_set)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.rows, ctx.process_set = [t.shape[0] if t.dim() else 0 for t in tensors], process_set
        return synchronize(grouped_allgather_async(list(tensors), name=name, process_set=process_set))

    @staticmethod
    def backward(ctx, *grad_outputs):
        reduced = grouped_allreduce([g.contiguous() for g in grad_outputs], op=Average, process_set=ctx.process_set)
        return (None, None, *[_my_rows(g, rows, ctx.process_set) for g, rows in zip(reduced, ctx.rows)])


def grouped_allgather(tensors, name=None, process_set=global_process_set) -> List[torch.Tensor]:
    """:func:`allgather` of a list of tensors as one operation (one name); a list of results."""
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


# ----- broadcast --------------------------------------------------------------
def _broadcast_async(tensor, output, root_rank, name, process_set) -> int:
    with _validating("broadcast", name, process_set) as target:
        if not isinstance(root_rank, int) or root_rank not in target.members:
            raise ValueError(
                f"root_rank {root_rank} is not a rank of the process set {list(target.members)} "
                f"(broadcast takes a global rank, as in Horovod)"
            )
        announcement = target.announce("broadcast", [tensor], root=int(root_rank))
    return _enqueue(target, name, announcement, [tensor], [output() if callable(output) else output])


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """Start :func:`broadcast` without waiting; returns a handle for :func:`synchronize`."""
    return _broadcast_async(tensor, lambda: torch.empty_like(tensor), root_rank, name, process_set)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """Start an in-place :func:`broadcast_` without waiting; returns a handle for :func:`synchronize`."""
    return _broadcast_async(tensor, tensor, root_rank, name, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """In-place :func:`broadcast`: ``tensor`` is overwritten with rank ``root_rank``'s, and returned."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name=name, process_set=process_set))

    @staticmethod
    def backward(ctx, grad_output):
        grad = allreduce(grad_output.contiguous(), op=Average, process_set=ctx.process_set)
        if runtime().rank != ctx.root_rank:
            grad = grad * 0
        return grad, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """Rank ``root_rank``'s tensor (a global rank), on every member; the input is not modified."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


# ----- alltoall ---------------------------------------------------------------
def _row_splits(tensor: torch.Tensor, splits, size: int) -> List[int]:
    _needs_rows("alltoall", [tensor])
    if splits is None:
        if tensor.shape[0] % size:
            raise ValueError(
                f"alltoall without splits needs a first dimension divisible by the number of processes "
                f"({tensor.shape[0]} rows, {size} processes)"
            )
        return [tensor.shape[0] // size] * size
    if isinstance(splits, torch.Tensor):
        if splits.dtype != torch.int32:
            raise ValueError(f"alltoall splits must be an int32 tensor, got {splits.dtype}")
        splits = splits.tolist()
    splits = [int(s) for s in splits]
    if len(splits) != size or any(s < 0 for s in splits):
        raise ValueError(f"alltoall splits must hold {size} non-negative row counts, got {splits}")
    if sum(splits) > tensor.shape[0]:
        raise ValueError(
            f"alltoall splits {splits} add up to {sum(splits)} rows, more than the tensor's {tensor.shape[0]}"
        )
    return splits


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> int:
    """Start :func:`alltoall` without waiting; returns a handle for :func:`synchronize`."""
    with _validating("alltoall", name, process_set) as target:
        _check(tensor)
        row_splits = _row_splits(tensor, splits, len(target.members))
        sent = tensor[: sum(row_splits)].contiguous() if sum(row_splits) < tensor.shape[0] else tensor
        announcement = target.announce("alltoall", [sent], splits=tuple(row_splits))
    return _enqueue(target, name, announcement, [sent])


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received_splits = synchronize(alltoall_async(tensor, splits, name=name, process_set=process_set))
        ctx.received_splits, ctx.process_set = received_splits, process_set
        if splits is None:
            return output
        ctx.mark_non_differentiable(received_splits)
        return output, received_splits

    @staticmethod
    def backward(ctx, grad_output, *unused):
        grad, _ = alltoall(grad_output.contiguous(), splits=ctx.received_splits, process_set=ctx.process_set)
        return grad, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Send ``splits[i]`` rows to the set's i-th rank and receive theirs; returns (output, received splits)
    when ``splits`` is given, else the output alone (even splits)."""
    return _Alltoall.apply(tensor, splits, name, process_set)


# ----- reducescatter ----------------------------------------------------------
def _reducescatter_async(tensors, grouped, name, op, process_set, prescale_factor, postscale_factor) -> int:
    with _validating("reducescatter", name, process_set) as target:
        _needs_rows("reducescatter", tensors)
        announcement = target.announce(
            "reducescatter",
            tensors,
            op=resolve_reducescatter_op(op),
            prescale=float(prescale_factor),
            postscale=float(postscale_factor),
        )
    return _enqueue(target, name, announcement, tensors, grouped=grouped)


def reducescatter_async(
    tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0
) -> int:
    """Start :func:`reducescatter` without waiting; returns a handle for :func:`synchronize`."""
    return _reducescatter_async([tensor], False, name, op, process_set, prescale_factor, postscale_factor)


def grouped_reducescatter_async(
    tensors, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0
) -> int:
    """Start :func:`grouped_reducescatter` without waiting; returns a handle for :func:`synchronize`."""
    return _reducescatter_async(list(tensors), True, name, op, process_set, prescale_factor, postscale_factor)


def _reducescatter_grad(grad: torch.Tensor, op: int, factors, process_set: ProcessSet) -> torch.Tensor:
    if op == Sum:
        grad = grad * _set_size(process_set)
    for factor in factors:
        if factor != 1.0:
            grad = grad * factor
    return allgather(grad.contiguous(), process_set=process_set)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor, process_set):
        ctx.op, ctx.factors, ctx.process_set = op, (prescale_factor, postscale_factor), process_set
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor, postscale_factor))

    @staticmethod
    def backward(ctx, grad_output):
        return _reducescatter_grad(grad_output, ctx.op, ctx.factors, ctx.process_set), None, None, None, None, None


def reducescatter(
    tensor,
    name=None,
    compression=Compression.none,
    op=Average,
    process_set=global_process_set,
    prescale_factor=1.0,
    postscale_factor=1.0,
) -> torch.Tensor:
    """Reduce over the members, then split dim 0: member i keeps its rows (the first ``rows % size`` one more)."""
    compressed, ctx = compression.compress(tensor)
    reduced = _Reducescatter.apply(compressed, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(reduced, ctx)


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.op, ctx.factors, ctx.process_set = op, (prescale_factor, postscale_factor), process_set
        return synchronize(
            grouped_reducescatter_async(list(tensors), name, op, process_set, prescale_factor, postscale_factor)
        )

    @staticmethod
    def backward(ctx, *grad_outputs):
        return (
            None,
            None,
            None,
            None,
            None,
            *[_reducescatter_grad(g, ctx.op, ctx.factors, ctx.process_set) for g in grad_outputs],
        )


def grouped_reducescatter(
    tensors,
    name=None,
    compression=Compression.none,
    op=Average,
    process_set=global_process_set,
    prescale_factor=1.0,
    postscale_factor=1.0,
):
    """:func:`reducescatter` of a list of tensors as one operation (one name); a list of results."""
    compressed, ctxs = zip(*[compression.compress(t) for t in tensors]) if tensors else ((), ())
    reduced = _GroupedReducescatter.apply(name, op, prescale_factor, postscale_factor, process_set, *compressed)
    return [compression.decompress(t, ctx) for t, ctx in zip(reduced, ctxs)]


# ----- synchronisation ----------------------------------------------------------
def join(device: int = -1) -> int:
    """Declare that this rank has no more batches; blocks until every rank has joined.

    Meanwhile this rank answers the others' allreduces with zeros (so an Average
    still divides by ``size``). Returns the rank that joined last, the same on all.
    """
    return runtime().engine.join(device).wait()


def barrier(process_set=global_process_set) -> None:
    """Block until every rank of the set has reached a barrier (ranks outside the set take no part)."""
    with _validating("barrier", None, process_set) as target:
        announcement = Announcement("barrier", process_set=target.set_id)
    target.engine.submit(None, announcement, [], None).wait()
