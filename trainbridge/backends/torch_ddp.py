"""torch.distributed: DistributedDataParallel over nccl (GPUs) or gloo (CPUs).

Rendezvous: a TCPStore on rank 0's MASTER_ADDR:MASTER_PORT. torchrun and srun
provide the address; under mpirun or horovodrun the launcher package agrees on
one (:func:`trainbridge.launch.rendezvous_address`). Before the process group
starts, every rank publishes the world size it was told, so that ranks that
disagree fail with both numbers instead of waiting forever.
"""

from __future__ import annotations

import copy
import gc
import inspect
from typing import Any, Callable, ContextManager, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional_collectives
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.utils import _sync_module_states
from torch.nn.parallel import DistributedDataParallel

from ..errors import UserError, first_line
from ..launch.rendezvous import join_process_group
from ..runtime.gloo_threads import keep_thread_states
from .base import REDUCE_OPS, Backend, GradientExchange, sparse_gradient_parameters
from .shm_allreduce import MAILBOX_VALUES, ShmAllreduce, chunk_bytes


def bf16_compress_hook_gloo(process_group, bucket):  # no annotations: DDP checks them as objects
    """torch's bf16_compress_hook for gloo, which reduces bfloat16 but which torch's hook refuses (NCCL only)."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(group.size())

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(fut.value()[0])  # back into the fp32 bucket, in place
        return buffer

    return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)


def sparse_uncompressed(hook):
    """``hook`` for dense buckets; a sparse one (a sparse gradient) averaged uncompressed, as DDP does without a hook.

    The compression hooks cannot reduce sparse tensors (gloo adds no sparse fp16), and a sparse
    gradient already sends only the rows a batch used.
    """

    def hook_or_average(process_group, bucket):  # no annotations: DDP checks them as objects
        if bucket.buffer().is_sparse:
            return default_hooks.allreduce_hook(process_group, bucket)
        return hook(process_group, bucket)

    return hook_or_average


def shm_average_hook(shm: ShmAllreduce, bucket):
    """DDP comm hook: average the bucket through shared memory (synchronously) instead of gloo."""
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(shm.average_(bucket.buffer()))
    return done


# --compression: DDP comm hooks, by (compression, process group backend).
# DDP's switch for the per-forward broadcast of rank 0's buffers (see wrap): torch 2.13
# renamed broadcast_buffers to forward_sync_buffers.
NO_FORWARD_BUFFER_SYNC: Dict[str, Any] = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else {"broadcast_buffers": False}
)
_COMPRESS_HOOKS = {
    ("fp16", "nccl"): default_hooks.fp16_compress_hook,
    ("fp16", "gloo"): default_hooks.fp16_compress_hook,
    ("bf16", "nccl"): default_hooks.bf16_compress_hook,
    ("bf16", "gloo"): bf16_compress_hook_gloo,
}
_REDUCE = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "mean": dist.ReduceOp.SUM}


class PreparedDDP(DistributedDataParallel):
    """DDP that still looks like the user's module: its attributes and methods, and its state_dict keys.

    So ``model.init_hidden()`` and ``model.state_dict()`` mean the same under
    torchrun as under python or Horovod, where the prepared model is the module itself.
    """

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules")
            if not modules or "module" not in modules:
                raise
            return getattr(modules["module"], name)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    _waiting: Callable[[str], ContextManager[None]]  # set by TorchBackend.wrap: the job's watchdog

    def __deepcopy__(self, memo: Dict[int, Any]) -> torch.nn.Module:
        # A copy (an EMA model, AveragedModel) is a copy of the module given to prepare, not a second DDP:
        # that would need a process group and reducer of its own, and its gradients are never averaged.
        return copy.deepcopy(self.module, memo)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            # Traced by torch.compile (compiled after prepare): DDP's forward alone, as torch.compile(DDP(...))
            # traces it. The watchdog's clock would break the graph, so this wait is bounded by the process
            # group's timeout alone, which names no call.
            return super().forward(*args, **kwargs)
        # DDP's forward waits for the other ranks once: at the second training step every rank takes
        # rank 0's bucket order. A rank whose peers went to another collective waits here, so it is named.
        try:
            with self._waiting("the prepared model's forward (DDP's bucket sync)"):
                return super().forward(*args, **kwargs)
        except RuntimeError as exc:
            if "Expected to have finished reduction in the prior iteration" not in str(exc):
                raise
            raise UserError(
                f"rank {dist.get_rank()}: the prepared model's previous forward pass never finished a backward pass: "
                f"either it ran on some ranks only or was not trained (a preview, a metric; run those under "
                f"torch.no_grad() or on job.unwrap(model)), or some parameters took no part in the loss (pass "
                f"find_unused_parameters=True to job.prepare)"
            ) from None


class TorchBackend(Backend):
    name = "torch"
    shm_exchange: "ShmAllreduce | None" = None  # set by wrap() when the ranks share one CPU host

    def init(self) -> None:
        if self.dist_backend not in ("auto", "nccl", "gloo"):
            raise UserError(f'dist_backend="{self.dist_backend}" is not supported; use auto, nccl or gloo')
        # nccl only with CUDA (checked in Backend._pick_device); gloo otherwise.
        self.pg_backend = "nccl" if self.device.type == "cuda" and self.dist_backend != "gloo" else "gloo"
        # A TCPStore on rank 0's address; ranks launched with different sizes fail with both numbers.
        join_process_group(self.env, self.pg_backend, self.timeout)
        if self.pg_backend == "gloo":
            keep_thread_states()  # so that forking DataLoader workers cannot deadlock (see there)

    def describe_failure(self, exc: BaseException) -> "str | None":
        text = str(exc)
        # gloo words a lost or silent peer in several ways ("Connection closed by
        # peer", "Timed out waiting ...", "Application timeout caused pair closure").
        peer_markers = (
            "connection closed by peer",
            "connection reset",
            "timed out",
            "timeout",
            "broken pipe",
            "nccl",
            "gloo",
            "pair closure",
        )
        if isinstance(exc, dist.DistError) or (
            isinstance(exc, RuntimeError) and any(m in text.lower() for m in peer_markers)
        ):
            return (
                f"rank {self.rank}: a collective failed ({first_line(exc)}); another rank died, stalled or "
                f"called a different operation (timeout {self.timeout:g}s): compare with the other ranks' lines"
            )
        return None

    def shutdown(self, clean: bool = True) -> None:
        if dist.is_initialized():
            if clean:
                # Leave together: a rank that tears gloo down while a peer still
                # talks to it can abort ("terminate called without an active exception").
                # DDP wrappers no longer used sit in reference cycles; collect them
                # now, while their process group lives, not at interpreter exit.
                gc.collect()
                dist.barrier()
                dist.destroy_process_group()
            # After a failure the group is left to os._exit, which every failed rank reaches next
            # and which closes its connections as quickly: its destructor, run here, could deadlock
            # with a gloo thread (why: exit_process, api/process_end.py).

    def wrap(
        self,
        model: torch.nn.Module,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        exchange: GradientExchange = GradientExchange(),
    ) -> torch.nn.Module:
        # DDP broadcasts rank 0's parameters and buffers at construction, then
        # averages gradients in buckets that overlap the backward pass.
        # gradient_as_bucket_view avoids one gradient copy per step.
        # forward_sync_buffers=False: DDP's default sends rank 0's buffers (BatchNorm
        # running statistics) before every forward, a blocking collective that
        # cost ResNet34 about a fifth of each step here. The weights cannot tell:
        # a training forward normalizes with batch statistics, not the buffers
        # (frozen BatchNorm layers, in eval mode, never change theirs), and rank
        # 0's buffers, the only ones saved, are the same either way. Every rank gets
        # rank 0's buffers before each evaluation (sync_buffers), as with Horovod.
        # A sparse gradient (nn.Embedding(sparse=True)) is a bucket of its own, allreduced sparse by gloo
        # and divided by the world size: it stays sparse.
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        ddp = PreparedDDP(
            model,
            device_ids=device_ids,
            gradient_as_bucket_view=True,
            **NO_FORWARD_BUFFER_SYNC,
            find_unused_parameters=exchange.find_unused_parameters,
        )
        ddp._waiting = exchange.waiting
        shm = self.shm_exchange = self._shared_memory_exchange(model, exchange)
        if exchange.compression != "none":
            # Each bucket is divided by the world size, cast to fp16/bf16, allreduced
            # (half the bytes on the wire) and cast back into the fp32 gradients.
            ddp.register_comm_hook(None, sparse_uncompressed(_COMPRESS_HOOKS[exchange.compression, self.pg_backend]))
        elif shm is not None:
            # Ranks on one CPU host add each other's buckets in shared memory:
            # no loopback TCP, no gloo threads competing with compute.
            ddp.register_comm_hook(shm, shm_average_hook)
        return ddp

    def _shared_memory_exchange(self, model: torch.nn.Module, exchange: GradientExchange) -> "ShmAllreduce | None":
        """The shared-memory gradient exchange of ``shm_allreduce``, or None for gloo/nccl.

        The reasons against it are the same on every rank, so every rank calls the
        collective :meth:`ShmAllreduce.open` or none does.
        """
        mode, compression = exchange.shm_allreduce, exchange.compression
        if mode == "off" or self.world_size == 1:  # one process: nothing to average
            return None
        why = None
        if self.pg_backend != "gloo":
            why = "the gradients are on GPUs (nccl has its own shared-memory transport)"
        elif compression != "none":
            why = f'compression="{compression}" sends gradients through gloo'
        elif sparse_gradient_parameters(model):
            why = "the model has sparse gradients (nn.Embedding or nn.EmbeddingBag with sparse=True)"
        elif self.env.local_size != self.world_size:
            why = f"the ranks are on several hosts ({self.env.local_size} of {self.world_size} on this one)"
        shm = None
        if why is None:
            grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
            shm, why = ShmAllreduce.open(
                self.rank,
                self.world_size,
                chunk_bytes(self.world_size, grad_bytes),
                self.timeout,
                self.broadcast_object,
                self.allgather_object,
            )
        if why is not None and mode == "on":
            raise UserError(
                f'shm_allreduce="on" is not possible: {why}; use shm_allreduce="auto" or shm_allreduce="off"',
                quiet=not self.is_main,
            )
        if why is not None and self.pg_backend == "gloo":
            self.print(f"[trainbridge] gradients are averaged by gloo, not in shared memory: {why}")
        return shm

    def shard(
        self,
        model: torch.nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        blocks: Tuple[type, ...],
        exchange: GradientExchange,
        amp_dtype: "torch.dtype | None",
        cpu_offload: bool,
    ) -> torch.nn.Module:
        from . import fsdp

        if sparse_gradient_parameters(model):
            raise UserError(
                "job.prepare(shard=...): the model has sparse gradients (nn.Embedding or nn.EmbeddingBag with "
                "sparse=True), which sharded parameters cannot take; use sparse=False, or prepare without shard",
                quiet=not self.is_main,
            )
        # As DDP does at construction: every rank starts from rank 0's parameters and buffers.
        world = dist.group.WORLD
        assert world is not None  # init() joined it
        _sync_module_states(model, world, 250 * 1024 * 1024, 0, set())
        dtypes = [p.dtype for p in model.parameters() if p.is_floating_point()]
        compressed = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(exchange.compression)
        # Gradients are averaged in the parameters' dtype (as DDP averages them under autocast), or compressed.
        reduce_dtype = compressed or (dtypes[0] if amp_dtype is not None and dtypes else None)
        sharded = fsdp.shard_model(
            model, optimizers, blocks, self.device, self.world_size, amp_dtype, reduce_dtype, cpu_offload
        )
        fsdp.shard_again_when_training(sharded)
        return sharded

    def no_sync(self, model: torch.nn.Module):
        from .fsdp import gradient_sync_off, is_sharded

        if is_sharded(model) and hasattr(model, "set_requires_gradient_sync"):
            return gradient_sync_off(model)
        return model.no_sync() if isinstance(model, DistributedDataParallel) else super().no_sync(model)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def allreduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        assert op in REDUCE_OPS, op
        # nccl reduces GPU tensors only: a CPU tensor goes through this rank's device and comes back.
        out = tensor.detach().to(self.device, copy=True)
        dist.all_reduce(out, op=_REDUCE[op])
        return (out / self.world_size if op == "mean" else out).to(tensor.device)

    def allreduce_async(self, tensor: torch.Tensor, op: str = "sum", name: str = "") -> Callable[[], torch.Tensor]:
        assert op in REDUCE_OPS, op
        if self.shm_exchange is not None and tensor.numel() <= MAILBOX_VALUES and tensor.device.type == "cpu":
            # The per-step stop flag of ranks on one CPU host: through shared memory,
            # without waking gloo's helper threads on cores that are busy training.
            return self.shm_exchange.allreduce_small_async(tensor, op)
        out = tensor.detach().to(self.device, copy=True)
        work = dist.all_reduce(out, op=_REDUCE[op], async_op=True)

        def wait() -> torch.Tensor:
            work.wait()
            return out / self.world_size if op == "mean" else out

        return wait

    def sum_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        # torch.distributed's functional all_reduce: on gloo and nccl, and torch.compile traces it.
        world = dist.group.WORLD
        assert world is not None  # init() joined it
        summed = functional_collectives.all_reduce(tensor, "sum", world)
        return functional_collectives.wait_tensor(summed)

    def allgather_object(self, obj: Any) -> List[Any]:
        out: List[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> None:
        dist.broadcast(tensor, src=src)

    def barrier(self) -> None:
        dist.barrier()
