"""examples/own_loop.py, with some ranks held after one step until they have received SIGTERM.

The example trains its 300 steps in about 1.5 s. A test that signals a rank after seeing a
log line can, on a loaded machine, be later than that: the signal then lands after training
and the job ends normally, as if it had ignored it (the cause of a flaky SIGTERM test). Here
the ranks listed in HOLD_RANKS wait after step HOLD_STEP (up to 60 s) for their SIGTERM, so
the signal always arrives mid-training. The arithmetic is the example's own: the weights are
bitwise those of an unheld run.

The example's code runs in this module's own namespace (not with runpy), so that under
``--nproc N`` (``tb.spawn``, start method "spawn") each worker re-imports this file, patch
included, and finds the example's ``main`` here, without starting workers of its own.
"""
import os
import sys
import time
from pathlib import Path

import trainbridge.api.job as job_module

OWN_LOOP = str(Path(__file__).resolve().parents[2] / "examples" / "own_loop.py")
HOLD_STEP = 30
HOLD_RANKS = {int(rank) for rank in os.environ["HOLD_RANKS"].split(",")}
unheld_step = job_module.Job.step


def held_step(self, optimizer):
    unheld_step(self, optimizer)
    # Held in the first attempt only: one that torchrun restarted (--max-restarts) trains through.
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if self._steps == HOLD_STEP and self.rank in HOLD_RANKS and first_attempt:
        print(f"rank {self.rank} holds after step {HOLD_STEP} until SIGTERM", flush=True)
        deadline = time.monotonic() + 60
        while not self._stop.received and time.monotonic() < deadline:
            time.sleep(0.01)


job_module.Job.step = held_step
if __name__ == "__main__":
    sys.argv = [OWN_LOOP, *sys.argv[1:]]
exec(compile(Path(OWN_LOOP).read_text(), OWN_LOOP, "exec"))  # its __main__ block runs in the launched process only
