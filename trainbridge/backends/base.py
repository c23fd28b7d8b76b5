"""The backend contract: everything the training loop needs from a collective library.

A backend owns init/shutdown, the device, data sharding, gradient allreduce (by
wrapping the model and optimizer), metric collectives and rank-0 I/O. The loop
calls only these methods and never asks which backend it has.

Subclasses implement the abstract collectives; the sharding and I/O helpers are
written once here on top of them.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from typing import Any, Callable, ContextManager, Iterator, List, Sequence, Set, Tuple, TypeVar

import torch

from ..errors import UserError
from ..launch import LaunchEnv

REDUCE_OPS = ("sum", "mean", "max")
COMPRESSIONS = ("none", "fp16", "bf16")  # the dtype gradients travel in
SHM_MODES = ("auto", "on", "off")


def _unbounded(what: str) -> ContextManager[None]:
    return contextlib.nullcontext()


@dataclasses.dataclass(frozen=True)
class GradientExchange:
    """How gradients are averaged; checked once, where it is built (``Job.prepare``).

    ``compression``: the dtype gradients are averaged in (none, fp16, bf16).
    ``shm_allreduce``: auto, on or off: average through shared memory when every
    rank is on this CPU host, where the backend can.
    ``find_unused_parameters``: a backward pass may reach only some of the model's
    parameters (a branch taken on some ranks, a head used every other step).
    """

    compression: str = "none"
    shm_allreduce: str = "auto"
    find_unused_parameters: bool = False
    # Bounds a wait for the other ranks inside the prepared model's forward, named by ``what``: the
    # job's watchdog (``Job.prepare`` gives it). A backend whose forward waits for the ranks uses it.
    waiting: Callable[[str], ContextManager[None]] = _unbounded

    def __post_init__(self) -> None:
        if self.compression not in COMPRESSIONS:
            raise UserError(f"compression {self.compression!r} is not supported; use one of {', '.join(COMPRESSIONS)}")
        if self.shm_allreduce not in SHM_MODES:
            raise UserError(f"shm_allreduce {self.shm_allreduce!r} is not supported; use auto, on or off")


T = TypeVar("T")


def sparse_gradient_parameters(model: torch.nn.Module) -> Set[torch.nn.Parameter]:
    """The parameters whose gradients are sparse tensors: those of ``nn.Embedding`` and ``nn.EmbeddingBag``
    with ``sparse=True``, as DDP finds them (``expect_sparse_gradient``)."""
    sparse = (torch.nn.Embedding, torch.nn.EmbeddingBag)
    return {p for m in model.modules() if isinstance(m, sparse) and m.sparse for p in m.parameters(recurse=False)}


def first_difference(values: List[Any], where: str = "") -> Tuple[str, List[Any]]:
    """The first place where the ranks' ``values`` differ: ``(" at [i]['key']", the values there)``."""
    first = values[0]
    if all(isinstance(v, dict) and v.keys() == first.keys() for v in values):
        key = next(k for k in first if any(repr(v[k]) != repr(first[k]) for v in values))
        return first_difference([v[key] for v in values], f"{where}[{key!r}]")
    if all(isinstance(v, list) and len(v) == len(first) for v in values):  # a tuple (a shape) is one value
        i = next(i for i in range(len(first)) if any(repr(v[i]) != repr(first[i]) for v in values))
        return first_difference([v[i] for v in values], f"{where}[{i}]")
    return (f" at {where}" if where else ""), values


class Backend(abc.ABC):
    """One process's view of the job. Construct, then :meth:`init` before use."""

    name: str = "base"

    def __init__(self, env: LaunchEnv, *, dist_backend: str = "auto", timeout: float = 300.0) -> None:
        self.env = env
        self.dist_backend = dist_backend
        self.timeout = timeout
        self.check_launch()
        self.device = self._pick_device()

    def check_launch(self) -> None:
        """Refuse a launcher this backend cannot run under (same answer on every rank)."""

    # ----- lifecycle --------------------------------------------------------
    @abc.abstractmethod
    def init(self) -> None:
        """Join the job. Raises UserError when the ranks cannot agree."""

    @abc.abstractmethod
    def shutdown(self, clean: bool = True) -> None:
        """Leave the job and release the collective library.

        ``clean=False`` after a failure, just before the process exits: skip anything that waits
        for other ranks, and what that exit does anyway.
        """

    # ----- rank layout ------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def _pick_device(self) -> torch.device:
        # One GPU per local process; the CPU when there is none.
        if torch.cuda.is_available():
            if self.local_rank >= torch.cuda.device_count():
                raise UserError(
                    f"local rank {self.local_rank} has no GPU: this node has {torch.cuda.device_count()} "
                    f"GPU(s) for {self.env.local_size} local processes; start at most one process per GPU"
                )
            torch.cuda.set_device(self.local_rank)
            return torch.device("cuda", self.local_rank)
        if self.dist_backend == "nccl":
            raise UserError(
                'nccl was requested but CUDA is not available; use dist_backend="gloo" (or dist_backend="auto") on CPUs'
            )
        return torch.device("cpu")

    # ----- gradient allreduce -----------------------------------------------
    @abc.abstractmethod
    def wrap(
        self,
        model: torch.nn.Module,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        exchange: GradientExchange = GradientExchange(),
    ) -> torch.nn.Module:
        """Average ``model``'s gradients over all ranks by the end of each backward pass, as ``exchange`` says.

        Every rank leaves with identical parameters and state in each of ``optimizers`` (none, one,
        or several: SparseAdam for the embeddings beside Adam for the rest), which the caller keeps
        using. The returned model has the user's attributes, methods and state_dict keys. A sparse
        gradient (:func:`sparse_gradient_parameters`) is averaged as a sparse tensor, so it stays sparse.
        """

    def shard(
        self,
        model: torch.nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        blocks: Tuple[type, ...],
        exchange: GradientExchange,
        amp_dtype: "torch.dtype | None",
        cpu_offload: bool,
    ) -> torch.nn.Module:
        """Like :meth:`wrap`, but each rank keeps 1/N of the parameters, gradients and optimizer state
        (:mod:`trainbridge.backends.fsdp`): ``blocks`` are the module classes sharded as units (() for the
        model's repeated blocks), ``amp_dtype`` the dtype of the forward and backward passes (None: the
        parameters'), ``cpu_offload`` keeps the shards in host memory between uses."""
        raise UserError(
            f"job.prepare(shard=...): sharded models need the torch backend (FSDP2), not {self.name}; launch with "
            f"torchrun, or pass backend='torch' to tb.init (trainbridge train --backend torch) under horovodrun or "
            f"mpirun",
            quiet=not self.is_main,
        )

    def no_sync(self, model: torch.nn.Module) -> ContextManager[None]:
        """A backward pass inside this block only accumulates gradients locally (no allreduce)."""
        return contextlib.nullcontext()

    def step(self, optimizer: torch.optim.Optimizer, scaler: "torch.amp.GradScaler | None" = None) -> None:
        """Apply the averaged gradients; with a GradScaler, unscale them first and skip steps with inf/NaN.

        Every rank unscales the same averaged gradients, so all skip or step together.
        """
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The user's module, without any wrapper (state_dict keys without "module.")."""
        return model

    # ----- metric collectives -----------------------------------------------
    @abc.abstractmethod
    def allreduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce ``tensor`` over ranks with ``op`` in ("sum", "mean", "max"); returns a new tensor."""

    def allreduce_async(self, tensor: torch.Tensor, op: str = "sum", name: str = "") -> Callable[[], torch.Tensor]:
        """Start an allreduce; the returned function waits for it and gives the result.

        ``name`` identifies the call site; at most one allreduce per name may be in flight.
        """
        result = self.allreduce(tensor, op)
        return lambda: result

    @abc.abstractmethod
    def sum_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the ranks, a new tensor on its device; every rank calls it, in the same order.

        For code inside the model's forward and backward passes (synchronized BatchNorm's statistics,
        :mod:`trainbridge.backends.sync_batchnorm`): no copy to another device, and on the torch backend
        ``torch.compile`` traces it."""

    @abc.abstractmethod
    def allgather_object(self, obj: Any) -> List[Any]:
        """Every rank's ``obj``, in rank order."""

    @abc.abstractmethod
    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Wait until every rank gets here."""

    @abc.abstractmethod
    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Overwrite ``tensor`` in place with rank ``src``'s."""

    def sync_buffers(self, model: torch.nn.Module) -> None:
        """Give every rank rank 0's buffers (e.g. BatchNorm running statistics).

        Each rank updates its buffers from its own batches, so after the last
        training step they differ; evaluation and the saved model must use one set.
        """
        for buffer in model.buffers():
            self.broadcast_(buffer, src=0)

    def same_on_every_rank(self, tensor: torch.Tensor) -> bool:
        """Whether every rank holds the same integer ``tensor``: one small allreduce, the same answer everywhere.

        The maximum of ``[t, -t]`` over the ranks is ``[max t, -min t]``: equal halves mean equal tensors.
        """
        top = self.allreduce(torch.cat([tensor, -tensor]), "max")
        return torch.equal(top[: tensor.numel()], -top[tensor.numel() :])

    def check_same_on_every_rank(self, what: str, value: Any, fix: str) -> None:
        """One line on every rank, naming the ranks and their values, when ``value`` differs between ranks.

        For the cheap things a rank-divergent script gets wrong (an unseeded
        ``random_split``, a per-rank learning rate): checked once, where they are
        given, instead of training on inconsistent data or meeting in different collectives.
        """
        values = self.allgather_object(value)
        if all(repr(v) == repr(values[0]) for v in values):
            return
        where, values = first_difference(values)
        groups: dict = {}
        for rank, shown in enumerate(repr(v)[:100] for v in values):
            groups.setdefault(shown, []).append(rank)
        seen = "; ".join(f"rank{'s' if len(r) > 1 else ''} {','.join(map(str, r))}: {v}" for v, r in groups.items())
        raise UserError(f"{what}: the ranks disagree{where} ({seen}); {fix}", quiet=not self.is_main)

    # ----- surviving failures -----------------------------------------------
    def describe_failure(self, exc: BaseException) -> "str | None":
        """One line when ``exc`` means a peer died or stalled (not a bug here); None otherwise."""
        return None

    def run_resilient(self, train_fn: Callable[[], T], state: Any) -> T:
        """Run ``train_fn``; a backend with in-job recovery (Horovod elastic) re-runs it after a failure.

        ``state`` has ``snapshot()`` and ``restore(snapshot)``; ``train_fn`` must
        continue from ``state`` and read rank and world size afresh on every call.
        """
        return train_fn()

    def commit(self, state: Any) -> None:
        """Mark ``state`` as a point to roll back to (in memory); a no-op without in-job recovery."""

    # ----- rank-0 I/O -------------------------------------------------------
    def print(self, *args: Any, **kwargs: Any) -> None:
        """print() on the main rank only."""
        if self.is_main:
            print(*args, **kwargs, flush=True)

    def decide_on_main(self, decide: Callable[[], T]) -> T:
        """Run ``decide()`` on the main rank and give its result to every rank."""
        return self.broadcast_object(decide() if self.is_main else None)

    @contextlib.contextmanager
    def main_first(self) -> Iterator[None]:
        """Run the block on the main rank first (e.g. a download), then on the others."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, "
            f"local_rank={self.local_rank}, device={self.device}, launcher={self.env.launcher})"
        )
