"""How busy the GPUs were during one run, read from NVML (``nvidia-ml-py``), launch to exit.

NVML's utilization counter is the percent of its last sample period (1/6 s to
1 s, by GPU) in which at least one kernel ran. Sampled every 0.1 s over a whole
run and averaged over the samples and the machine's GPUs, it is the share of the
run's wall time the GPUs computed: start-up, data loading, evaluation and
checkpoints count as idle, as they do for the user waiting for the run. None
where there is no NVIDIA GPU or no ``nvidia-ml-py`` (the ``bench`` extra).
"""

from __future__ import annotations

import threading
from typing import Any, List, Optional


class GpuBusy:
    """``with GpuBusy() as busy: run()``, then ``busy.fraction`` (0 to 1, or None without NVML)."""

    def __init__(self, interval: float = 0.1) -> None:
        self.interval = interval
        self.samples: List[float] = []
        self._handles: List[Any] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "GpuBusy":
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:  # no package, no driver or no GPU: nothing to measure
            self._handles = []
        if self._handles:
            self._thread = threading.Thread(target=self._sample, name="gpu-busy", daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            rates = [self._nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self._handles]
            self.samples.append(sum(rates) / (100.0 * len(rates)))

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._nvml.nvmlShutdown()

    @property
    def fraction(self) -> Optional[float]:
        return round(sum(self.samples) / len(self.samples), 3) if self.samples else None
