"""Batches gathered by index from in-memory tensors: no per-sample collate, no PIL."""
from __future__ import annotations

from typing import Iterator, Sequence, Tuple

import torch

from .mnist import Split


def num_batches(num_indices: int, batch_size: int) -> int:
    return (num_indices + batch_size - 1) // batch_size


def iterate_batches(split: Split, indices: Sequence[int], batch_size: int, device: torch.device,
                    skip_batches: int = 0) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``(images, labels)`` for consecutive chunks of ``indices``; the last may be short.

    ``skip_batches`` starts later in the same order (used to resume mid-epoch).
    """
    order = torch.as_tensor(list(indices), dtype=torch.long)
    non_blocking = device.type == "cuda"
    for start in range(skip_batches * batch_size, len(order), batch_size):
        chunk = order[start:start + batch_size].to(split.images.device)
        yield (split.images.index_select(0, chunk).to(device, non_blocking=non_blocking),
               split.labels.index_select(0, chunk).to(device, non_blocking=non_blocking))
