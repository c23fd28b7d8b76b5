"""Every random stream a training run draws from: seed them, save them, put them back.

Dropout masks, noise and augmentation done in the main process draw from torch's
generators (CPU and CUDA), Python's ``random`` and numpy's global generator. A run
resumes bitwise only if all of them continue where they stopped.
"""

from __future__ import annotations

import contextlib
import random
from typing import Any, Dict, Iterator, Tuple, cast

import torch

try:
    import numpy
except ImportError:  # torch runs without numpy; then there is no numpy stream to keep
    numpy = None  # type: ignore[assignment]


def seed_host(seed: int) -> None:
    """Seed the host's generators with ``seed``: torch's CPU one, Python's ``random`` and numpy's global one."""
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    if numpy is not None:
        numpy.random.seed(seed % 2**32)


def seed_everything(seed: int) -> None:
    """:func:`seed_host`, and every GPU's generator."""
    seed_host(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


@contextlib.contextmanager
def host_streams_kept() -> Iterator[None]:
    """Run the block, then put the host's generators back where they were (the GPUs' are left alone)."""
    saved = torch.get_rng_state(), random.getstate(), numpy.random.get_state() if numpy is not None else None
    try:
        yield
    finally:
        torch.set_rng_state(saved[0])
        random.setstate(saved[1])
        if numpy is not None:
            numpy.random.set_state(saved[2])


def rng_state() -> Dict[str, Any]:
    """This rank's random streams (dropout masks, noise, augmentation in the main process), as ``load`` reads them.

    ``torch``: the CPU generator, followed by CUDA's when present; ``python`` and
    ``numpy``: their global generators, as plain numbers and tensors (weights_only).
    """
    state: Dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["torch"] = torch.cat([state["torch"], torch.cuda.get_rng_state()])
    state["python"] = random.getstate()
    if numpy is not None:
        _, key, pos, has_gauss, gauss = cast(Tuple[str, Any, int, int, float], numpy.random.get_state(legacy=True))
        state["numpy"] = {
            "key": torch.from_numpy(key.astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        }
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Put back what :func:`rng_state` returned (older checkpoints hold only ``torch``)."""
    cpu = torch.get_rng_state()
    saved = state["torch"]
    torch.set_rng_state(saved[: len(cpu)].cpu())
    if torch.cuda.is_available() and len(saved) > len(cpu):
        torch.cuda.set_rng_state(saved[len(cpu) :].cpu())
    if state.get("python") is not None:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if numpy is not None and state.get("numpy") is not None:
        saved_np = state["numpy"]
        numpy.random.set_state(
            (
                "MT19937",
                saved_np["key"].cpu().numpy().astype("uint32"),
                saved_np["pos"],
                saved_np["has_gauss"],
                saved_np["gauss"],
            )
        )
