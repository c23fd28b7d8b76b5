"""Background saves of a large state while the loop goes on: python background_save.py DIR STEPS MIB."""
import sys
import time

import torch

import trainbridge as tb

out, steps, mib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
job = tb.init()
big = torch.zeros(mib * 2 ** 18)  # MiB of float32, filled with the step it was saved at
state = {"big": big, "step": 0}
for step in range(1, steps + 1):
    big.fill_(step)
    state["step"] = step
    if job.should_stop():
        job.save(state, f"{out}/last.pt", keep_previous=f"{out}/previous.pt")
        print(f"stopped at step {step}", flush=True)
        job.shutdown()
        sys.exit(143)
    job.save(state, f"{out}/last.pt", keep_previous=f"{out}/previous.pt", background=True)
    big.fill_(-1.0)  # the loop changes the state at once: the write must hold the snapshot
    print(f"submitted step {step}", flush=True)
    time.sleep(0.05)
job.shutdown()
print("done", flush=True)
