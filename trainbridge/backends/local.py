"""One process, no collective library: the reference every distributed run must match."""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import torch

from ..errors import UserError
from .base import REDUCE_OPS, Backend, GradientExchange


class LocalBackend(Backend):
    name = "local"

    def check_launch(self) -> None:
        if self.env.world_size > 1:
            raise UserError(
                f'backend="local" runs one process, but {self.env.launcher} started {self.env.world_size}: '
                f'each would train its own model; use backend="auto" (or backend="torch" or backend="horovod") '
                f"under a launcher"
            )

    def init(self) -> None:
        pass

    def shutdown(self, clean: bool = True) -> None:
        pass

    def wrap(
        self,
        model: torch.nn.Module,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        exchange: GradientExchange = GradientExchange(),
    ) -> torch.nn.Module:
        # One process: no gradients travel, so there is nothing to compress or defer (sparse ones stay as they are).
        return model

    def shard(
        self,
        model: torch.nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        blocks: Tuple[type, ...],
        exchange: GradientExchange,
        amp_dtype: "torch.dtype | None",
        cpu_offload: bool,
    ) -> torch.nn.Module:
        # One process holds every shard: the model stays as it is (its checkpoints are still sharded ones).
        return model

    def allreduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        assert op in REDUCE_OPS, op
        return tensor.clone()

    def sum_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor  # the only rank's share is the whole sum

    def allgather_object(self, obj: Any) -> List[Any]:
        return [obj]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> None:
        pass

    def barrier(self) -> None:
        pass
