"""Horovod (its Gloo or MPI controller), started by horovodrun or mpirun.

Gradients are averaged by ``hvd.DistributedOptimizer``, whose hooks start an
allreduce per gradient during backward; ``step()`` waits for them.
"""
from __future__ import annotations

import os
from typing import Any, List, Tuple

import torch

from ..errors import UserError
from .base import REDUCE_OPS, Backend


def import_horovod():
    """``horovod.torch``, or a UserError that says how to get a working build."""
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        raise UserError(
            f"Horovod with PyTorch support is not available (import horovod.torch failed: {exc}); "
            f"run scripts/setup.sh, or rebuild with HOROVOD_WITH_PYTORCH=1 pip install --no-build-isolation horovod"
        ) from None
    return hvd


class HorovodBackend(Backend):
    name = "horovod"

    def check_launch(self) -> None:
        if self.env.launcher in ("torchrun", "spawn"):
            # Horovod ignores torchrun's variables: each process would see size 1
            # and silently train its own model.
            raise UserError(
                f"--backend horovod cannot run under {self.env.launcher}: Horovod would see size 1 in each of the "
                f"{self.env.world_size} processes; launch with horovodrun -np {self.env.world_size} (or mpirun), "
                f"or use --backend torch under torchrun"
            )

    def init(self) -> None:
        # A rank that dies must not leave the others waiting forever: Horovod's
        # stall check only warns by default, so make it shut the job down.
        os.environ.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS", str(max(1, int(self.timeout // 2))))
        os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", str(int(self.timeout)))
        os.environ.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", str(int(self.timeout)))
        self.hvd = import_horovod()
        self.hvd.init()
        self.check_world_size(self.hvd.size(), "Horovod")

    def shutdown(self, clean: bool = True) -> None:
        if getattr(self, "hvd", None) is not None and self.hvd.is_initialized():
            self.hvd.shutdown()

    def wrap(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Tuple[torch.nn.Module, torch.optim.Optimizer]:
        hvd = self.hvd
        # Horovod: start every rank from rank 0's weights (and buffers).
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        # Horovod: average gradients across ranks; hooks overlap with backward.
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), op=hvd.Average)
        # Horovod: make optimizer state (e.g. after a resume) identical on all
        # ranks. A fresh optimizer is skipped on purpose: Horovod initialises empty
        # state with a zero-gradient step(), which advances Adam's step count and
        # applies weight decay, so runs would drift from DDP and from one process.
        if optimizer.state_dict()["state"]:
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        return model, optimizer

    def allreduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        assert op in REDUCE_OPS, op
        hvd_op = {"sum": self.hvd.Sum, "mean": self.hvd.Average, "max": self.hvd.Max}[op]
        return self.hvd.allreduce(tensor.detach(), op=hvd_op)

    def allgather_object(self, obj: Any) -> List[Any]:
        return self.hvd.allgather_object(obj)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self.hvd.broadcast_object(obj, root_rank=src)

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> None:
        self.hvd.broadcast_(tensor, root_rank=src)

    def barrier(self) -> None:
        self.hvd.barrier()

    # Horovod's own view of the layout is authoritative once it has started.
    @property
    def rank(self) -> int:
        return self.hvd.rank() if getattr(self, "hvd", None) else self.env.rank

    @property
    def local_rank(self) -> int:
        return self.hvd.local_rank() if getattr(self, "hvd", None) else self.env.local_rank
