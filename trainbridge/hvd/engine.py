"""The background thread that runs Horovod-style collectives on torch.distributed.

Contract (the same as Horovod's background loop):

* ``submit`` returns at once with a :class:`Handle`; the operation runs on this
  thread as soon as every rank has submitted the same *name*, overlapping with
  whatever the caller does next (for gradients: the rest of the backward pass).
* Each cycle, ranks exchange their new announcements over a dedicated gloo group
  (see :mod:`.negotiation`); the ready operations then run in the same order on
  every rank. An operation the ranks have agreed on before is announced as one bit
  of a small fixed-size array instead (:mod:`.response_cache`, Horovod's response
  cache): a cycle with only such operations costs one tiny all_gather. A cycle
  starts at least HOROVOD_CYCLE_TIME after the previous one started (Horovod's
  meaning: operations submitted meanwhile are negotiated, and fused, together).
  A thread with nothing in flight does not cycle, so an idle job costs nothing;
  the peers' cycle simply waits for it.
* Ready allreduces with the same dtype, device and op are fused into one flat
  buffer (Horovod's tensor fusion, up to HOROVOD_FUSION_THRESHOLD bytes; with
  HOROVOD_DISABLE_GROUP_FUSION=1 a grouped operation's tensors fuse only among
  themselves).
* On rank 0, a :class:`.timeline.Timeline` (HOROVOD_TIMELINE) records each
  operation's negotiation, queueing and collective.
* A rank that called ``join`` keeps answering allreduces with zeros until every
  rank has joined.
* ``hvd.shutdown()`` (or process exit) on any rank ends every rank's loop at the
  same cycle; operations still pending fail with HorovodInternalError, so a rank
  that dies or leaves never leaves its peers waiting.
* Only this thread issues collectives on the engine's groups, so its order is
  the same on every rank, whatever threads the caller uses. Process sets
  (:mod:`.process_sets`) are created and removed on this thread too, at the same
  cycle on every rank.
* Each process set this rank belongs to has its own engine (a *lane*: thread,
  negotiation table and unnamed-operation counters) that negotiates and runs the
  set's operations on the set's own groups, among its members only, as Horovod's
  per-set controllers do: a rank outside the set, busy or asleep, never delays
  them. A set's lane ends when the set is removed or the job shuts down.
* A rank that rejects its own input (see ``reject``) still announces the
  operation, so its peers fail it too instead of waiting for it.
* A name submitted again while an earlier operation of that name is still in
  flight on this rank (a step aborted by an exception, its handles never
  synchronized, then retried at once) waits behind it and is announced once the
  earlier one is decided: each rank's n-th operation of a name goes with the
  peers' n-th, whatever the timing, so the retry runs on every rank.
* No operation waits for ever. A watchdog (trainbridge's, :mod:`trainbridge.runtime.watchdog`)
  prints, after HOROVOD_STALL_CHECK_TIME_SECONDS (default 60; HOROVOD_STALL_CHECK_DISABLE=1
  turns it off), each operation this rank has waited for and the ranks that have
  not submitted it. After HOROVOD_STALL_SHUTDOWN_TIME_SECONDS (default: the job's
  timeout, TRAINBRIDGE_HVD_TIMEOUT, 300 s) the job shuts down on every rank and
  the pending operations raise HorovodInternalError naming the stalled one; a
  peer that stopped cycling altogether is caught by the same limit, which is the
  negotiation group's timeout.
* The engine thread never ends silently: whatever stops it, every pending and
  every later operation raises HorovodInternalError with the cause.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import os
import threading
import time
from typing import Any, Deque, Dict, Iterator, List, Optional, Sequence, Set, Tuple, cast

import torch
import torch.distributed as dist

from ..errors import first_line
from ..runtime.gloo_threads import keep_thread_states
from ..runtime.timeout import DEFAULT_TIMEOUT_S
from ..runtime.watchdog import WatchdogThread
from .errors import HorovodInternalError, rejection_error
from .log import enabled as log_enabled, log
from .negotiation import PROCESS_SET_KINDS, Announcement, CycleOutcome, Decision, Key, Message, NegotiationTable
from .reduce_ops import TORCH_REDUCE_OPS, Average
from .response_cache import ResponseCache, pack, unpack
from .settings import DEFAULT_SETTINGS, Settings
from .timeline import COLLECTIVES, Timeline, display_name

# gloo has no int16 kernels (and nccl no bool): such tensors travel widened.
TRANSPORT_DTYPES = {torch.int16: torch.int32, torch.bool: torch.uint8}
SUPPORTED_DTYPES = (
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.bool,
)


class Handle:
    """Completion of one submitted operation: ``wait()`` returns its result or raises its error.

    A plain lock, held from creation to :meth:`finish`, is the signal: cheaper than an Event (a Condition
    and a lock per operation), which counts at thousands of small operations a second."""

    def __init__(self, engine_alive=lambda: True) -> None:
        self._pending = threading.Lock()
        self._pending.acquire()
        self._finished = False
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self._engine_alive = engine_alive

    def finish(self, result: Any = None, error: Optional[BaseException] = None) -> None:
        if self._finished:
            return
        self._result, self._error, self._finished = result, error, True
        self._pending.release()

    def done(self) -> bool:
        return self._finished

    def wait(self) -> Any:
        while not self._pending.acquire(timeout=1.0):  # short waits keep Ctrl-C responsive
            if not self._engine_alive() and not self._finished:
                raise HorovodInternalError("the trainbridge.hvd engine thread ended without finishing this operation")
        self._pending.release()  # for any other waiter
        if self._error is not None:
            raise self._error
        return self._result


@dataclasses.dataclass
class Request:
    """One rank's side of a named operation."""

    key: Key
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

    def __init__(
        self,
        rank: int,
        size: int,
        control_group: Any,
        cuda_group: Any = None,
        settings: Settings = DEFAULT_SETTINGS,
        timeline: Optional[Timeline] = None,
        static_sets: Sequence[Tuple[int, ...]] = (),
        timeout: float = DEFAULT_TIMEOUT_S,
        stall_shutdown_s: Optional[float] = None,
        lane_of: Optional["Engine"] = None,
        set_id: int = 0,
    ) -> None:
        """The global engine; with ``lane_of`` (the global engine) and ``set_id``, the lane of that process set.
        ``timeline``: rank 0's, if HOROVOD_TIMELINE is set."""
        self.rank, self.size = rank, size
        self._settings = settings
        self._timeline = timeline
        self._timeout = timeout
        self._last_cycle = 0.0  # time.monotonic() at the start of the last cycle
        self._lane_of = lane_of
        self._lanes: Dict[int, "Engine"] = {}  # the global engine's lanes: set id -> Engine
        if lane_of is None:
            # Process sets: id -> ranks (read by callers) and id -> (gloo group, nccl group or None).
            self.process_sets: Dict[int, Tuple[int, ...]] = {0: tuple(range(size))}
            self._set_groups: Dict[int, Tuple[Any, Any]] = {0: (control_group, cuda_group)}
        else:  # a lane shares the global registry of sets
            self.process_sets, self._set_groups = lane_of.process_sets, lane_of._set_groups
            control_group, cuda_group = self._set_groups[set_id]
        self._control = control_group  # gloo: negotiation and CPU tensors
        self._cuda = cuda_group  # nccl for CUDA tensors, when available
        members = self.process_sets[set_id]
        self._table = NegotiationTable(len(members), members, set_id)
        self._set_members = members
        self._cache = ResponseCache(settings.cache_capacity)
        self._bits: Dict[int, Key] = {}  # cache id -> this rank's pending operation submitted as that bit
        self._bits_by_rank: List[Set[int]] = []  # the ids each member had pending in the last cycle
        self._idle = False  # the engine thread waits for work (a submission must wake it)
        self._next_set_id = 1
        self._cv = threading.Condition()
        self._outbox: List = []
        self._local: Dict[Key, Request] = {}  # announced, not decided yet: at most one per name
        # Later submissions (or rejections: request None) of a name in self._local, announced in order as each
        # earlier one is decided.
        self._waiting: Dict[Key, Deque[Tuple[str, Announcement, Optional[Request]]]] = {}
        self._executing: List[Request] = []  # taken out of _local by _run, not finished yet
        self._join: Optional[Handle] = None
        self._join_device = -1
        self._join_announced = False
        self._shutdown_requested: Any = False  # True, or the reason a stall ended the job
        self._closed: Optional[HorovodInternalError] = None
        self._counters: Dict[str, int] = collections.defaultdict(int)
        self.cycles = 0  # negotiation rounds so far (diagnostics)
        stall_check = os.environ.get("HOROVOD_STALL_CHECK_DISABLE", "0").lower() not in ("1", "true")
        self._stall_s = float(os.environ.get("HOROVOD_STALL_CHECK_TIME_SECONDS", 60)) if stall_check else None
        self._stall_shutdown_s = stall_shutdown_s
        for ranks in static_sets:  # every rank creates them in the same order, before the thread starts
            self._register_set(tuple(ranks))
        suffix = f"-set{set_id}" if set_id else ""
        self._thread = threading.Thread(target=self._loop, name=f"trainbridge-hvd-engine{suffix}", daemon=True)
        self._thread.start()
        period = max(0.05, min(1.0, (self._stall_s or 1.0) / 4, (stall_shutdown_s or 1.0) / 4))
        self._watchdog = WatchdogThread(
            self._check_stalls, period, name="trainbridge-hvd-stall-check", alive=self._thread.is_alive
        )

    # ----- caller side ------------------------------------------------------
    def _name(self, name: Optional[str], kind: str) -> str:
        if name is None:
            # Numbered per kind, process and process set (each lane counts its own, as Horovod's
            # per-set queues do): a set's members must issue its unnamed operations in the same order.
            self._counters[kind] += 1
            name = f"{kind}.noname.{self._counters[kind]}"
        return name

    def _lane(self, set_id: int) -> "Engine":
        """The engine that negotiates ``set_id``'s operations: its lane, or this one for the global set
        (and for a set that is gone, which this engine's table then fails as unregistered)."""
        return self._lanes.get(set_id, self) if set_id else self

    def submit(
        self,
        name: Optional[str],
        announcement: Announcement,
        inputs: List[torch.Tensor],
        outputs: Optional[List[torch.Tensor]] = None,
        grouped: bool = False,
    ) -> Handle:
        """Queue one operation; ``name=None`` gets Horovod's auto-incremented name (numbered per process set)."""
        lane = self._lane(announcement.process_set)
        if lane is not self:
            return lane.submit(name, announcement, inputs, outputs, grouped)
        with self._cv:
            self._raise_if_closed()
            kind = announcement.kind
            name = self._name(name, kind)
            key = (announcement.process_set, name)
            request = Request(key, announcement, inputs, outputs, grouped, handle=Handle(self._thread.is_alive))
            if key in self._local:
                self._waiting.setdefault(key, collections.deque()).append((name, announcement, request))
            else:
                self._announce(name, announcement, request)
        return request.handle

    def _announce(self, name: str, announcement: Announcement, request: Optional[Request]) -> None:
        """Put one operation (or, with ``request`` None, a rejection) in the next cycle's message; holds _cv."""
        if request is not None:
            self._local[request.key] = request
        self._outbox.append((name, announcement))
        if self._idle:
            self._cv.notify()

    def _announce_next(self, key: Key) -> None:
        """``key``'s operation was decided: announce what waits behind it, up to the next operation; holds _cv."""
        waiting = self._waiting.get(key)
        while waiting and key not in self._local:
            self._announce(*waiting.popleft())
        if not waiting:
            self._waiting.pop(key, None)

    def reject(self, name: Optional[str], kind: str, process_set: int, error: BaseException) -> None:
        """Announce an operation whose input this rank rejected (it raises ``error`` itself), so that
        the peers that submitted it fail with the same error type instead of waiting for this rank."""
        lane = self._lane(process_set)
        if lane is not self:
            return lane.reject(name, kind, process_set, error)
        with self._cv:
            if self._closed is not None:
                return
            name = self._name(name, kind)
            announcement = Announcement(
                kind, process_set=process_set, error=(type(error).__name__, f"{first_line(error)}")
            )
            if (process_set, name) in self._local:
                # Announced now, it would replace the announcement in flight: it waits its turn instead.
                self._waiting.setdefault((process_set, name), collections.deque()).append((name, announcement, None))
            else:
                self._announce(name, announcement, None)

    def add_process_set(self, ranks: Tuple[int, ...]) -> Handle:
        """Register ``ranks`` as a set on every rank; the handle yields its id, or None for a duplicate."""
        return self.submit(None, Announcement("add_process_set", ranks=tuple(ranks)), [])

    def remove_process_set(self, process_set_id: int) -> Handle:
        """Unregister a set on every rank; the handle yields its id, or None if it was not registered."""
        return self.submit(None, Announcement("remove_process_set", ranks=(process_set_id,)), [])

    def join(self, device: int = -1) -> Handle:
        """Announce that this rank has no more data; the handle yields the last rank to join."""
        with self._cv:
            self._raise_if_closed()
            if self._join is not None:
                raise ValueError("hvd.join() is already in progress on this rank")
            self._join, self._join_device, self._join_announced = Handle(self._thread.is_alive), device, False
            self._cv.notify()
            return self._join

    def _request_stop(self) -> None:
        with self._cv:
            self._shutdown_requested = self._shutdown_requested or True
            self._cv.notify_all()

    def stop(self) -> None:
        """Leave the job: every rank's loop ends at the same cycle (see the module docstring)."""
        lanes = list(self._lanes.values())
        for lane in lanes:
            # First, so that a member waiting in a set's operation for this rank fails now instead of
            # keeping its own global loop (which this rank's global loop waits for) from cycling.
            lane._request_stop()
        self._request_stop()
        self._thread.join()
        self._watchdog.stop()
        for lane in lanes:
            lane.stop()
        if self._lane_of is not None:
            return  # the global engine owns the groups
        for set_id, groups in list(self._set_groups.items()):
            if set_id != 0:
                self._destroy_groups(groups)
        # No reference to a process group outlives shutdown(): a gloo group freed later, during
        # interpreter exit, can abort the process from its worker threads.
        self._set_groups, self._control, self._cuda = {}, None, None

    def _raise_if_closed(self) -> None:
        if self._closed is not None:
            error = HorovodInternalError(str(self._closed))
            error.__cause__ = self._closed.__cause__
            raise error

    # ----- engine thread ----------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                message = self._next_message()
                announcing = bool(message.announcements or message.join or message.shutdown)
                cached: List[Decision] = []
                if self._settings.cache_capacity > 0:
                    # Every cycle: who announces in full, and which cached operations each rank has pending.
                    with self._cv:
                        header = pack(self._bits, self._cache.size, announcing)
                    parts = [torch.empty_like(header) for _ in self._set_members]
                    dist.all_gather(parts, header, group=self._control)
                    announcing, self._bits_by_rank = unpack(parts, self._cache.size)
                    cached = self._cached_decisions()
                messages: List[Message] = []
                outcome = CycleOutcome([], None, [])
                if announcing:
                    gathered: List[Optional[Message]] = [None] * len(self._set_members)
                    dist.all_gather_object(gathered, message, group=self._control)
                    messages = cast(List[Message], gathered)  # all_gather_object filled every slot
                    outcome = self._table.apply(messages)
                    self._update_cache(messages, outcome.ready)
                self.cycles += 1
                ready = outcome.ready + cached
                if self._timeline is not None or log_enabled("debug"):
                    self._record(messages, ready, cached)
                self._run(ready)
                if outcome.join_completed_by is not None:
                    with self._cv:
                        handle, self._join = self._join, None
                    assert handle is not None  # a join completes only after this rank announced its own
                    handle.finish(outcome.join_completed_by)
                if outcome.shutdown_by:
                    self._close(
                        HorovodInternalError(
                            outcome.shutdown_reason
                            or (
                                f"Horovod has been shut down: rank {outcome.shutdown_by[0]} called hvd.shutdown() "
                                f"or exited while this operation was in progress"
                            )
                        )
                    )
                    return
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the waiting callers
            stalled = self._stalled(time.monotonic(), self._stall_shutdown_s or self._timeout)
            if stalled:
                reason = (
                    f"a collective failed on rank {self.rank} after {self._describe(stalled)} "
                    f"({type(exc).__name__}: {first_line(exc)}); the job shut down instead of waiting "
                    f"for ever (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS / TRAINBRIDGE_HVD_TIMEOUT)"
                )
            else:
                reason = (
                    f"a collective failed on rank {self.rank} ({type(exc).__name__}: {first_line(exc)}); "
                    f"a peer probably exited or lost its connection (or this rank failed: see the cause)"
                )
            error = HorovodInternalError(reason)
            error.__cause__ = exc
            self._close(error)

    def _cached_decisions(self) -> List[Decision]:
        """The cached operations every member has pending (in id order, the same on every rank)."""
        if self._table.joined or not self._bits_by_rank:
            return []  # a rank that joined contributes zeros: only the full negotiation knows that
        decisions = []
        for cache_id in sorted(set.intersection(*self._bits_by_rank)):
            with self._cv:
                self._bits.pop(cache_id, None)
            decisions.append(self._cache.decision(cache_id))
        return decisions

    def _update_cache(self, messages: List[Message], ready: List[Decision]) -> None:
        """After a full negotiation, on every rank alike: a name some rank announced in full leaves the cache
        (this rank then announces it in full too, if it had set its bit), and what is decided now is cached."""
        if self._settings.cache_capacity == 0:
            return
        with self._cv:
            for message in messages:
                for name, announcement in message.announcements:
                    cache_id = self._cache.drop((announcement.process_set, name))
                    if cache_id is not None and cache_id in self._bits:
                        self._reannounce(self._bits.pop(cache_id))
            if self._table.joined:
                for key in list(self._bits.values()):  # after a join, only the full negotiation decides
                    self._reannounce(key)
                self._bits.clear()
        for decision in ready:
            self._cache.add(decision, self._set_members)

    def _reannounce(self, key: Key) -> None:
        """Announce in full the pending operation ``key`` that this rank had submitted as a cache bit; holds _cv."""
        request = self._local[key]
        self._outbox.append((key[1], request.announcement))

    def _record(self, messages: List[Message], ready: List[Decision], cached: List[Decision]) -> None:
        """The cycle in the timeline (rank 0) and in the debug log: who announced what, what was decided."""
        timeline = self._timeline
        if timeline is not None:
            for rank, message in zip(self._table.ranks, messages):
                for name, announcement in message.announcements:
                    timeline.announced(display_name(announcement.kind, name), announcement.kind, rank)
            for decision in cached:  # every member's bit arrived in this cycle
                for rank in decision.by_rank:
                    timeline.announced(display_name(decision.kind, decision.name), decision.kind, rank)
        for decision in ready:
            runs = decision.error is None and decision.kind not in PROCESS_SET_KINDS + ("barrier",)
            if timeline is not None:
                timeline.decided(display_name(decision.kind, decision.name), decision.kind, runs)
            log(
                "debug",
                f"rank {self.rank} cycle {self.cycles}: {decision.kind} {decision.name!r} "
                f"{'runs' if decision.error is None else 'fails: ' + decision.error}",
            )
        if log_enabled("trace"):
            log(
                "trace",
                f"rank {self.rank} cycle {self.cycles}: announced "
                + "; ".join(
                    f"rank {rank}: {[name for name, _ in message.announcements]}"
                    for rank, message in zip(self._table.ranks, messages)
                ),
            )

    def _next_message(self) -> Message:
        """This rank's message for the next cycle, once there is something to say or wait for, and once
        HOROVOD_CYCLE_TIME has passed since the last cycle started."""
        with self._cv:
            self._idle = True
            while not (self._outbox or self._local or self._join is not None or self._shutdown_requested):
                self._cv.wait()
            self._idle = False
            start = self._last_cycle + self._settings.cycle_time_s
            while not self._shutdown_requested and time.monotonic() < start:
                self._cv.wait(timeout=start - time.monotonic())
            self._last_cycle = time.monotonic()
            if self._timeline is not None:
                self._timeline.cycle_start()
            announcements = []
            for name, announcement in self._outbox:
                key = (announcement.process_set, name)
                cache_id = None
                if announcement.error is None and key in self._local and not self._table.joined:
                    cache_id = self._cache.lookup(key, self.rank, announcement)
                if cache_id is None:
                    announcements.append((name, announcement))
                else:
                    self._bits[cache_id] = key
            self._outbox = []
            join = self._join is not None and not self._join_announced
            self._join_announced = self._join_announced or join
            return Message(announcements, join, self._shutdown_requested)

    # ----- stalls -----------------------------------------------------------
    def _stalled(self, now: float, after: float) -> List[Request]:
        with self._cv:
            return [r for r in self._local.values() if now - r.submitted_at > after]

    def _missing(self, request: Request) -> List[int]:
        """The members that have not announced ``request`` yet (as far as this rank has heard)."""
        try:
            submitted = set(self._table.pending.get(request.key, {}))
            joined = list(self._table.joined) if request.key[0] == 0 else []
            cache_id = next((i for i, key in self._bits.items() if key == request.key), None)
            if cache_id is not None:  # submitted as a cache bit: who had it in the last cycle
                submitted = {r for r, ids in zip(self._set_members, self._bits_by_rank) if cache_id in ids}
        except RuntimeError:  # the engine thread changed the table meanwhile: ask again next time
            return []
        members = self.process_sets.get(request.key[0], ())
        return [r for r in members if r != self.rank and r not in submitted and r not in joined]

    def _describe(self, requests: List[Request]) -> str:
        now = time.monotonic()
        parts = []
        for request in requests:
            set_id, name = request.key
            where = "" if set_id == 0 else f" in process set {set_id} {list(self.process_sets.get(set_id, ()))}"
            parts.append(
                f"{request.announcement.kind} {name!r}{where} (waited {now - request.submitted_at:.0f}s; "
                f"ranks {self._missing(request)} have not submitted it)"
            )
        return "; ".join(parts)

    def _check_stalls(self) -> None:
        """Report stalled operations and, past the shutdown limit, shut the job down (see the docstring)."""
        now = time.monotonic()
        if self._stall_s is not None:
            with self._cv:
                fresh = [
                    r for r in self._local.values() if not r.stall_reported and now - r.submitted_at > self._stall_s
                ]
                for request in fresh:
                    request.stall_reported = True
            if fresh:
                log(
                    "warning",
                    f"rank {self.rank} is waiting for {self._describe(fresh)}. Unnamed operations are numbered "
                    f"per process and process set, so every member must issue them in the same order",
                )
        if self._stall_shutdown_s is not None:
            stalled = self._stalled(now, self._stall_shutdown_s)
            if stalled:
                reason = (
                    f"Horovod has been shut down: rank {self.rank} waited more than "
                    f"{self._stall_shutdown_s:g}s (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS, at most "
                    f"TRAINBRIDGE_HVD_TIMEOUT) for {self._describe(stalled)}"
                )
                with self._cv:
                    if not isinstance(self._shutdown_requested, str):
                        self._shutdown_requested = reason
                        self._cv.notify_all()

    def _close(self, error: HorovodInternalError) -> None:
        for lane in list(self._lanes.values()):
            lane._request_stop()  # the job ended: so do its sets, on every member (their lanes' last round)
        with self._cv:
            self._closed = error
            failed = list(self._local.values()) + [r for r in self._executing if not r.handle.done()]
            failed += [r for waiting in self._waiting.values() for _, _, r in waiting if r is not None]
            self._local.clear()
            self._waiting.clear()
            self._executing = []
            join, self._join = self._join, None
        for request in failed:
            request.handle.finish(error=error)
        if join is not None:
            join.finish(error=error)

    # ----- process sets -----------------------------------------------------
    def _register_set(self, ranks: Tuple[int, ...]) -> int:
        set_id, self._next_set_id = self._next_set_id, self._next_set_id + 1
        timeout = datetime.timedelta(seconds=self._timeout)
        gloo = dist.new_group(ranks=list(ranks), backend="gloo", timeout=timeout)
        cuda = None
        if self._cuda is not None:
            cuda = dist.new_group(ranks=list(ranks), backend="nccl", timeout=timeout)
        self._set_groups[set_id] = (gloo, cuda)
        self.process_sets[set_id] = ranks
        if self.rank in ranks:  # the set negotiates among its members only, on its own thread
            keep_thread_states(gloo)
            self._lanes[set_id] = Engine(
                self.rank,
                self.size,
                None,
                settings=self._settings,
                timeline=self._timeline,
                timeout=self._timeout,
                stall_shutdown_s=self._stall_shutdown_s,
                lane_of=self,
                set_id=set_id,
            )
        return set_id

    def _destroy_groups(self, groups: Tuple[Any, Any]) -> None:
        for group in groups:
            if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(group)

    def _add_process_set(self, decision: Decision, request: Optional[Request]) -> Optional[int]:
        ranks = decision.reference().ranks
        assert ranks is not None  # add_process_set announces the set's ranks
        if ranks in self.process_sets.values():
            return None  # a duplicate: every rank sees it the same way
        return self._register_set(ranks)

    def _remove_process_set(self, decision: Decision, request: Optional[Request]) -> Optional[int]:
        ranks = decision.reference().ranks
        assert ranks is not None  # remove_process_set announces (the set's id,)
        set_id = ranks[0]
        if set_id == 0 or set_id not in self.process_sets:
            return None
        lane = self._lanes.pop(set_id, None)
        if lane is not None:
            lane.stop()  # every member stops its lane at this same cycle, so their last rounds meet
        del self.process_sets[set_id]
        self._destroy_groups(self._set_groups.pop(set_id))
        return set_id

    # ----- execution --------------------------------------------------------
    def _run(self, decisions: List[Decision]) -> None:
        runnable = []
        with self._cv:
            requests = []
            for decision in decisions:
                # None: this rank rejected its input, is not in the set, or joined (contributes zeros)
                requests.append(self._local.pop((decision.process_set, decision.name), None))
                self._announce_next((decision.process_set, decision.name))
        for decision, request in zip(decisions, requests):
            if decision.error is not None:
                if request is not None:
                    request.handle.finish(error=rejection_error(decision.error_type, decision.error))
            elif decision.kind in PROCESS_SET_KINDS:
                runnable.append((decision, request))  # every rank takes part in new_group
            elif self.rank in self.process_sets.get(decision.process_set, ()):
                runnable.append((decision, request))
        with self._cv:  # if a collective below fails, _close fails these too
            self._executing = [request for _, request in runnable if request is not None]
        timeline = self._timeline
        allreduces = [(d, r) for d, r in runnable if d.kind == "allreduce"]
        for (decision, request), outputs in zip(allreduces, self._reduce(allreduces)):
            if request is not None:  # outputs are the request's preallocated ones, filled, if it has them
                request.handle.finish(tuple(outputs) if request.grouped else outputs[0])
            if timeline is not None:
                timeline.finished(display_name("allreduce", decision.name), outputs[0])
        for decision, request in runnable:
            if decision.kind != "allreduce":
                shown, collective = display_name(decision.kind, decision.name), None
                if timeline is not None:
                    collective = COLLECTIVES.get((decision.kind, decision.reference().device))
                    timeline.activity([shown], collective)
                result = getattr(self, "_" + decision.kind)(decision, request)
                if request is not None:
                    request.handle.finish(result)
                if timeline is not None and collective is not None:
                    timeline.finished(shown, result)
        with self._cv:
            self._executing = []

    def _members(self, decision: Decision) -> Tuple[int, ...]:
        return self.process_sets[decision.process_set]

    def _group_for(self, tensor: torch.Tensor, set_id: int = 0) -> Any:
        """gloo for CPU tensors; nccl, on the tensor's GPU, for CUDA tensors (the process set's groups)."""
        gloo, cuda = self._set_groups[set_id]
        if tensor.device.type == "cuda" and cuda is not None:
            torch.cuda.set_device(tensor.device)  # nccl runs on this thread's current device
            return cuda
        return gloo

    def _zeros_like(self, announcement: Announcement) -> List[torch.Tensor]:
        device = torch.device("cpu")
        if announcement.device == "cuda":
            device = torch.device("cuda", self._join_device if self._join_device >= 0 else torch.cuda.current_device())
        return [
            torch.zeros(shape, dtype=dtype_from_name(dtype), device=device)
            for shape, dtype in zip(announcement.shapes, announcement.dtypes)
        ]

    def _reduce(self, entries: List[tuple]) -> List[List[torch.Tensor]]:
        """Reduce every tensor of every (decision, request); returns the reduced tensors per entry: the
        request's preallocated outputs, filled, where it has them.

        Tensors that share process set, dtype, device and op are fused into flat
        buffers of at most HOROVOD_FUSION_THRESHOLD bytes: one collective per buffer.
        The buckets depend only on the agreed announcements, so every rank builds the same ones.
        A tensor alone in its buffer is reduced in its output itself (no fusion buffer, as in Horovod).
        """
        results: List[List[Optional[torch.Tensor]]] = []
        buckets: Dict[tuple, List[tuple]] = collections.OrderedDict()
        for index, (decision, request) in enumerate(entries):
            ref = decision.reference()
            inputs = request.inputs if request is not None else self._zeros_like(ref)
            targets = request.outputs if request is not None and request.outputs is not None else [None] * len(inputs)
            results.append([None] * len(inputs))
            # HOROVOD_DISABLE_GROUP_FUSION=1: a grouped operation's tensors share buffers only with each other.
            group = decision.name if len(ref.shapes) > 1 and not self._settings.group_fusion else None
            for slot, (tensor, target) in enumerate(zip(inputs, targets)):
                key = (decision.process_set, tensor.dtype, ref.device, ref.op, group)
                buckets.setdefault(key, []).append((index, slot, tensor, ref, target))
        timeline = self._timeline
        for (set_id, dtype, device, op, _), items in buckets.items():
            members = len(self.process_sets[set_id])
            for chunk in self._by_size(items):
                home = chunk[0][2].device  # model-parallel tensors on other GPUs join this buffer
                shown: List[str] = []
                if timeline is not None:
                    shown = list(dict.fromkeys(display_name(entries[i][0].kind, entries[i][0].name) for i, *_ in chunk))
                    timeline.activity(shown, "MEMCPY_IN_FUSION_BUFFER" if len(chunk) > 1 else None)
                # Average is Sum then 1/size, folded into the post-scale as Horovod does.
                posts = [ref.postscale / members if op == Average else ref.postscale for *_, ref, _ in chunk]
                _, _, tensor, ref, target = chunk[0]
                if len(chunk) == 1 and self._reducible_in(target, tensor, home):
                    if target is not tensor or ref.prescale != 1.0:
                        target.copy_(scaled(tensor, ref.prescale))
                    if timeline is not None:
                        timeline.activity(shown, COLLECTIVES.get(("allreduce", device), "GLOO_ALLREDUCE"))
                    dist.all_reduce(target, op=TORCH_REDUCE_OPS[op], group=self._group_for(target, set_id))
                    if posts[0] != 1.0:
                        target.copy_(scaled(target, posts[0]))
                    results[chunk[0][0]][chunk[0][1]] = target
                    if timeline is not None:
                        timeline.activity(shown, None)
                    continue
                flat = torch.cat([transport(scaled(t, ref.prescale)).reshape(-1).to(home) for _, _, t, ref, _ in chunk])
                if timeline is not None:
                    timeline.activity(shown, COLLECTIVES.get(("allreduce", device), "GLOO_ALLREDUCE"))
                dist.all_reduce(flat, op=TORCH_REDUCE_OPS[op], group=self._group_for(flat, set_id))
                if timeline is not None:
                    timeline.activity(shown, "MEMCPY_OUT_FUSION_BUFFER" if len(chunk) > 1 else None)
                same_post = flat.dtype == dtype and len(set(posts)) == 1  # scale the buffer once
                if same_post and posts[0] != 1.0:
                    flat = scaled(flat, posts[0])
                targets = [item[4] for item in chunk]
                outputs = [t for t in targets if t is not None and t.device == flat.device]
                if same_post and len(outputs) == len(chunk):
                    # Every result has its output: one batched copy out of the buffer.
                    parts = torch.split(flat, [item[2].numel() for item in chunk])
                    torch._foreach_copy_([t.view(-1) for t in outputs], list(parts))
                    for (index, slot, *_), target in zip(chunk, targets):
                        results[index][slot] = target
                    continue
                offset = 0
                for (index, slot, tensor, _, target), post in zip(chunk, posts):
                    part = flat[offset : offset + tensor.numel()].view(tensor.shape).to(tensor.device, dtype)
                    offset += tensor.numel()
                    if not same_post:
                        part = scaled(part, post)
                    results[index][slot] = part if target is None else target.copy_(part)
        return cast(List[List[torch.Tensor]], results)  # every slot was filled above

    @staticmethod
    def _reducible_in(target: Optional[torch.Tensor], tensor: torch.Tensor, home: torch.device) -> bool:
        """Whether ``tensor``'s allreduce can run in its preallocated output ``target`` itself."""
        return (
            target is not None
            and target.is_contiguous()
            and target.dtype == tensor.dtype
            and tensor.dtype not in TRANSPORT_DTYPES
            and target.device == home
        )

    def _by_size(self, items: List[tuple]) -> Iterator[List[tuple]]:
        chunk: List[tuple] = []
        nbytes = 0
        for item in items:
            size = item[2].numel() * item[2].element_size()
            if chunk and nbytes + size > self._settings.fusion_bytes:
                yield chunk
                chunk, nbytes = [], 0
            chunk.append(item)
            nbytes += size
        if chunk:
            yield chunk

    def _allgather(self, decision: Decision, request: Request) -> Any:
        """Gather along dim 0; ranks may differ in that dimension, so pad to the longest and trim."""
        members = self._members(decision)
        results = []
        for i, tensor in enumerate(request.inputs):
            rows = [decision.by_rank[r].shapes[i][0] for r in members]
            longest = max(rows)
            send = transport(tensor)
            if tensor.shape[0] != longest:
                padded = send.new_zeros((longest,) + tuple(tensor.shape[1:]))
                padded[: tensor.shape[0]] = send
                send = padded
            received = [torch.empty_like(send) for _ in members]
            dist.all_gather(received, send.contiguous(), group=self._group_for(send, decision.process_set))
            results.append(torch.cat([part[:n] for part, n in zip(received, rows)]).to(tensor.dtype))
        return tuple(results) if request.grouped else results[0]

    def _broadcast(self, decision: Decision, request: Request) -> torch.Tensor:
        root = decision.reference().root  # a global rank, as in Horovod
        assert request.outputs is not None  # broadcast's output is preallocated (collectives._broadcast_async)
        tensor, output = request.inputs[0], request.outputs[0]
        buffer = transport(tensor).clone() if self.rank == root else torch.empty_like(transport(tensor))
        dist.broadcast(buffer, src=root, group=self._group_for(buffer, decision.process_set))
        output.copy_(buffer)
        return output

    def _alltoall(self, decision: Decision, request: Request) -> Any:
        """Row splits were announced by every rank, so each knows what it receives from whom."""
        members = self._members(decision)
        tensor = request.inputs[0]
        # alltoall announces its splits on every rank
        send_splits = list(decision.by_rank[self.rank].splits or ())
        recv_splits = [(decision.by_rank[r].splits or ())[members.index(self.rank)] for r in members]
        output = torch.empty(
            (sum(recv_splits),) + tuple(tensor.shape[1:]), dtype=transport(tensor).dtype, device=tensor.device
        )
        dist.all_to_all_single(
            output,
            transport(tensor),
            output_split_sizes=recv_splits,
            input_split_sizes=send_splits,
            group=self._group_for(output, decision.process_set),
        )
        return output.to(tensor.dtype), torch.tensor(recv_splits, dtype=torch.int32)

    def _reducescatter(self, decision: Decision, request: Request) -> Any:
        """Reduce the whole tensor, keep this rank's rows; the first ``rows % size`` members get one extra."""
        members = self._members(decision)
        size, position = len(members), members.index(self.rank)
        results = []
        for reduced in self._reduce([(decision, request)])[0]:
            rows = reduced.shape[0]
            counts = [rows // size + (1 if r < rows % size else 0) for r in range(size)]
            start = sum(counts[:position])
            results.append(reduced[start : start + counts[position]].clone())
        return tuple(results) if request.grouped else results[0]

    def _barrier(self, decision: Decision, request: Request) -> None:
        return None  # every member announced it, which is all a barrier needs
