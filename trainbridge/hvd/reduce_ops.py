"""Reduction ops, as ``horovod.torch`` names them, and the checks of the op an operation is given.

The op values are Horovod's own integers (Average=0 ... Product=5), so code that
stores or compares them keeps working after the one-line migration.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from .errors import UnsupportedOpError

Average = 0
"""Reduction op: the sum over ranks divided by their number (the default of every reduction)."""
Sum = 1
"""Reduction op: the sum over ranks."""
Adasum = 2
"""Reduction op: Horovod's Adasum; only under horovodrun (the real Horovod), else ``NotImplementedError``."""
Min = 3
"""Reduction op: the element-wise minimum over ranks."""
Max = 4
"""Reduction op: the element-wise maximum over ranks."""
Product = 5
"""Reduction op: the element-wise product over ranks."""

OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}
# Average is Sum followed by a 1/size post-scale (see engine.py).
TORCH_REDUCE_OPS = {
    Average: dist.ReduceOp.SUM,
    Sum: dist.ReduceOp.SUM,
    Min: dist.ReduceOp.MIN,
    Max: dist.ReduceOp.MAX,
    Product: dist.ReduceOp.PRODUCT,
}


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
            "op=hvd.Average (the default) or hvd.Sum"
        )
    if op not in TORCH_REDUCE_OPS:
        raise UnsupportedOpError(
            f"Reduction op type not supported: {op!r}; use hvd.Average, hvd.Sum, hvd.Min, hvd.Max or hvd.Product"
        )
    return op


def resolve_reducescatter_op(op: Optional[int]) -> int:
    """Reducescatter's ops, as Horovod 0.28.1 allows them: Average (the default) and Sum."""
    op = Average if op is None else op
    if op not in (Average, Sum):
        raise UnsupportedOpError(f"Reducescatter currently only supports AVERAGE and SUM (got {OP_NAMES.get(op, op)})")
    return op
