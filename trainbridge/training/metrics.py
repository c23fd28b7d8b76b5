"""What the main rank shows and writes: the progress bar and metrics.jsonl."""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from typing import Any, Dict, Iterable, Optional

from ..optional import require

PROGRESS_BAR = "trainbridge train's progress bar"


class MetricsLog:
    """Appends one JSON object per line to ``DIR/metrics.jsonl``; a no-op off the main rank."""

    def __init__(self, output_dir: str, enabled: bool, append: bool = False) -> None:
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.enabled = enabled
        if enabled:
            os.makedirs(output_dir, exist_ok=True)
            if not append:
                open(self.path, "w").close()  # a new run starts a new log; a resumed one continues it

    def write(self, row: Dict[str, Any]) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")


def progress(iterable: Iterable, total: int, description: str, enabled: bool) -> Any:
    """tqdm on an interactive terminal of the main rank; the bare iterable elsewhere (tqdm is then not imported)."""
    if not (enabled and sys.stdout.isatty()):
        return iterable
    tqdm = require("tqdm", PROGRESS_BAR, instead="or pass --no-progress").tqdm
    return tqdm(iterable, total=total, desc=description, leave=False, dynamic_ncols=True)


def set_postfix(bar: Any, **values: Optional[float]) -> None:
    """Show ``values`` beside the progress bar; nothing when there is none."""
    if hasattr(bar, "set_postfix"):
        bar.set_postfix({k: f"{v:.4f}" for k, v in values.items() if v is not None}, refresh=False)


class StepTimer:
    """Wall time of each optimizer step after a warm-up, for throughput and step-time percentiles.

    Timing the gap between steps needs no device sync: on a GPU the queue
    back-pressure makes the average honest over many steps.
    """

    def __init__(self, warmup_steps: int = 5) -> None:
        self.warmup_steps = warmup_steps
        self.durations: list = []
        self.samples_after_warmup = 0
        self._last: Optional[float] = None
        self._steps = 0
        self.first_step_at: Optional[float] = None  # Unix time at the end of the first step: start-up cost

    def tick(self, batch_samples: int) -> None:
        now = time.perf_counter()
        if self.first_step_at is None:
            self.first_step_at = time.time()
        if self._last is not None and self._steps >= self.warmup_steps:
            self.durations.append(now - self._last)
            self.samples_after_warmup += batch_samples
        self._last = now
        self._steps += 1

    def pause(self) -> None:
        """Evaluation and logging between epochs are not training steps."""
        self._last = None

    def summary(self) -> Dict[str, Optional[float]]:
        if not self.durations:
            return {"step_time_median": None, "step_time_p90": None, "local_samples_per_second": None}
        ordered = sorted(self.durations)
        return {
            "step_time_median": statistics.median(ordered),
            "step_time_p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
            "local_samples_per_second": self.samples_after_warmup / sum(ordered),
        }


def peak_rss_mb() -> float:
    """This process's peak resident memory, in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
