"""What the public API (``api/``) and ``trainbridge.hvd`` share, below both of them.

* :mod:`.timeout`: the one timeout, how long a rank waits for the others (default 300 s);
* :mod:`.watchdog`: the thread that checks how long those waits have lasted;
* :mod:`.atomic_files`: files written atomically and durably, one write at a time in the background;
* :mod:`.safe_files`: files made without following links, folders checked for their owner;
* :mod:`.weights_only`: what ``torch.load(weights_only=True)`` reads back;
* :mod:`.gloo_threads`: a Python thread state kept by each of gloo's worker threads, so that a
  DataLoader worker forked beside them cannot deadlock (Python < 3.11.10).

Nothing here imports ``api``, ``backends`` or ``hvd``: it sits beside ``launch/``, under them.
"""
