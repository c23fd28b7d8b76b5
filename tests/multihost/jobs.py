"""Commands started on several hosts at once, waited for together, each with a deadline."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .hosts import Host


class HostProcess:
    """One command running on one host, its output in a log file."""

    def __init__(self, host: Host, argv: Sequence[str], log: Path, env: Dict[str, str],
                 cwd: Optional[str] = None) -> None:
        self.host, self.argv, self.log = host, list(argv), log
        self._out = open(log, "w")
        self.proc = subprocess.Popen(host.command(argv), stdout=self._out, stderr=subprocess.STDOUT, text=True,
                                     env=env, cwd=cwd, start_new_session=True)
        self.started = time.monotonic()
        self.ended: Optional[float] = None

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def poll(self) -> Optional[int]:
        code = self.proc.poll()
        if code is not None and self.ended is None:
            self.ended = time.monotonic()
            self._out.close()
        return code

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.poll()

    def describe(self) -> str:
        return (f"--- {self.host.name}: exit {self.proc.returncode}: {' '.join(self.argv)}\n"
                f"{self.output()[-3000:]}")


def wait_all(procs: Sequence[HostProcess], timeout: float) -> Tuple[List[int], Optional[str]]:
    """Exit codes of ``procs``; on timeout every one still running is killed and the second value says so."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            hung = [p for p in procs if p.poll() is None]
            for p in procs:
                p.kill()
            return ([p.proc.returncode for p in procs],
                    f"timed out after {timeout}s (a hang) on {', '.join(p.host.name for p in hung)}:\n"
                    + "\n".join(p.describe() for p in procs))
        time.sleep(0.1)
    return [p.proc.returncode for p in procs], None
