"""glibc malloc settings for training processes: large blocks from the heap, the heap never trimmed.

glibc serves a request above its mmap threshold with a fresh ``mmap`` and gives
it back with ``munmap`` on free. The threshold starts at 128 KiB and moves up
each time such a block is freed, so two processes running the same loop can sit
in different modes depending on their history: one reuses its activation and
gradient buffers from the heap, the other maps, zero-faults and unmaps them
every step. On the 2-core CPU machines of benchmarks/RESULTS.md this showed as
bimodal step times, 10-20% apart, in trainbridge and in the bare loop alike.
Fixing the threshold at 32 MiB (glibc's own upper bound for the dynamic one) and
keeping freed memory in the heap (trim threshold 1 GiB) puts every process in
the fast mode from its first step; the mmap threshold alone is slower than the
default, because the heap is then trimmed after each large free.

This is what ``MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824``
do at start-up; ``mallopt`` applies it from inside the process, which is the only
place every launcher (torchrun, horovodrun, mpirun, srun, python) lets us reach.
A user who chose their own allocator settings (those variables, ``GLIBC_TUNABLES``
for malloc, or a preloaded jemalloc/tcmalloc/mimalloc) keeps them.
"""

from __future__ import annotations

import ctypes
from typing import Mapping, Optional, Tuple

# mallopt parameters from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 1 << 30
SETTINGS = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))

USER_MALLOC_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


def user_allocator_choice(env: Mapping[str, str]) -> Optional[str]:
    """What in ``env`` shows the user chose their own allocator settings, or None."""
    for name in USER_MALLOC_VARIABLES:
        if name in env:
            return name
    if "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    preload = env.get("LD_PRELOAD", "")
    for allocator in OTHER_ALLOCATORS:
        if allocator in preload:
            return f"LD_PRELOAD ({allocator})"
    return None


def glibc_mallopt():
    """glibc's ``mallopt``, or None where the C library is another (musl, macOS)."""
    try:
        libc = ctypes.CDLL(None)  # the symbols already loaded: the process's own C library
        if not hasattr(libc, "gnu_get_libc_version"):
            return None
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt


def tune_malloc(mode: str, env: Mapping[str, str]) -> Tuple[bool, str]:
    """Apply :data:`SETTINGS` unless ``mode`` is "off" or the user chose otherwise; returns (applied, why)."""
    if mode == "off":
        return False, 'malloc_tuning="off"'
    chosen = user_allocator_choice(env)
    if chosen:
        return False, f"the user's {chosen}"
    mallopt = glibc_mallopt()
    if mallopt is None:
        return False, "not glibc"
    # mallopt returns 1 on success; a rejected value leaves glibc's default in place.
    if not all(mallopt(param, value) == 1 for param, value in SETTINGS):
        return False, "mallopt refused"
    return True, f"mmap threshold {MMAP_THRESHOLD_BYTES >> 20} MiB, trim threshold {TRIM_THRESHOLD_BYTES >> 30} GiB"
