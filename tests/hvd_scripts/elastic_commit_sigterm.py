"""SIGTERM right after ``state.commit()`` returns: the commit still reaches the commit file.

torchrun stops the surviving workers with SIGTERM as soon as one fails; rank 0 writes
the commit file on a thread, so the signal can arrive mid-write. Run as plain python
with TRAINBRIDGE_ELASTIC_DIR set (a job of size 1: rank 0 writes). Prints
``COMMITTED epoch=3 write_in_flight=<bool>``, then signals itself; the test then reads the file.
"""
import os
import signal
import time

import torch

import trainbridge.hvd as hvd
from trainbridge.hvd.elastic import commit_file

hvd.init()
model = torch.nn.Linear(4096, 8192)  # 128 MiB of weights: a write that takes a while
state = hvd.elastic.TorchState(model=model, epoch=0)
for epoch in (1, 2, 3):
    with torch.no_grad():
        model.weight.fill_(epoch)
    state.epoch = epoch
    state.commit()
in_flight = commit_file.writer._thread is not None and commit_file.writer._thread.is_alive()
print(f"COMMITTED epoch=3 write_in_flight={in_flight}", flush=True)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(60)  # the signal ends the process before this does
print("NOT STOPPED", flush=True)
