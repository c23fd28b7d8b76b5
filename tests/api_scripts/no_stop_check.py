"""A loop that never calls job.should_stop(): SIGTERM must still end it, as it would without trainbridge."""
import time

import trainbridge as tb

job = tb.init()
job.print("training")
for _step in range(600):  # a minute of "training"
    time.sleep(0.1)
    job.heartbeat()
job.print("finished")
job.exit(0)
