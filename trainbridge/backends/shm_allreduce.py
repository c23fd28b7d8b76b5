"""Gradient averaging through shared memory, for torch-backend ranks that share one CPU host.

Why: gloo sends every DDP bucket through loopback TCP and wakes its helper
threads for each one; on a CPU host those threads compete with the compute
threads of every rank. Ranks on one host can instead add each other's
gradients straight from shared memory, as Open MPI (vader), NCCL (SHM) and the
CPU paths of DeepSpeed and vLLM do. Measured on the 2-core CI machine (MNIST
convnet, batch 128, 2 ranks): see benchmarks/RESULTS.md.

Layout of the job's one /dev/shm file (unlinked once every rank has mapped it,
so that no crash can leave it behind):

    [header: token, pid and progress counter per rank]
    [mailboxes: 2 sets x world_size x (sequence number, MAILBOX_VALUES float64)]
    [slots: 2 sets x world_size x chunk bytes]

Each DDP bucket is averaged chunk by chunk. For call ``seq`` (slot set ``seq % 2``):

1. divide the chunk by the world size (as DDP's own hook does) and copy it into
   this rank's slot, then publish ``progress[rank] = seq``;
2. wait until every rank's progress is ``>= seq``;
3. add the slots in rank order into the bucket: every rank runs the same
   additions on the same bits, so all ranks end with identical gradients (for
   2 ranks, bit-identical to gloo's allreduce as well).

Two slot sets make one wait per chunk enough: a rank writes set ``seq % 2`` again
only at ``seq + 2``, after seeing every rank publish ``seq + 1``, which each rank
does only after it finished reading the slots of ``seq``.

Small tensors (the loop's per-step stop flag) are allreduced asynchronously
through the mailboxes, with a sequence of their own: :meth:`allreduce_small_async`
writes this rank's values and publishes its number without waiting; the
returned ``wait`` reduces every rank's values in rank order once all are
published. Each rank waits for one such allreduce before it starts the next, so
the same two-set argument holds. Why: on a CPU host each gloo operation wakes
gloo's helper threads on cores that are busy training (1-6 % of an MNIST
step on 2 cores, benchmarks/RESULTS.md).

A waiting rank spins (yielding the core), then sleeps; it fails with an error
naming the missing ranks when one of them exits (its pid is gone) or when
``timeout`` passes, never hangs. x86-64 only: its stores are seen by other cores
in program order, so a published counter implies the slot data before it is
visible; other CPUs keep gloo.
"""

from __future__ import annotations

import mmap
import os
import platform
import secrets
import time
from typing import Callable, List, Optional, Tuple, cast

import torch

HEADER_BYTES_PER_RANK = 24  # token (int64, rank 0's only), pid (int64), progress (int64)
MAILBOX_VALUES = 8  # float64 values per rank in a small-tensor allreduce
SHM_BUDGET_BYTES = 32 << 20  # all slots together stay under this (Docker's default /dev/shm is 64 MiB)
MAX_CHUNK_BYTES = 4 << 20
MIN_CHUNK_BYTES = 256 << 10
SPIN_SECONDS = 0.002  # yield-spin this long before sleeping: peers usually arrive within it
LIVENESS_EVERY = 0.1  # seconds between checks that the missing peers still exist


class PeerGone(RuntimeError):
    """A rank stopped before the gradient exchange finished; the message names it."""


def supported() -> Optional[str]:
    """None when this machine can use the shared-memory path, else why not."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the CPU is {platform.machine()}, not x86-64"
    if not os.path.isdir("/dev/shm"):
        return "there is no /dev/shm"
    return None


def chunk_bytes(world_size: int, largest_bucket_bytes: int) -> int:
    """Slot size: the largest bucket, capped so that 2 sets x world_size slots fit the budget."""
    cap = max(MIN_CHUNK_BYTES, min(MAX_CHUNK_BYTES, SHM_BUDGET_BYTES // (2 * world_size)))
    return max(64, min(cap, -(-largest_bucket_bytes // 64) * 64))


class ShmAllreduce:
    """Averages tensors among ranks on one host through one shared file. Build with :meth:`open`."""

    def __init__(self, region: torch.Tensor, rank: int, world_size: int, chunk: int, timeout: float) -> None:
        self.rank, self.world_size, self.chunk, self.timeout = rank, world_size, chunk, timeout
        header = region[: HEADER_BYTES_PER_RANK * world_size].view(torch.int64).view(world_size, 3)
        self.tokens, self.pids, self.progress = header[:, 0], header[:, 1], header[:, 2]
        start = self.header_bytes(world_size)
        shape = (2, world_size, 1 + MAILBOX_VALUES)  # per set and rank: sequence number, then the values
        mail = region[start : start + 8 * shape[0] * shape[1] * shape[2]]
        self.mail_seq = mail.view(torch.int64).view(shape)[:, :, 0]
        self.mail_values = mail.view(torch.float64).view(shape)[:, :, 1:]
        start += self.mailbox_bytes(world_size)
        self.slots = region[start : start + 2 * world_size * chunk].view(2, world_size, chunk)
        self.seq = 0
        self.small_seq = 0
        self.small_pending: Optional[Callable[[], torch.Tensor]] = None

    # ----- setup ------------------------------------------------------------
    @staticmethod
    def header_bytes(world_size: int) -> int:
        return _whole_pages(HEADER_BYTES_PER_RANK * world_size)

    @staticmethod
    def mailbox_bytes(world_size: int) -> int:
        return _whole_pages(2 * world_size * 8 * (1 + MAILBOX_VALUES))

    @classmethod
    def region_bytes(cls, world_size: int, chunk: int) -> int:
        return cls.header_bytes(world_size) + cls.mailbox_bytes(world_size) + 2 * world_size * chunk

    @classmethod
    def open(
        cls,
        rank: int,
        world_size: int,
        chunk: int,
        timeout: float,
        broadcast_object: Callable[[object], object],
        allgather_object: Callable[[object], List[object]],
    ) -> "tuple[Optional[ShmAllreduce], Optional[str]]":
        """Collective: every rank calls it. Returns (exchange, None) when every rank mapped the
        same file, else (None, why not) on every rank, so that all ranks pick the same path."""
        size = cls.region_bytes(world_size, chunk)
        exchange, created, token, why = None, None, 0, supported()
        try:
            if rank == 0 and why is None:
                ours, token = f"/dev/shm/trainbridge-{os.getpid()}-{secrets.token_hex(6)}", secrets.randbits(62) + 1
                try:
                    fd = os.open(ours, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                    created = ours
                    try:
                        # Reserve now: a full /dev/shm fails here, not with SIGBUS later.
                        os.posix_fallocate(fd, 0, size)
                    finally:
                        os.close(fd)
                    exchange = cls(_map(ours, size), rank, world_size, chunk, timeout)
                    exchange.tokens[0] = token  # before the broadcast, so that every reader sees it
                except OSError as exc:
                    why = f"cannot reserve {size >> 20} MiB in /dev/shm ({exc.strerror})"
            path, token, why = cast(
                Tuple[Optional[str], int, Optional[str]],
                broadcast_object((created if why is None else None, token, why)),
            )
            mine = why
            if rank != 0 and why is None and path is not None:  # rank 0 created it (path is None only with a why)
                try:
                    exchange = cls(_map(path, size), rank, world_size, chunk, timeout)
                    # A rank that reads rank 0's token back mapped rank 0's file: it shares rank 0's host.
                    if int(exchange.tokens[0]) != token:
                        mine = f"rank {rank} is not on rank 0's host"
                except OSError as exc:  # another host (no such file), or mapping refused
                    mine = f"rank {rank} cannot map {path} ({exc.strerror}): not on rank 0's host"
            if exchange is not None:
                exchange.pids[rank] = os.getpid()
            answers = allgather_object(mine)
        finally:
            if created is not None:
                os.unlink(created)  # every rank has it mapped (or gave up): nothing is left behind
        if all(a is None for a in answers):
            # Every pid is written now. A rank that cannot see its peers' processes
            # (separate pid namespaces) could not tell a dead peer from a slow one.
            assert exchange is not None  # every rank mapped the file
            blind = not all(_alive(int(pid)) for pid in exchange.pids)
            answers = allgather_object(f"rank {rank} cannot see the other ranks' processes" if blind else None)
        refusals = [a for a in answers if a is not None]
        return (None, str(refusals[0])) if refusals else (exchange, None)

    # ----- the exchange -----------------------------------------------------
    def average_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Average a contiguous tensor in place across the ranks; returns it."""
        flat = tensor.view(-1)
        per_chunk = self.chunk // flat.element_size()
        for start in range(0, flat.numel(), per_chunk):
            self._average_chunk(flat[start : start + per_chunk])
        return tensor

    def _average_chunk(self, part: torch.Tensor) -> None:
        self.seq += 1
        nbytes = part.numel() * part.element_size()
        slots = self.slots[self.seq % 2, :, :nbytes].view(part.dtype)  # (world_size, numel)
        torch.div(part, self.world_size, out=slots[self.rank])
        self.progress[self.rank] = self.seq  # publish only after the slot is written (x86 store order)
        self._wait_for_all(self.progress, self.seq, "the shared-memory gradient exchange")
        torch.add(slots[0], slots[1], out=part)
        for other in range(2, self.world_size):
            part.add_(slots[other])

    def allreduce_small_async(self, tensor: torch.Tensor, op: str) -> Callable[[], torch.Tensor]:
        """Start a ``sum``, ``mean`` or ``max`` allreduce of a CPU tensor of at most MAILBOX_VALUES
        elements; the returned function waits for it and gives the result (the same bits on every rank)."""
        assert tensor.numel() <= MAILBOX_VALUES and op in ("sum", "mean", "max"), (tensor.shape, op)
        if self.small_pending is not None:
            self.small_pending()  # the two mailbox sets are safe only if each allreduce ends before the next
        self.small_seq += 1
        seq, n = self.small_seq, tensor.numel()
        boxes, numbers = self.mail_values[seq % 2], self.mail_seq[seq % 2]
        boxes[self.rank, :n] = tensor.detach().reshape(-1).double()
        numbers[self.rank] = seq  # publish only after the values are written (x86 store order)
        result: List[torch.Tensor] = []

        def wait() -> torch.Tensor:
            if not result:
                self._wait_for_all(numbers, seq, "a shared-memory allreduce")
                values = boxes[:, :n].clone()  # every rank reduces the same values in the same order
                total = values.amax(0) if op == "max" else values.sum(0)
                result.append((total / self.world_size if op == "mean" else total).to(tensor.dtype).view_as(tensor))
                self.small_pending = None
            return result[0]

        self.small_pending = wait
        return wait

    def _wait_for_all(self, counters: torch.Tensor, seq: int, what: str) -> None:
        """Return once every rank's ``counters`` entry is at least ``seq``; raise PeerGone instead of hanging."""
        if int(counters.min()) >= seq:
            return
        started = time.monotonic()
        next_check, pause = started + LIVENESS_EVERY, 0.0
        while int(counters.min()) < seq:
            now = time.monotonic()
            if now - started < SPIN_SECONDS:
                os.sched_yield()
                continue
            if now >= next_check:
                self._fail_if_peers_gone(counters, seq, now - started, what)
                next_check = now + LIVENESS_EVERY
            pause = min(max(pause * 2, 50e-6), 1e-3)
            time.sleep(pause)

    def _fail_if_peers_gone(self, counters: torch.Tensor, seq: int, waited: float, what: str) -> None:
        missing = [r for r in range(self.world_size) if int(counters[r]) < seq]
        gone = [r for r in missing if not _alive(int(self.pids[r]))]
        if gone:
            raise PeerGone(
                f"rank {self.rank}: rank(s) {_names(gone)} exited during {what} "
                f"(connection closed by peer); see their log"
            )
        if waited > self.timeout:
            raise PeerGone(
                f"rank {self.rank}: rank(s) {_names(missing)} did not reach {what}: timed out after {self.timeout:.0f}s"
            )


def _whole_pages(nbytes: int) -> int:
    """``nbytes`` rounded up to 4 KiB pages, so that the next part of the file starts page-aligned."""
    return -(-nbytes // 4096) * 4096


def _map(path: str, size: int) -> torch.Tensor:
    """The existing file at ``path``, mapped shared, as a uint8 tensor (never creates the file)."""
    fd = os.open(path, os.O_RDWR)
    try:
        mapping = mmap.mmap(fd, size)  # MAP_SHARED: writes are seen by every rank
    finally:
        os.close(fd)
    return torch.frombuffer(mapping, dtype=torch.uint8)  # the tensor keeps the mapping alive


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie awaiting its launcher counts as exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return True  # no /proc: existence is all we know


def _names(ranks: List[int]) -> str:
    return ", ".join(str(r) for r in ranks)
