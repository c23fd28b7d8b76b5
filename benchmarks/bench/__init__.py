"""The peer bench (``python -m benchmarks`` in a source checkout): trainbridge against hand-written
baselines and its peers, in one invocation.

Where each concern lives:

* :mod:`.workloads` -- what is trained (model, data, optimizer, batch, steps).
  A new workload is one entry in ``WORKLOADS``.
* :mod:`.configs`   -- the configuration matrix: which launcher starts which
  script with how many processes and threads.
* :mod:`.measure`   -- the instrument shared by trainbridge and the baselines
  (step timer, peak RSS, the ``final`` line of ``metrics.jsonl``).
* :mod:`.runner`    -- starts each configuration under its real launcher, with a
  timeout, repeats interleaved; aggregates medians.
* :mod:`.targets`   -- the speed targets, as ratios inside one run.
* :mod:`.report`    -- ``bench.json``, ``bench.md`` and ``bench.png``.
* :mod:`.cli`       -- the ``python -m benchmarks`` command.

The baselines themselves are plain scripts in ``benchmarks/baselines/``. The bench
lives beside them, outside the installed package: it needs the checkout's baselines
and the ``bench`` extra, and no user of the library imports it.
"""
