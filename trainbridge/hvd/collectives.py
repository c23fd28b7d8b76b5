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
"""
from __future__ import annotations

import itertools
import threading
from typing import Any, Dict, List, Optional, Sequence

import torch

from .compression import Compression
from .engine import SUPPORTED_DTYPES, Handle
from .negotiation import Announcement
from .process import runtime
from .reduce_ops import Average, Sum, check_process_set, global_process_set, resolve_op

_handles: Dict[int, Handle] = {}
_handle_ids = itertools.count(1)
_handles_lock = threading.Lock()


def _check(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.layout != torch.strided:
        raise ValueError(f"{tensor.layout} tensors are not supported; convert with .to_dense()")
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"Tensor type {tensor.type()} is not supported.")
    if not tensor.is_contiguous():
        raise ValueError("Tensor is required to be contiguous.")
    return tensor


def _announcement(kind: str, tensors: Sequence[torch.Tensor], **fields: Any) -> Announcement:
    return Announcement(kind, tuple(tuple(t.shape) for t in tensors), tuple(str(t.dtype) for t in tensors),
                        tensors[0].device.type if tensors else "cpu", **fields)


def _submit(kind: str, name: Optional[str], tensors: Sequence[torch.Tensor], outputs=None, grouped=False,
            **fields: Any) -> int:
    tensors = [_check(t) for t in tensors]
    handle = runtime().engine.submit(name, _announcement(kind, tensors, **fields), tensors, outputs, grouped)
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


# ----- allreduce --------------------------------------------------------------
def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set) -> int:
    check_process_set(process_set)
    op = resolve_op(op, average)
    return _submit("allreduce", name, [tensor], [torch.empty_like(tensor)], op=op,
                   prescale=float(prescale_factor), postscale=float(postscale_factor))


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set) -> int:
    check_process_set(process_set)
    op = resolve_op(op, average)
    return _submit("allreduce", name, [tensor], [tensor], op=op,
                   prescale=float(prescale_factor), postscale=float(postscale_factor))


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set) -> torch.Tensor:
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, name, prescale_factor, postscale_factor):
        ctx.op, ctx.factors = op, (prescale_factor, postscale_factor)
        return synchronize(allreduce_async(tensor, name=name, op=op, prescale_factor=prescale_factor,
                                           postscale_factor=postscale_factor))

    @staticmethod
    def backward(ctx, grad_output):
        grad = allreduce(grad_output.contiguous(), op=ctx.op, prescale_factor=ctx.factors[0],
                         postscale_factor=ctx.factors[1])
        return grad, None, None, None, None


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set) -> torch.Tensor:
    """Average (default) or Sum/Min/Max/Product of ``tensor`` over all ranks; the input is not modified."""
    check_process_set(process_set)
    op = resolve_op(op, average)
    compressed, ctx = compression.compress(tensor)
    reduced = _Allreduce.apply(compressed, op, name, prescale_factor, postscale_factor)
    return compression.decompress(reduced, ctx)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set) -> int:
    check_process_set(process_set)
    op = resolve_op(op, average)
    return _submit("allreduce", name, tensors, [torch.empty_like(t) for t in tensors], grouped=True, op=op,
                   prescale=float(prescale_factor), postscale=float(postscale_factor))


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set) -> int:
    check_process_set(process_set)
    op = resolve_op(op, average)
    return _submit("allreduce", name, tensors, list(tensors), grouped=True, op=op,
                   prescale=float(prescale_factor), postscale=float(postscale_factor))


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set):
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, name, prescale_factor, postscale_factor, *tensors):
        ctx.op, ctx.factors = op, (prescale_factor, postscale_factor)
        return synchronize(grouped_allreduce_async(list(tensors), name=name, op=op, prescale_factor=prescale_factor,
                                                   postscale_factor=postscale_factor))

    @staticmethod
    def backward(ctx, *grad_outputs):
        grads = grouped_allreduce([g.contiguous() for g in grad_outputs], op=ctx.op,
                                  prescale_factor=ctx.factors[0], postscale_factor=ctx.factors[1])
        return (None, None, None, None, *grads)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set) -> List[torch.Tensor]:
    """``allreduce`` of a list of tensors as one operation (one name, fused)."""
    check_process_set(process_set)
    op = resolve_op(op, average)
    compressed, ctxs = zip(*[compression.compress(t) for t in tensors])
    reduced = _GroupedAllreduce.apply(op, name, prescale_factor, postscale_factor, *compressed)
    return [compression.decompress(t, ctx) for t, ctx in zip(reduced, ctxs)]


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    raise NotImplementedError("sparse allreduce is not supported on the torch backend; densify the tensor "
                              "(DistributedOptimizer(sparse_as_dense=True)) or use horovodrun")


# ----- allgather --------------------------------------------------------------
def _check_gatherable(tensors) -> None:
    if any(t.dim() == 0 for t in tensors):
        raise ValueError("allgather needs tensors with at least one dimension (it concatenates along dim 0)")


def allgather_async(tensor, name=None, process_set=global_process_set) -> int:
    check_process_set(process_set)
    _check_gatherable([tensor])
    return _submit("allgather", name, [tensor])


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> int:
    check_process_set(process_set)
    _check_gatherable(tensors)
    return _submit("allgather", name, tensors, grouped=True)


def _my_rows(grad: torch.Tensor, rows: int) -> torch.Tensor:
    """This rank's slice of a gathered gradient: offsets come from every rank's row count."""
    counts = allgather(torch.tensor([rows], dtype=torch.int32)).view(-1)
    offset = int(counts[:runtime().rank].sum())
    return grad.narrow(0, offset, rows)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name):
        ctx.rows = tensor.shape[0]
        return synchronize(allgather_async(tensor, name=name))

    @staticmethod
    def backward(ctx, grad_output):
        return _my_rows(allreduce(grad_output.contiguous(), op=Average), ctx.rows), None


def allgather(tensor, name=None, process_set=global_process_set) -> torch.Tensor:
    """Concatenation along dim 0 of every rank's tensor, in rank order; dim 0 may differ between ranks."""
    check_process_set(process_set)
    return _Allgather.apply(tensor, name)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, *tensors):
        ctx.rows = [t.shape[0] for t in tensors]
        return synchronize(grouped_allgather_async(list(tensors), name=name))

    @staticmethod
    def backward(ctx, *grad_outputs):
        reduced = grouped_allreduce([g.contiguous() for g in grad_outputs], op=Average)
        return (None, *[_my_rows(g, rows) for g, rows in zip(reduced, ctx.rows)])


def grouped_allgather(tensors, name=None, process_set=global_process_set) -> List[torch.Tensor]:
    check_process_set(process_set)
    return list(_GroupedAllgather.apply(name, *tensors))


# ----- broadcast --------------------------------------------------------------
def _check_root(root_rank: int) -> None:
    if not 0 <= root_rank < runtime().size:
        raise ValueError(f"root_rank {root_rank} is out of range for a job of {runtime().size} processes")


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    check_process_set(process_set)
    _check_root(root_rank)
    return _submit("broadcast", name, [tensor], [torch.empty_like(tensor)], root=int(root_rank))


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    check_process_set(process_set)
    _check_root(root_rank)
    return _submit("broadcast", name, [tensor], [tensor], root=int(root_rank))


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name):
        ctx.root_rank = root_rank
        return synchronize(broadcast_async(tensor, root_rank, name=name))

    @staticmethod
    def backward(ctx, grad_output):
        grad = allreduce(grad_output.contiguous(), op=Average)
        if runtime().rank != ctx.root_rank:
            grad = grad * 0
        return grad, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """Rank ``root_rank``'s tensor, on every rank; the input is not modified."""
    check_process_set(process_set)
    return _Broadcast.apply(tensor, root_rank, name)


# ----- alltoall ---------------------------------------------------------------
def _row_splits(tensor: torch.Tensor, splits) -> List[int]:
    size = runtime().size
    if tensor.dim() == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension")
    if splits is None:
        if tensor.shape[0] % size:
            raise ValueError(f"alltoall without splits needs a first dimension divisible by the number of processes "
                             f"({tensor.shape[0]} rows, {size} processes)")
        return [tensor.shape[0] // size] * size
    if isinstance(splits, torch.Tensor):
        if splits.dtype != torch.int32:
            raise ValueError(f"alltoall splits must be an int32 tensor, got {splits.dtype}")
        splits = splits.tolist()
    splits = [int(s) for s in splits]
    if len(splits) != size or any(s < 0 for s in splits):
        raise ValueError(f"alltoall splits must hold {size} non-negative row counts, got {splits}")
    if sum(splits) > tensor.shape[0]:
        raise ValueError(f"alltoall splits {splits} add up to {sum(splits)} rows, more than the tensor's "
                         f"{tensor.shape[0]}")
    return splits


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> int:
    check_process_set(process_set)
    row_splits = _row_splits(tensor, splits)
    sent = tensor[:sum(row_splits)] if sum(row_splits) < tensor.shape[0] else tensor
    return _submit("alltoall", name, [sent.contiguous()], splits=tuple(row_splits))


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name):
        output, received_splits = synchronize(alltoall_async(tensor, splits, name=name))
        ctx.received_splits = received_splits
        if splits is None:
            return output
        ctx.mark_non_differentiable(received_splits)
        return output, received_splits

    @staticmethod
    def backward(ctx, grad_output, *unused):
        grad, _ = alltoall(grad_output.contiguous(), splits=ctx.received_splits)
        return grad, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Send ``splits[r]`` rows to rank r and receive theirs; returns (output, received splits) when
    ``splits`` is given, else the output alone (even splits)."""
    check_process_set(process_set)
    return _Alltoall.apply(tensor, splits, name)


# ----- reducescatter ----------------------------------------------------------
def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0) -> int:
    check_process_set(process_set)
    op = resolve_op(op, None)
    return _submit("reducescatter", name, [tensor], op=op, prescale=float(prescale_factor),
                   postscale=float(postscale_factor))


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0) -> int:
    check_process_set(process_set)
    op = resolve_op(op, None)
    return _submit("reducescatter", name, tensors, grouped=True, op=op, prescale=float(prescale_factor),
                   postscale=float(postscale_factor))


def _reducescatter_grad(grad: torch.Tensor, op: int, factors) -> torch.Tensor:
    if op == Sum:
        grad = grad * runtime().size
    for factor in factors:
        if factor != 1.0:
            grad = grad * factor
    return allgather(grad.contiguous())


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor):
        ctx.op, ctx.factors = op, (prescale_factor, postscale_factor)
        return synchronize(reducescatter_async(tensor, name, op, prescale_factor=prescale_factor,
                                               postscale_factor=postscale_factor))

    @staticmethod
    def backward(ctx, grad_output):
        return _reducescatter_grad(grad_output, ctx.op, ctx.factors), None, None, None, None


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0) -> torch.Tensor:
    """Reduce over ranks, then split dim 0: rank r keeps its rows (the first ``rows % size`` ranks one more)."""
    check_process_set(process_set)
    compressed, ctx = compression.compress(tensor)
    reduced = _Reducescatter.apply(compressed, name, op, prescale_factor, postscale_factor)
    return compression.decompress(reduced, ctx)


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale_factor, postscale_factor, *tensors):
        ctx.op, ctx.factors = op, (prescale_factor, postscale_factor)
        return synchronize(grouped_reducescatter_async(list(tensors), name, op, prescale_factor=prescale_factor,
                                                       postscale_factor=postscale_factor))

    @staticmethod
    def backward(ctx, *grad_outputs):
        return (None, None, None, None, *[_reducescatter_grad(g, ctx.op, ctx.factors) for g in grad_outputs])


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    check_process_set(process_set)
    compressed, ctxs = zip(*[compression.compress(t) for t in tensors])
    reduced = _GroupedReducescatter.apply(name, op, prescale_factor, postscale_factor, *compressed)
    return [compression.decompress(t, ctx) for t, ctx in zip(reduced, ctxs)]


# ----- synchronisation ----------------------------------------------------------
def join(device: int = -1) -> int:
    """Declare that this rank has no more batches; blocks until every rank has joined.

    Meanwhile this rank answers the others' allreduces with zeros (so an Average
    still divides by ``size``). Returns the rank that joined last, the same on all.
    """
    return runtime().engine.join(device).wait()


def barrier(process_set=global_process_set) -> None:
    """Block until every rank has reached a barrier."""
    check_process_set(process_set)
    runtime().engine.submit(None, Announcement("barrier"), [], None).wait()
