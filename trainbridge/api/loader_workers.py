"""DataLoader workers that leave stopping to their rank, and never outlive it.

SLURM, Kubernetes and torchrun signal every process of a job (the process group,
or each process of a step), DataLoader workers included. torch's worker handler
dies by a SIGTERM from anyone but its parent, and the rank's loader then raises
"DataLoader worker (pid N) is killed by signal: Terminated" before the rank could
agree on a stop step and save. So workers ignore SIGTERM: their rank receives it
too, stops at an agreed step and shuts its workers down.

A worker must also not outlive its rank: one stuck in a lock keeps the launcher's
output pipe open, and the job never ends. Workers forked by the main thread get
SIGKILL when their rank dies (``PR_SET_PDEATHSIG``; the kernel ties it to the
forking thread, so not for loaders iterated on other threads), and a rank that
ends itself abnormally (the watchdog, a failure) kills its workers first
(:func:`kill_workers`).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

PR_SET_PDEATHSIG = 1


def _libc_prctl() -> Optional[Callable[..., int]]:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# Looked up here, in the rank, once: a worker that called dlopen itself right after the fork
# would hang for ever if another thread of its rank held the dynamic loader's lock when it forked.
_PRCTL = _libc_prctl() if sys.platform.startswith("linux") else None


class WorkerSetup:
    """A ``worker_init_fn``: the signal set-up above, then the user's own ``worker_init_fn``."""

    def __init__(self, user_init: Optional[Callable[[int], None]] = None) -> None:
        self.user_init = user_init
        self.die_with_parent = False

    def before_fork(self) -> None:
        """Called by the loader just before it forks its workers, in the thread that forks them."""
        self.die_with_parent = threading.current_thread() is threading.main_thread()

    def __call__(self, worker_id: int) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if self.die_with_parent and _PRCTL is not None:
            parent = os.getppid()
            _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != parent:  # the rank died before the line above
                os._exit(1)
        if self.user_init is not None:
            self.user_init(worker_id)


def with_worker_setup(options: Dict[str, Any]) -> Optional[WorkerSetup]:
    """Put a :class:`WorkerSetup` in the DataLoader ``options`` when they start workers; it, or None."""
    if options.get("num_workers", 0) <= 0:
        return None
    setup = WorkerSetup(options.get("worker_init_fn"))
    options["worker_init_fn"] = setup
    return setup


def _live_workers() -> List[int]:
    """The pids of this process's daemonic children: its loaders' DataLoader workers."""
    try:
        return [child.pid for child in multiprocessing.active_children() if child.daemon and child.pid is not None]
    except Exception:  # noqa: BLE001 - on the way out: never raise over the failure being reported
        return []


def describe_workers() -> str:
    """Where each DataLoader worker of this process waits, for a rank that is about to end because its
    workers never delivered: per thread, its state, kernel wait and the library its instruction pointer is
    in (read from /proc, which needs no unwinding); then py-spy's dump of its stacks where py-spy is
    installed (native frames, or the Python ones where the unwinder fails on them, as seen: UNW_EBADREG).
    The worker that never delivered usually has one thread; one that did also runs its queue's feeder."""
    parts = []
    for pid in _live_workers():
        parts.append(f"DataLoader worker {pid}:\n" + "\n".join(f"  {line}" for line in _thread_waits(pid)))
        py_spy = _tool("py-spy")
        if py_spy is not None:
            for native in (["--native"], []):
                ok, dump = _run([py_spy, "dump", *native, "--pid", str(pid)])
                if ok:
                    break
            parts.append(f"DataLoader worker {pid}, py-spy dump:\n{dump}")
        else:
            parts.append("(pip install py-spy for the workers' stacks)")
    return "\n".join(parts)


def _tool(name: str) -> Optional[str]:
    return shutil.which(name, path=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))


def _run(command: List[str]) -> Tuple[bool, str]:
    """Whether ``command`` exited 0, and its output; never raises (on the way out)."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30)
        return done.returncode == 0, done.stdout + done.stderr
    except (OSError, subprocess.SubprocessError) as e:
        return False, str(e)


def _thread_waits(pid: int) -> List[str]:
    """One line per thread of ``pid``: state, kernel wait channel, system call and the mapped file its
    instruction pointer is in."""
    lines = []
    try:
        maps = _executable_maps(pid)
        for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
            task = f"/proc/{pid}/task/{tid}"
            state = _read(f"{task}/stat").rsplit(")", 1)[-1].split()[:1]
            syscall = _read(f"{task}/syscall").split()
            where = ""
            if len(syscall) >= 3 and syscall[-1].startswith("0x"):
                ip = int(syscall[-1], 16)
                where = next((name for low, high, name in maps if low <= ip < high), "an unmapped address")
            lines.append(
                f"thread {tid}: state {''.join(state) or '?'}, waits in {_read(f'{task}/wchan') or 'nothing'}, "
                f"syscall {syscall[0] if syscall else '?'}, at {hex(ip) if where else '?'} in {where or '?'}"
            )
    except OSError:
        lines.append("gone")
    return lines


def _executable_maps(pid: int) -> List[tuple]:
    spans = []
    for line in _read(f"/proc/{pid}/maps").splitlines():
        fields = line.split()
        if len(fields) >= 6 and "x" in fields[1]:
            low, high = (int(x, 16) for x in fields[0].split("-"))
            spans.append((low, high, fields[5]))
    return spans


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def kill_workers() -> None:
    """SIGKILL this process's daemonic children (DataLoader workers) as it leaves, as Python's exit would end them."""
    if threading.current_thread() is threading.main_thread():
        # A live loader's SIGCHLD handler would read the kill as a worker that failed and raise
        # "DataLoader worker (pid N) is killed by signal" over a rank that had finished (seen: 1 run in 60).
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for pid in _live_workers():
        try:
            os.kill(pid, signal.SIGKILL)
        except (OSError, TypeError):
            pass
