"""Horovod (its Gloo or MPI controller), started by horovodrun or mpirun.

Gradients are averaged by Horovod's allreduce, started by a hook per gradient
during backward and finished by the end of the backward pass (DDP's contract,
:mod:`trainbridge.backends.grad_hooks`), so clipping between ``backward`` and
``step`` sees averaged gradients.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, TypeVar

import torch

from ..errors import UserError, first_line
from ..launch import LaunchEnv
from .base import REDUCE_OPS, Backend, GradientExchange
from .grad_hooks import HookedAverage
from .horovod_thread_state import keep_background_thread_state

T = TypeVar("T")

CPU_CYCLE_TIME_MS = 5  # Horovod's default is 1 ms


# What to do about a missing or broken Horovod: Horovod 0.28.1's sdist builds against
# torch >= 2.1 only with its C++ standard raised to 17, which this command does.
HOROVOD_FIX = "trainbridge build-horovod builds and installs one against this torch (about 3 minutes)"


def horovod_problem() -> Optional[str]:
    """Why ``horovod.torch`` cannot train PyTorch models here, or None when it can.

    ``pip install horovod`` without PyTorch's headers at build time installs a Horovod
    whose ``horovod.torch`` imports but has no operations (no ``mpi_built``, no
    ``allreduce``); a build without MPI and Gloo has no controller to start.
    """
    try:
        import horovod.torch as hvd
    except Exception as exc:  # noqa: BLE001 - an ImportError, or a broken extension's own error
        return f"horovod.torch does not import ({first_line(exc)})"
    if not all(hasattr(hvd, name) for name in ("mpi_built", "gloo_built", "allreduce_async_", "init")):
        return "this Horovod was built without its PyTorch operations (horovod.torch has no allreduce)"
    try:
        controllers = hvd.mpi_built() or hvd.gloo_built()
    except Exception as exc:  # noqa: BLE001
        return f"this Horovod's PyTorch extension does not load ({first_line(exc)})"
    return None if controllers else "this Horovod was built with neither the MPI nor the Gloo controller"


def import_horovod():
    """``horovod.torch``, or a UserError that says how to get a working build."""
    problem = horovod_problem()
    if problem is not None:
        raise UserError(f"Horovod cannot run this job: {problem}; {HOROVOD_FIX}")
    import horovod.torch as hvd

    return hvd


# Launchers whose variables Horovod does not read: under them each process would be a job of size 1.
LAUNCHERS_HOROVOD_CANNOT_JOIN = ("torchrun", "spawn", "env")


def refuse_horovod_under(env: LaunchEnv, chosen_by: str, otherwise: str) -> None:
    """UserError when Horovod, chosen by ``chosen_by``, cannot form the job that ``env``'s launcher started.

    Horovod ignores torchrun's (and trainbridge's spawn's, and env://'s) variables, so each
    process would see size 1 and silently train its own model. The line names the launch
    that works and ``otherwise``, the other way out. Used by ``--backend horovod`` and by
    ``TRAINBRIDGE_HVD_BACKEND=horovod`` (:mod:`trainbridge.hvd.delegation`).
    """
    if env.launcher in LAUNCHERS_HOROVOD_CANNOT_JOIN:
        raise UserError(
            f"{chosen_by} cannot run under {env.launcher}: Horovod would see size 1 in each of the "
            f"{env.world_size} processes; launch with horovodrun -np {env.world_size} (or mpirun), "
            f"or {otherwise}"
        )


def horovod_defaults(device_type: str, timeout: float, elastic: bool = False) -> Dict[str, str]:
    """The environment Horovod reads at init, as trainbridge sets it unless the user did."""
    env = {
        # A rank that dies must not leave the others waiting forever: Horovod's
        # stall check only warns by default, so make it shut the job down.
        "HOROVOD_STALL_CHECK_TIME_SECONDS": str(max(1, int(timeout // 2))),
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": str(int(timeout)),
        "HOROVOD_GLOO_TIMEOUT_SECONDS": str(int(timeout)),
    }
    if device_type == "cpu":
        # On CPUs the compute threads own every core (threads per rank = cores /
        # local ranks), so every wake-up of Horovod's helpers preempts training:
        # * Open MPI busy-polls while a rank waits in the controller's negotiation;
        #   yielding while idle gives the core back (read at MPI_Init).
        # * The background thread coordinates the ranks once per cycle, pending
        #   tensors or not (1 ms by default): a network round trip each time. A 5 ms
        #   cycle measured +9 % samples/s with the Gloo controller (MNIST and
        #   DesignSafe, 2 ranks; benchmarks/RESULTS.md); GPUs keep Horovod's default.
        env["OMPI_MCA_mpi_yield_when_idle"] = "1"
        if not elastic:
            # Elastic keeps Horovod's default: with HOROVOD_CYCLE_TIME in the workers'
            # environment (any value, 1 ms included) a replacement worker could not
            # rejoin (gloo "op.preamble.length <= op.nbytes"; tests/test_fault_tolerance.py).
            env["HOROVOD_CYCLE_TIME"] = str(CPU_CYCLE_TIME_MS)
    return env


class HorovodBackend(Backend):
    name = "horovod"

    def check_launch(self) -> None:
        refuse_horovod_under(self.env, 'backend="horovod"', f'use backend="torch" under {self.env.launcher}')

    def init(self) -> None:
        # horovodrun --min-np/--max-np sets HOROVOD_ELASTIC=1: the size may change
        # on the fly, so it is not checked against the launcher's initial count.
        self.elastic = os.environ.get("HOROVOD_ELASTIC") == "1"
        self._averages: Dict[torch.nn.Module, HookedAverage] = {}
        for key, value in horovod_defaults(self.device.type, self.timeout, self.elastic).items():
            os.environ.setdefault(key, value)  # what the user (or horovodrun's flags) set wins
        self.hvd = import_horovod()
        self.hvd.init()
        self.full_size = self.hvd.size()
        if not self.elastic:  # elastic: no collectives outside hvd.elastic.run (see wrap)
            self._check_world_size(self.hvd.size())
            keep_background_thread_state(self.hvd)  # so that forking DataLoader workers cannot deadlock (see there)

    def _check_world_size(self, seen: int) -> None:
        """Fail fast when the collective library and the launcher disagree on the size."""
        if seen != self.env.world_size:
            raise UserError(
                f"world size mismatch: the {self.env.launcher} launcher announced {self.env.world_size} "
                f"processes but Horovod sees {seen}; launch every rank with the same size "
                f"(for Horovod use horovodrun or mpirun, not torchrun)"
            )

    def describe_failure(self, exc: BaseException) -> "str | None":
        from horovod.common.exceptions import HorovodInternalError

        if isinstance(exc, HorovodInternalError) or "Horovod has been shut down" in str(exc):
            return (
                f"rank {self.rank}: Horovod failed ({first_line(exc)}); another rank died, stalled or called "
                f"a different operation (timeout {self.timeout:g}s): compare with the other ranks' lines"
            )
        return None

    def shutdown(self, clean: bool = True) -> None:
        if getattr(self, "hvd", None) is not None and self.hvd.is_initialized():
            self.hvd.shutdown()

    def wrap(
        self,
        model: torch.nn.Module,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        exchange: GradientExchange = GradientExchange(),
    ) -> torch.nn.Module:
        hvd = self.hvd
        if exchange.shm_allreduce == "on":
            raise UserError(
                'shm_allreduce="on" needs backend="torch"; with Horovod, use its MPI controller '
                "(mpirun or horovodrun --mpi), whose Open MPI already averages through shared memory",
                quiet=not self.is_main,
            )
        compression = self._compression(exchange.compression)
        if self.world_size > 1 or self.elastic:
            # Horovod: average each gradient as soon as backward produces it (fused with the
            # others of the same cycle), in the dtype of the compression; the end of the
            # backward pass waits for all of them, as DDP does (see grad_hooks).
            def start_average(tensor: torch.Tensor, name: str) -> Callable[[], torch.Tensor]:
                if tensor.is_sparse:
                    # Horovod: a sparse gradient (nn.Embedding(sparse=True)) is an allgather of every rank's
                    # rows (indices and values), divided by the size: the average, still sparse.
                    return hvd.sparse_allreduce_async(tensor, name=name, op=hvd.Average)
                compressed, ctx = compression.compress(tensor)
                handle = hvd.allreduce_async_(compressed, name=name, op=hvd.Average)
                return lambda: compression.decompress(hvd.synchronize(handle), ctx)

            prefix = f"trainbridge.grad{len(self._averages)}"
            average = HookedAverage(
                model,
                prefix,
                start_average,
                lambda used: hvd.allreduce(used, op=hvd.Max, name=f"{prefix}.used"),
                exchange.find_unused_parameters,
            )
            self._averages[model] = average
        if self.elastic:
            # No collectives outside hvd.elastic.run: a worker that joins later would
            # meet the others in the wrong operation. The elastic state sync sends
            # rank 0's weights and optimizer state to every worker instead.
            return model
        # Horovod: start every rank from rank 0's weights (and buffers).
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        # Horovod: make each optimizer's state (e.g. after a resume) identical on all ranks.
        for optimizer in optimizers:
            if optimizer.state_dict()["state"]:
                hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        return model

    def no_sync(self, model: torch.nn.Module):
        average = self._averages.get(model)
        return average.no_sync() if average is not None else super().no_sync(model)

    def _compression(self, name: str):
        if name == "bf16":
            raise UserError(
                'compression="bf16" is not available with backend="horovod": Horovod 0.28 allreduces '
                'no bfloat16 tensors; use compression="fp16" (Horovod\'s Compression.fp16), or '
                'backend="torch" for bf16',
                quiet=not self.is_main,
            )
        return {"none": self.hvd.Compression.none, "fp16": self.hvd.Compression.fp16}[name]

    def allreduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return self.hvd.allreduce(tensor.detach(), op=self._op(op))

    def sum_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.hvd.allreduce(tensor, op=self.hvd.Sum)

    def _op(self, op: str):
        assert op in REDUCE_OPS, op
        return {"sum": self.hvd.Sum, "mean": self.hvd.Average, "max": self.hvd.Max}[op]

    def allreduce_async(self, tensor: torch.Tensor, op: str = "sum", name: str = "") -> Callable[[], torch.Tensor]:
        # Horovod fuses this with the gradient allreduces of the same cycle. A fixed
        # name per caller lets its response cache skip the negotiation after the
        # first call (unnamed ops get a new name, and a full negotiation, each time).
        handle = self.hvd.allreduce_async(tensor.detach(), op=self._op(op), name=f"trainbridge.async.{name}")
        return lambda: self.hvd.synchronize(handle)

    def run_resilient(self, train_fn: Callable[[], T], state: Any) -> T:
        if not self.elastic:
            return train_fn()
        from .horovod_elastic import ElasticTrainState

        # Horovod elastic: on a worker failure the survivors roll back to the last
        # commit, re-form the ring with the workers that are left (or new ones),
        # receive rank 0's state, and call train_fn again.
        self.elastic_state = ElasticTrainState(self.hvd, state)
        return self.hvd.elastic.run(lambda _: self._attempt(train_fn))(self.elastic_state)

    def _attempt(self, train_fn: Callable[[], T]) -> T:
        """Each try of ``train_fn`` inside ``hvd.elastic.run``: the first, and one after each reset.

        A peer that dies during a backward pass fails the next gradient hook's
        allreduce, so that pass never reaches its end and its averages stay
        pending: forget them (Horovod was re-initialised; their handles died with
        it), as Horovod's own DistributedOptimizer clears its handles when the
        elastic state is restored. Else no later backward pass would wait for its
        averages, and each would send their names again while they are in flight.
        """
        for average in self._averages.values():
            average.abandon()
        return self._at_full_size(train_fn)

    def _at_full_size(self, train_fn: Callable[[], T]) -> T:
        """Train only with as many workers as the job started with.

        After a failure, training on fewer workers would change every later batch,
        and the final weights with it. The survivors wait (up to --timeout) for
        horovodrun to start a replacement; its arrival interrupts the wait and
        the ring re-forms at full size from the last commit.
        """
        deadline = time.monotonic() + self.timeout
        while self.hvd.size() < self.full_size:
            if time.monotonic() > deadline:
                raise UserError(
                    f"Horovod elastic: only {self.hvd.size()} of {self.full_size} workers after "
                    f"{self.timeout:.0f}s; no replacement came (check --host-discovery-script and "
                    f"--blacklist-cooldown-range)"
                )
            self.print(
                f"[trainbridge] elastic: {self.hvd.size()} of {self.full_size} workers; waiting for a replacement"
            )
            self.elastic_state.check_host_updates()  # raises HostsUpdatedInterrupt when one joins
            time.sleep(1.0)
        return train_fn()

    def commit(self, state: Any) -> None:
        if self.elastic:
            self.elastic_state.commit()

    # Horovod matches operations across ranks by name, and its *_object helpers
    # derive the default name from type(obj): a root that sends a tuple while the
    # others pass None would wait forever. Explicit names keep the ranks matched.
    def decide_on_main(self, decide: Callable[[], T]) -> T:
        if self.elastic:  # no collectives outside hvd.elastic.run; rank 0's state wins at the sync
            return decide()
        return super().decide_on_main(decide)

    def check_same_on_every_rank(self, what: str, value: Any, fix: str) -> None:
        if not self.elastic:  # no collectives outside hvd.elastic.run (see wrap)
            super().check_same_on_every_rank(what, value, fix)

    def same_on_every_rank(self, tensor: torch.Tensor) -> bool:
        return self.elastic or super().same_on_every_rank(tensor)  # no collectives outside hvd.elastic.run

    @contextlib.contextmanager
    def main_first(self) -> Iterator[None]:
        if self.elastic:  # no barrier outside hvd.elastic.run (see wrap)
            yield
            return
        with super().main_first():
            yield

    def allgather_object(self, obj: Any) -> List[Any]:
        return self.hvd.allgather_object(obj, name="trainbridge.allgather_object")

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self.hvd.broadcast_object(obj, root_rank=src, name="trainbridge.broadcast_object")

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

    @property
    def world_size(self) -> int:
        return self.hvd.size() if getattr(self, "hvd", None) else self.env.world_size
