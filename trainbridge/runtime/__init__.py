"""What the public API (``api/``) and ``trainbridge.hvd`` share, below both of them.

* :mod:`.timeout`: the one timeout, how long a rank waits for the others (default 300 s);
* :mod:`.watchdog`: the thread that checks how long those waits have lasted;
* :mod:`.atomic_files`: files written atomically and durably, one write at a time in the background;
* :mod:`.weights_only`: what ``torch.load(weights_only=True)`` reads back.

Nothing here imports ``api``, ``backends`` or ``hvd``: it sits beside ``launch/``, under them.
"""
