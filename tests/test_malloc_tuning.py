"""--malloc-tuning: glibc keeps large blocks in the heap in every rank, unless the user chose otherwise.

The effect is observed in glibc itself (``mallinfo2``: how many blocks are
mmapped), in a fresh interpreter each time, so that the test fails if the
settings are not applied or do not do what trainbridge/malloc_tuning.py says.
"""
import subprocess
import textwrap

import pytest
from conftest import PYTHON, check, launcher_env, run, torchrun

from trainbridge.launch.malloc_tuning import MMAP_THRESHOLD_BYTES, tune_malloc, user_allocator_choice

SHORT_RUN = ["--model", "plaincnn", "--dataset", "mnist-sample", "--batch-size", "32", "--max-steps", "2",
             "--no-progress"]

# A fresh process allocates 8 MiB with malloc and prints how many mmapped blocks
# glibc holds before and after. glibc's dynamic threshold starts at 128 KiB, so
# untuned the block is mmapped; tuned (32 MiB), it comes from the heap.
MALLOC_8_MIB = textwrap.dedent("""
    import ctypes, sys
    from trainbridge.launch.malloc_tuning import tune_malloc
    class Mallinfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = Mallinfo2
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    if sys.argv[1] == "tuned":
        assert tune_malloc("auto", {})[0]
    before = libc.mallinfo2().hblks
    block = libc.malloc(8 << 20)
    print(before, libc.mallinfo2().hblks)
""")


def mmapped_blocks_around_an_8_mib_malloc(mode: str):
    out = subprocess.run([PYTHON, "-c", MALLOC_8_MIB, mode], capture_output=True, text=True, timeout=60,
                         env=launcher_env())
    assert out.returncode == 0, out.stderr
    before, after = map(int, out.stdout.split())
    return before, after


def test_tuned_glibc_serves_large_blocks_from_the_heap():
    assert 8 << 20 < MMAP_THRESHOLD_BYTES
    before, after = mmapped_blocks_around_an_8_mib_malloc("default")
    assert after == before + 1  # glibc's default: a fresh mmap (else this test could not fail)
    before, after = mmapped_blocks_around_an_8_mib_malloc("tuned")
    assert after == before


@pytest.mark.parametrize("env, chosen", [
    ({}, None),
    ({"MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_"),
    ({"MALLOC_MMAP_THRESHOLD_": "131072"}, "MALLOC_MMAP_THRESHOLD_"),
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "GLIBC_TUNABLES"),
    ({"GLIBC_TUNABLES": "glibc.rtld.nns=8"}, None),
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "LD_PRELOAD (jemalloc)"),
    ({"LD_PRELOAD": "/opt/gperftools/lib/libtcmalloc_minimal.so"}, "LD_PRELOAD (tcmalloc)"),
])
def test_the_users_own_allocator_settings_are_kept(env, chosen):
    assert user_allocator_choice(env) == chosen
    if chosen:
        assert tune_malloc("auto", env) == (False, f"the user's {chosen}")


def test_malloc_tuning_off_changes_nothing():
    assert tune_malloc("off", {}) == (False, 'malloc_tuning="off"')


def test_a_launched_job_applies_and_reports_the_setting(tmp_path, short_sgd_torchrun_run):
    # A torchrun job with glibc's defaults: conftest's session run (test_speed_features' fp32 reference).
    _, tuned = short_sgd_torchrun_run
    assert "malloc tuned: mmap threshold 32 MiB, trim threshold 1 GiB" in tuned.stdout
    kept = check(run(torchrun(2, SHORT_RUN + ["--output-dir", str(tmp_path / "kept")]), timeout=180,
                     env={"MALLOC_TRIM_THRESHOLD_": "131072"}))
    assert "malloc left as is: the user's MALLOC_TRIM_THRESHOLD_" in kept.stdout
