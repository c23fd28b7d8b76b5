"""Reduction ops, error types and the global process set, as ``horovod.torch`` names them.

The op values are Horovod's own integers (Average=0 ... Product=5), so code that
stores or compares them keeps working after the one-line migration.
"""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist

Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5

OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}
# Average is Sum followed by a 1/size post-scale (see engine.py).
TORCH_REDUCE_OPS = {Average: dist.ReduceOp.SUM, Sum: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN,
                    Max: dist.ReduceOp.MAX, Product: dist.ReduceOp.PRODUCT}


class HorovodInternalError(RuntimeError):
    """A collective could not complete: a peer failed, left, or the job shut down."""


class TensorMismatchError(RuntimeError):
    """Ranks submitted the same named operation with different shapes, dtypes, ops or roots."""


def resolve_op(op: Optional[int], average: Optional[bool]) -> int:
    """Horovod's handling of the deprecated ``average=`` argument; ``None`` means Average."""
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        return Average if average else Sum
    op = Average if op is None else op
    if op == Adasum:
        raise NotImplementedError(
            "hvd.Adasum needs the real Horovod: it is only available when the job is started with horovodrun "
            "(trainbridge.hvd then delegates to horovod.torch). Under torchrun, mpirun or plain python use "
            "op=hvd.Average (the default) or hvd.Sum")
    if op not in TORCH_REDUCE_OPS:
        raise ValueError(f"unknown reduction op {op!r}; use hvd.Average, hvd.Sum, hvd.Min, hvd.Max or hvd.Product")
    return op


class ProcessSet:
    """Only the global process set exists here: every rank of the job.

    Horovod's subsets (``add_process_set``) are not supported on the torch
    backend; see "Not supported on the torch backend" in docs/MIGRATING_FROM_HOROVOD.md.
    """

    def __init__(self, ranks=None) -> None:
        self.ranks = ranks
        self.process_set_id = 0

    def size(self) -> int:
        from .process import size
        return size()

    def rank(self) -> int:
        from .process import rank
        return rank()

    def included(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "ProcessSet(global)"


global_process_set = ProcessSet()


def check_process_set(process_set: ProcessSet) -> None:
    if process_set is not global_process_set:
        raise NotImplementedError("process sets other than hvd.global_process_set need the real Horovod "
                                  "(start the job with horovodrun); on the torch backend every op spans all ranks")


def add_process_set(process_set, *args, **kwargs):
    check_process_set(process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set))


def remove_process_set(process_set) -> bool:
    check_process_set(process_set)
    return False
