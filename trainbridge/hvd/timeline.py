"""Horovod's timeline: a Chrome-trace JSON file (chrome://tracing, Perfetto) written by rank 0.

``HOROVOD_TIMELINE=<file>`` starts it at ``hvd.init()``; ``HOROVOD_TIMELINE=DYNAMIC`` allows
``hvd.start_timeline(file, mark_cycles)`` / ``hvd.stop_timeline()`` only, as in Horovod (which raises
ValueError for start_timeline without the variable). The file has Horovod 0.28.1's format: each operation
is a trace "process" named ``<kind>.<name>`` (``allreduce.grad.fc1``, ``allreduce.noname.3``) with:

* ``NEGOTIATE_<KIND>``, from the cycle in which rank 0 first saw the operation announced to the cycle in
  which every rank had, with an instant (``X``) named after each rank when its announcement arrived;
* ``<KIND>`` (``ALLREDUCE``, ``BROADCAST``, ...), the operation itself, made of ``QUEUE`` (decided, waiting
  for the operations ahead of it in its cycle), ``MEMCPY_IN_FUSION_BUFFER`` and ``MEMCPY_OUT_FUSION_BUFFER``
  around a fused buffer, and the collective: ``GLOO_ALLREDUCE``, ``NCCL_ALLREDUCE``, ``GLOO_BCAST``,
  ``GLOO_ALLGATHER``, ``MPI_ALLTOALL`` (Horovod's name for its gloo alltoall too), ``GLOO_REDUCESCATTER``,
  ... Its end carries the result's dtype and shape;
* ``CYCLE_START`` instants when cycles are marked (``HOROVOD_TIMELINE_MARK_CYCLES=1``, or
  ``start_timeline(..., mark_cycles=True)``).

Times are microseconds since the timeline was created (``hvd.init()``); the first record gives that moment
since the epoch. A thread of its own writes the events every 50 ms, so the engine only appends to a list,
and the file is valid JSON after every write (it ends in ``]``). ``stop_timeline()`` and ``hvd.shutdown()``
write what is left and close it.
"""

from __future__ import annotations

import json
import threading
import time
from typing import IO, Dict, List, Optional, Sequence, Set

import torch

FLUSH_INTERVAL_S = 0.05

# The collective's activity name, by operation kind and device type (Horovod's names).
COLLECTIVES = {
    ("allreduce", "cpu"): "GLOO_ALLREDUCE",
    ("allreduce", "cuda"): "NCCL_ALLREDUCE",
    ("allgather", "cpu"): "GLOO_ALLGATHER",
    ("allgather", "cuda"): "NCCL_ALLGATHER",
    ("broadcast", "cpu"): "GLOO_BCAST",
    ("broadcast", "cuda"): "NCCL_BCAST",
    ("alltoall", "cpu"): "MPI_ALLTOALL",
    ("alltoall", "cuda"): "NCCL_ALLTOALL",
    ("reducescatter", "cpu"): "GLOO_REDUCESCATTER",
    ("reducescatter", "cuda"): "NCCL_REDUCESCATTER",
}


def display_name(kind: str, name: str) -> str:
    """Horovod's name of an operation in the timeline: the kind, then the name."""
    return name if name.startswith(f"{kind}.noname.") else f"{kind}.{name}"


def _shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(n) for n in shape) + "]"


class Timeline:
    """Rank 0's timeline; every method may be called from any engine thread."""

    def __init__(self, path: Optional[str], mark_cycles: bool = False) -> None:
        """A timeline clock started now; ``path`` None or "" writes nothing until :meth:`start`."""
        self._started = time.monotonic()
        self._epoch_us = time.time_ns() // 1000
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._file: Optional[IO[bytes]] = None
        self._pending: List[str] = []
        self._pids: Dict[str, int] = {}
        self._negotiating: Set[str] = set()
        self._activity: Dict[str, str] = {}  # operation -> the activity open in it
        self.mark_cycles = mark_cycles
        self._closing = False
        self._writer = threading.Thread(target=self._write_loop, name="trainbridge-hvd-timeline", daemon=True)
        self._writer.start()
        if path:
            self.start(path, mark_cycles)

    # ----- file ------------------------------------------------------------
    def start(self, path: str, mark_cycles: bool = False) -> None:
        """Write to ``path`` from now on (the file written so far is finished and closed first)."""
        self.stop()
        with self._lock:
            file = self._file = open(path, "wb")  # noqa: SIM115 - open until stop()
            self._pids, self._negotiating, self._activity = {}, set(), {}
            self._pending = [
                '{"name": "process_name", "ph": "M", "pid": 0, "args": {"start_time_since_epoch_in_micros":'
                f"{self._epoch_us}}}}},\n",
                '{"name": "process_sort_index", "ph": "M", "pid": 0, "args": {"sort_index": 0}},\n',
            ]
            file.write(b"[\n")
            self.mark_cycles = mark_cycles

    def stop(self) -> None:
        """Write what is left and close the file (nothing happens if none is open)."""
        with self._lock:
            if self._file is None:
                return
            self._flush()
            self._file.close()
            self._file = None

    def close(self) -> None:
        """Stop, and end the writer thread (``hvd.shutdown()``)."""
        self.stop()
        with self._lock:
            self._closing = True
            self._wake.notify()
        self._writer.join()

    @property
    def recording(self) -> bool:
        return self._file is not None

    def _write_loop(self) -> None:
        with self._lock:
            while not self._closing:
                self._wake.wait(timeout=FLUSH_INTERVAL_S)
                if self._file is not None:
                    self._flush()

    def _flush(self) -> None:
        """Append the pending events so that the file ends in ``]``; holds the lock."""
        assert self._file is not None
        if not self._pending:
            return
        text = "".join(self._pending)
        self._pending = []
        if self._file.tell() > 2:  # past "[\n": replace the closing "]" by the separator
            self._file.seek(-1, 2)
            self._file.write(b",")
        # Each event text ends in ",\n" or "," (metadata lines end a line, as Horovod writes them): the
        # last separator becomes the closing bracket.
        self._file.write(text.rstrip("\n")[:-1].encode() + b"]")
        self._file.flush()

    # ----- events ----------------------------------------------------------
    def _now(self) -> int:
        return int((time.monotonic() - self._started) * 1e6)

    def _pid(self, name: str) -> int:
        """The trace process of operation ``name`` (registered on first use, as Horovod does); holds the lock."""
        pid = self._pids.get(name)
        if pid is None:
            pid = self._pids[name] = len(self._pids) + 1
            label = json.dumps(name)
            self._pending.append(
                f'{{"name": "process_name", "ph": "M", "pid": {pid}, "args": {{"name": {label}}}}},\n'
                f'{{"name": "process_sort_index", "ph": "M", "pid": {pid}, "args": {{"sort_index": {pid}}}}},\n'
            )
        return pid

    def _event(self, name: str, phase: str, label: str = "", args: str = "") -> None:
        """One event of operation ``name``; holds the lock."""
        pid = self._pid(name)
        text = f'{{"ph": "{phase}"'
        if phase != "E":
            text += f', "name": {json.dumps(label)}'
        text += f', "ts": {self._now()}, "pid": {pid}'
        if phase == "X":
            text += ', "dur": 0'
        if args:
            text += f', "args": {{{args}}}'
        self._pending.append(text + "},")

    def cycle_start(self) -> None:
        if self.mark_cycles and self._file is not None:
            with self._lock:
                self._pending.append(f'{{"ph": "i", "name": "CYCLE_START", "ts": {self._now()}, "s": "g"}},')

    def announced(self, name: str, kind: str, rank: int) -> None:
        """``rank``'s announcement of ``name`` arrived: negotiation starts (first rank) or goes on."""
        if self._file is None:
            return
        with self._lock:
            if name not in self._negotiating:
                self._negotiating.add(name)
                self._event(name, "B", f"NEGOTIATE_{kind.upper()}")
            self._event(name, "X", str(rank))

    def decided(self, name: str, kind: str, runs: bool) -> None:
        """Every rank announced ``name``: negotiation ends; if it ``runs``, the operation begins (queued)."""
        if self._file is None:
            return
        with self._lock:
            if name in self._negotiating:
                self._negotiating.discard(name)
                self._event(name, "E")
            if runs:
                self._event(name, "B", kind.upper())
                self._event(name, "B", "QUEUE")
                self._activity[name] = "QUEUE"

    def activity(self, names: Sequence[str], activity: Optional[str]) -> None:
        """Each operation of ``names`` ends its current activity and, unless ``activity`` is None, starts it."""
        if self._file is None:
            return
        with self._lock:
            for name in names:
                if self._activity.pop(name, None) is not None:
                    self._event(name, "E")
                if activity is not None:
                    self._event(name, "B", activity)
                    self._activity[name] = activity

    def finished(self, name: str, result: object) -> None:
        """``name`` finished with ``result`` (a tensor, or a tuple that starts with one)."""
        if self._file is None:
            return
        if isinstance(result, tuple) and result:
            result = result[0]
        args = ""
        if isinstance(result, torch.Tensor):
            args = f'"dtype": "{str(result.dtype).replace("torch.", "")}", "shape": "{_shape(result.shape)}"'
        with self._lock:
            if self._activity.pop(name, None) is not None:
                self._event(name, "E")
            self._event(name, "E", args=args)
