"""The background thread that runs Horovod-style collectives on torch.distributed.

Contract (the same as Horovod's background loop):

* ``submit`` returns at once with a :class:`Handle`; the operation runs on this
  thread as soon as every rank has submitted the same *name*, overlapping with
  whatever the caller does next (for gradients: the rest of the backward pass).
* Each cycle, ranks exchange their new announcements over a dedicated gloo group
  (see :mod:`.negotiation`); the ready operations then run in the same order on
  every rank. A thread with nothing in flight does not cycle, so an idle job
  costs nothing; the peers' cycle simply waits for it.
* Ready allreduces with the same dtype, device and op are fused into one flat
  buffer (Horovod's tensor fusion, up to HOROVOD_FUSION_THRESHOLD bytes).
* A rank that called ``join`` keeps answering allreduces with zeros until every
  rank has joined.
* ``hvd.shutdown()`` (or process exit) on any rank ends every rank's loop at the
  same cycle; operations still pending fail with HorovodInternalError, so a rank
  that dies or leaves never leaves its peers waiting.
* Only this thread issues collectives on the engine's groups, so its order is
  the same on every rank, whatever threads the caller uses.
* Like Horovod, an operation that some ranks never submit waits forever; after
  HOROVOD_STALL_CHECK_TIME_SECONDS (default 60; HOROVOD_STALL_CHECK_DISABLE=1
  turns it off) each waiting rank prints which ranks are missing.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import sys
import threading
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from ..errors import first_line
from .negotiation import Announcement, Decision, Message, NegotiationTable
from .reduce_ops import Average, HorovodInternalError, TensorMismatchError, TORCH_REDUCE_OPS

# gloo has no int16 kernels (and nccl no bool): such tensors travel widened.
TRANSPORT_DTYPES = {torch.int16: torch.int32, torch.bool: torch.uint8}
SUPPORTED_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                    torch.bfloat16, torch.float32, torch.float64, torch.bool)
DEFAULT_FUSION_BYTES = 64 * 1024 * 1024


class Handle:
    """Completion of one submitted operation: ``wait()`` returns its result or raises its error."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._result: Any = None
        self._error: Optional[BaseException] = None

    def finish(self, result: Any = None, error: Optional[BaseException] = None) -> None:
        self._result, self._error = result, error
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> Any:
        while not self._done.wait(timeout=1.0):  # short waits keep Ctrl-C responsive
            pass
        if self._error is not None:
            raise self._error
        return self._result


@dataclasses.dataclass
class Request:
    """One rank's side of a named operation."""

    name: str
    announcement: Announcement
    inputs: List[torch.Tensor]
    outputs: Optional[List[torch.Tensor]]  # preallocated results (allreduce, broadcast); else created here
    grouped: bool
    handle: Handle = dataclasses.field(default_factory=Handle)
    submitted_at: float = dataclasses.field(default_factory=time.monotonic)
    stall_reported: bool = False


def scaled(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """``tensor * factor`` as Horovod computes it: integers in float64 (truncated back), fp16 on CPU in fp32."""
    if factor == 1.0:
        return tensor
    if not tensor.dtype.is_floating_point:
        return (tensor.double() * factor).to(tensor.dtype)
    if tensor.dtype in (torch.float16, torch.bfloat16) and tensor.device.type == "cpu":
        return (tensor.float() * factor).to(tensor.dtype)
    return tensor * factor


def transport(tensor: torch.Tensor) -> torch.Tensor:
    dtype = TRANSPORT_DTYPES.get(tensor.dtype)
    return tensor if dtype is None else tensor.to(dtype)


def dtype_from_name(name: str) -> torch.dtype:
    return getattr(torch, name.replace("torch.", ""))


class Engine:
    """Per-process collective engine over torch.distributed; see the module docstring."""

    def __init__(self, rank: int, size: int, control_group: Any, cuda_group: Any = None,
                 cycle_time: float = 0.001) -> None:
        self.rank, self.size = rank, size
        self._control = control_group  # gloo: negotiation and CPU tensors
        self._cuda = cuda_group  # nccl for CUDA tensors, when available
        self._cycle_time = cycle_time
        self._fusion_bytes = int(os.environ.get("HOROVOD_FUSION_THRESHOLD", DEFAULT_FUSION_BYTES))
        self._table = NegotiationTable(size)
        self._cv = threading.Condition()
        self._outbox: List = []
        self._local: Dict[str, Request] = {}
        self._join: Optional[Handle] = None
        self._join_device = -1
        self._join_announced = False
        self._shutdown_requested = False
        self._closed: Optional[HorovodInternalError] = None
        self._counters: Dict[str, int] = collections.defaultdict(int)
        self.cycles = 0  # negotiation rounds so far (diagnostics)
        stall_check = os.environ.get("HOROVOD_STALL_CHECK_DISABLE", "0") not in ("1", "true")
        self._stall_s = float(os.environ.get("HOROVOD_STALL_CHECK_TIME_SECONDS", 60)) if stall_check else None
        self._next_stall_check = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="trainbridge-hvd-engine", daemon=True)
        self._thread.start()

    # ----- caller side ------------------------------------------------------
    def submit(self, name: Optional[str], announcement: Announcement, inputs: List[torch.Tensor],
               outputs: Optional[List[torch.Tensor]] = None, grouped: bool = False) -> Handle:
        """Queue one operation; ``name=None`` gets Horovod's auto-incremented name."""
        with self._cv:
            self._raise_if_closed()
            kind = announcement.kind
            if name is None:
                # Numbered per kind and process: ranks must issue unnamed operations in the same order.
                self._counters[kind] += 1
                name = f"{kind}.noname.{self._counters[kind]}"
            if name in self._local:
                raise ValueError(f"hvd.{kind}: an operation named {name!r} is already in progress on rank "
                                 f"{self.rank}; synchronize it first or give the new one another name")
            request = Request(name, announcement, inputs, outputs, grouped)
            self._local[name] = request
            self._outbox.append((name, announcement))
            self._cv.notify()
        return request.handle

    def join(self, device: int = -1) -> Handle:
        """Announce that this rank has no more data; the handle yields the last rank to join."""
        with self._cv:
            self._raise_if_closed()
            if self._join is not None:
                raise ValueError("hvd.join() is already in progress on this rank")
            self._join, self._join_device, self._join_announced = Handle(), device, False
            self._cv.notify()
            return self._join

    def stop(self) -> None:
        """Leave the job: every rank's loop ends at the same cycle (see the module docstring)."""
        with self._cv:
            self._shutdown_requested = True
            self._cv.notify()
        self._thread.join()

    def _raise_if_closed(self) -> None:
        if self._closed is not None:
            raise HorovodInternalError(str(self._closed))

    # ----- engine thread ----------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                message = self._next_message()
                gathered: List[Optional[Message]] = [None] * self.size
                dist.all_gather_object(gathered, message, group=self._control)
                outcome = self._table.apply(gathered)
                self.cycles += 1
                self._run(outcome.ready)
                if outcome.join_completed_by is not None:
                    with self._cv:
                        handle, self._join = self._join, None
                    handle.finish(outcome.join_completed_by)
                if outcome.shutdown_by:
                    self._close(HorovodInternalError(
                        f"Horovod has been shut down: rank {outcome.shutdown_by[0]} called hvd.shutdown() "
                        f"or exited while this operation was in progress"))
                    return
                self._report_stalls()
                if not outcome.ready:
                    with self._cv:  # nothing moved: pause one cycle unless something new arrives
                        if not self._outbox:
                            self._cv.wait(timeout=self._cycle_time)
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the waiting callers
            self._close(HorovodInternalError(f"a collective failed on rank {self.rank} ({type(exc).__name__}: "
                                             f"{first_line(exc)}); a peer probably "
                                             f"exited or lost its connection"))

    def _next_message(self) -> Message:
        with self._cv:
            while not (self._outbox or self._local or self._join is not None or self._shutdown_requested):
                self._cv.wait()
            announcements, self._outbox = self._outbox, []
            join = self._join is not None and not self._join_announced
            self._join_announced = self._join_announced or join
            return Message(announcements, join, self._shutdown_requested)

    def _report_stalls(self) -> None:
        now = time.monotonic()
        if self._stall_s is None or now < self._next_stall_check:
            return
        self._next_stall_check = now + 1.0
        with self._cv:
            stalled = [r for r in self._local.values()
                       if not r.stall_reported and now - r.submitted_at > self._stall_s]
        for request in stalled:
            request.stall_reported = True
            submitted = self._table.pending.get(request.name, {})
            missing = [r for r in range(self.size) if r not in submitted and r not in self._table.joined]
            print(f"trainbridge.hvd: warning: rank {self.rank} has waited {now - request.submitted_at:.0f}s for "
                  f"{request.announcement.kind} {request.name!r}; ranks {missing} have not submitted it. Unnamed "
                  f"operations are numbered per process, so every rank must issue them in the same order",
                  file=sys.stderr, flush=True)

    def _close(self, error: HorovodInternalError) -> None:
        with self._cv:
            self._closed = error
            failed = list(self._local.values())
            self._local.clear()
            join, self._join = self._join, None
        for request in failed:
            request.handle.finish(error=error)
        if join is not None:
            join.finish(error=error)

    # ----- execution --------------------------------------------------------
    def _run(self, decisions: List[Decision]) -> None:
        runnable = []
        for decision in decisions:
            with self._cv:
                request = self._local.pop(decision.name, None)  # None: this rank joined, contributes zeros
            if decision.error is not None:
                if request is not None:
                    request.handle.finish(error=TensorMismatchError(decision.error))
            else:
                runnable.append((decision, request))
        allreduces = [(d, r) for d, r in runnable if d.kind == "allreduce"]
        for (decision, request), outputs in zip(allreduces, self._reduce(allreduces)):
            if request is not None:
                if request.outputs is not None:
                    outputs = [target.copy_(out) for target, out in zip(request.outputs, outputs)]
                request.handle.finish(tuple(outputs) if request.grouped else outputs[0])
        for decision, request in runnable:
            if decision.kind != "allreduce":
                request.handle.finish(getattr(self, "_" + decision.kind)(decision, request))

    def _group_for(self, tensor: torch.Tensor) -> Any:
        """gloo for CPU tensors; nccl, on the tensor's GPU, for CUDA tensors."""
        if tensor.device.type == "cuda" and self._cuda is not None:
            torch.cuda.set_device(tensor.device)  # nccl runs on this thread's current device
            return self._cuda
        return self._control

    def _zeros_like(self, announcement: Announcement) -> List[torch.Tensor]:
        device = torch.device("cpu")
        if announcement.device == "cuda":
            device = torch.device("cuda", self._join_device if self._join_device >= 0 else torch.cuda.current_device())
        return [torch.zeros(shape, dtype=dtype_from_name(dtype), device=device)
                for shape, dtype in zip(announcement.shapes, announcement.dtypes)]

    def _reduce(self, entries: List[tuple]) -> List[List[torch.Tensor]]:
        """Reduce every tensor of every (decision, request); returns the reduced tensors per entry.

        Tensors that share dtype, device and op are fused into flat buffers of at
        most HOROVOD_FUSION_THRESHOLD bytes: one collective per buffer. The buckets
        depend only on the agreed announcements, so every rank builds the same ones.
        """
        results: List[List[Optional[torch.Tensor]]] = []
        buckets: Dict[tuple, List[tuple]] = collections.OrderedDict()
        for index, (decision, request) in enumerate(entries):
            ref = decision.reference()
            inputs = request.inputs if request is not None else self._zeros_like(ref)
            results.append([None] * len(inputs))
            for slot, tensor in enumerate(inputs):
                buckets.setdefault((tensor.dtype, ref.device, ref.op), []).append((index, slot, tensor, ref))
        for (dtype, _, op), items in buckets.items():
            for chunk in self._by_size(items):
                home = chunk[0][2].device  # model-parallel tensors on other GPUs join this buffer
                flat = torch.cat([transport(scaled(t, ref.prescale)).reshape(-1).to(home) for _, _, t, ref in chunk])
                dist.all_reduce(flat, op=TORCH_REDUCE_OPS[op], group=self._group_for(flat))
                offset = 0
                for index, slot, tensor, ref in chunk:
                    part = flat[offset:offset + tensor.numel()].view(tensor.shape).to(tensor.device, dtype)
                    offset += tensor.numel()
                    # Average is Sum then 1/size, folded into the post-scale as Horovod does.
                    results[index][slot] = scaled(part, ref.postscale / self.size if op == Average else ref.postscale)
        return results

    def _by_size(self, items: List[tuple]):
        chunk, nbytes = [], 0
        for item in items:
            size = item[2].numel() * item[2].element_size()
            if chunk and nbytes + size > self._fusion_bytes:
                yield chunk
                chunk, nbytes = [], 0
            chunk.append(item)
            nbytes += size
        if chunk:
            yield chunk

    def _allgather(self, decision: Decision, request: Request) -> Any:
        """Gather along dim 0; ranks may differ in that dimension, so pad to the longest and trim."""
        results = []
        for i, tensor in enumerate(request.inputs):
            rows = [decision.by_rank[r].shapes[i][0] for r in range(self.size)]
            longest = max(rows)
            send = transport(tensor)
            if tensor.shape[0] != longest:
                padded = send.new_zeros((longest,) + tuple(tensor.shape[1:]))
                padded[:tensor.shape[0]] = send
                send = padded
            received = [torch.empty_like(send) for _ in range(self.size)]
            dist.all_gather(received, send.contiguous(), group=self._group_for(send))
            results.append(torch.cat([part[:n] for part, n in zip(received, rows)]).to(tensor.dtype))
        return tuple(results) if request.grouped else results[0]

    def _broadcast(self, decision: Decision, request: Request) -> torch.Tensor:
        root = decision.reference().root
        tensor, output = request.inputs[0], request.outputs[0]
        buffer = transport(tensor).clone() if self.rank == root else torch.empty_like(transport(tensor))
        dist.broadcast(buffer, src=root, group=self._group_for(buffer))
        output.copy_(buffer)
        return output

    def _alltoall(self, decision: Decision, request: Request) -> Any:
        """Row splits were announced by every rank, so each knows what it receives from whom."""
        tensor = request.inputs[0]
        send_splits = list(decision.by_rank[self.rank].splits)
        recv_splits = [decision.by_rank[r].splits[self.rank] for r in range(self.size)]
        output = torch.empty((sum(recv_splits),) + tuple(tensor.shape[1:]),
                             dtype=transport(tensor).dtype, device=tensor.device)
        dist.all_to_all_single(output, transport(tensor), output_split_sizes=recv_splits,
                               input_split_sizes=send_splits, group=self._group_for(output))
        return output.to(tensor.dtype), torch.tensor(recv_splits, dtype=torch.int32)

    def _reducescatter(self, decision: Decision, request: Request) -> Any:
        """Reduce the whole tensor, keep this rank's rows; the first ``rows % size`` ranks get one extra."""
        results = []
        for reduced in self._reduce([(decision, request)])[0]:
            rows = reduced.shape[0]
            counts = [rows // self.size + (1 if r < rows % self.size else 0) for r in range(self.size)]
            start = sum(counts[:self.rank])
            results.append(reduced[start:start + counts[self.rank]].clone())
        return tuple(results) if request.grouped else results[0]

    def _barrier(self, decision: Decision, request: Request) -> None:
        return None  # every rank announced it, which is all a barrier needs
