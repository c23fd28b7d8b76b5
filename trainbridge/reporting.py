"""What the main rank shows and writes: the progress bar and metrics.jsonl."""
from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict, Iterable, Optional

from tqdm import tqdm


class MetricsLog:
    """Appends one JSON object per line to ``DIR/metrics.jsonl``; a no-op off the main rank."""

    def __init__(self, output_dir: str, enabled: bool) -> None:
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.enabled = enabled
        if enabled:
            os.makedirs(output_dir, exist_ok=True)
            open(self.path, "w").close()  # a new run starts a new log

    def write(self, row: Dict[str, Any]) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")


def progress(iterable: Iterable, total: int, description: str, enabled: bool) -> Any:
    """tqdm on an interactive terminal of the main rank; the bare iterable elsewhere."""
    show = enabled and sys.stdout.isatty()
    return tqdm(iterable, total=total, desc=description, leave=False, dynamic_ncols=True) if show else iterable


def set_postfix(bar: Any, **values: Optional[float]) -> None:
    if isinstance(bar, tqdm):
        bar.set_postfix({k: f"{v:.4f}" for k, v in values.items() if v is not None}, refresh=False)
