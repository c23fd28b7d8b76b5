"""Horovod's runtime variables: each honoured with Horovod's default, or refused in one line naming it."""
import pytest

from trainbridge.errors import UserError
from trainbridge.hvd import settings
from trainbridge.hvd.settings import REFUSED, Settings, read

# A value of each refused variable that asks for what the torch backend does not do.
ASKING = {name: "1" for name in REFUSED} | {
    "HOROVOD_AUTOTUNE_LOG": "/tmp/autotune.csv",
    "HOROVOD_CPU_OPERATIONS": "MPI",
    "HOROVOD_CONTROLLER": "mpi",
    "HOROVOD_NUM_NCCL_STREAMS": "2",
    "HOROVOD_DISABLE_NVTX_RANGES": "0",
    "HOROVOD_THREAD_AFFINITY": "0,1",
    "HOROVOD_ADASUM_MPI_CHUNK_SIZE": "1048576",
}
# The values that describe what the torch backend does anyway.
ACCEPTED = {
    "HOROVOD_AUTOTUNE": "0",
    "HOROVOD_HIERARCHICAL_ALLREDUCE": "0",
    "HOROVOD_HIERARCHICAL_ALLGATHER": "0",
    "HOROVOD_TORUS_ALLREDUCE": "0",
    "HOROVOD_CPU_OPERATIONS": "gloo",
    "HOROVOD_CONTROLLER": "GLOO",
    "HOROVOD_NUM_NCCL_STREAMS": "1",
    "HOROVOD_BATCH_D2D_MEMCOPIES": "0",
    "HOROVOD_DISABLE_NVTX_RANGES": "1",
    "HOROVOD_ELASTIC": "0",
}


def test_defaults_are_horovods():
    assert read({}) == Settings(fusion_bytes=128 * 1024 * 1024, cycle_time_s=0.001, timeline=None, log_level="warning",
                                cache_capacity=1024)


def test_honoured_variables():
    got = read({"HOROVOD_FUSION_THRESHOLD": "0", "HOROVOD_CYCLE_TIME": "2.5", "HOROVOD_TIMELINE": "/tmp/t.json",
                "HOROVOD_TIMELINE_MARK_CYCLES": "1", "HOROVOD_DISABLE_GROUP_FUSION": "1",
                "HOROVOD_LOG_LEVEL": "DEBUG", "HOROVOD_LOG_HIDE_TIME": "1", "HOROVOD_GLOO_IFACE": "eth1",
                "HOROVOD_CACHE_CAPACITY": "0"})
    assert got == Settings(fusion_bytes=0, cycle_time_s=0.0025, timeline="/tmp/t.json", mark_cycles=True,
                           group_fusion=False, log_level="debug", log_time=False, gloo_iface="eth1", cache_capacity=0)
    assert read({"HOROVOD_TIMELINE": "DYNAMIC"}).timeline == ""


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_each_variable_that_asks_for_what_the_torch_backend_does_not_do_is_refused_naming_it(name):
    with pytest.raises(UserError) as refused:
        read({name: ASKING[name]})
    message = str(refused.value)
    assert message.startswith(f"{name}={ASKING[name]}: ") and "\n" not in message
    assert any(word in message for word in ("unset it", "horovodrun", "yourself", "set it to")), message


def test_values_that_describe_what_the_torch_backend_does_are_accepted():
    assert set(ACCEPTED) <= set(REFUSED)
    assert read(ACCEPTED) == read({})


@pytest.mark.parametrize("name, value", [("HOROVOD_FUSION_THRESHOLD", "64MB"), ("HOROVOD_FUSION_THRESHOLD", "-1"),
                                         ("HOROVOD_CYCLE_TIME", "fast"), ("HOROVOD_CYCLE_TIME", "nan"),
                                         ("HOROVOD_LOG_LEVEL", "verbose"), ("HOROVOD_TIMELINE_MARK_CYCLES", "yes"),
                                         ("HOROVOD_CACHE_CAPACITY", "-1")])
def test_a_bad_value_of_an_honoured_variable_is_refused(name, value):
    with pytest.raises(UserError, match=f"^{name}="):
        read({name: value})


def test_every_runtime_variable_of_horovod_is_honoured_or_refused():
    honoured = {"HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME", "HOROVOD_TIMELINE", "HOROVOD_TIMELINE_MARK_CYCLES",
                "HOROVOD_DISABLE_GROUP_FUSION", "HOROVOD_LOG_LEVEL", "HOROVOD_LOG_HIDE_TIME", "HOROVOD_GLOO_IFACE",
                "HOROVOD_STALL_CHECK_DISABLE", "HOROVOD_STALL_CHECK_TIME_SECONDS",
                "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "HOROVOD_DYNAMIC_PROCESS_SETS", "HOROVOD_CACHE_CAPACITY"}
    # horovod/common/common.h and logging.cc of 0.28.1, but the launcher's (HOROVOD_GLOO_TIMEOUT_SECONDS: horovodrun)
    horovod_runtime = {
        "HOROVOD_ELASTIC", "HOROVOD_MPI_THREADS_DISABLE", "HOROVOD_TIMELINE", "HOROVOD_TIMELINE_MARK_CYCLES",
        "HOROVOD_AUTOTUNE", "HOROVOD_AUTOTUNE_LOG", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES",
        "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
        "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME",
        "HOROVOD_STALL_CHECK_DISABLE", "HOROVOD_STALL_CHECK_TIME_SECONDS", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
        "HOROVOD_HIERARCHICAL_ALLREDUCE", "HOROVOD_HIERARCHICAL_ALLGATHER", "HOROVOD_TORUS_ALLREDUCE",
        "HOROVOD_CACHE_CAPACITY", "HOROVOD_NUM_NCCL_STREAMS", "HOROVOD_CPU_OPERATIONS", "HOROVOD_CONTROLLER",
        "HOROVOD_CCL_CACHE", "HOROVOD_GLOO_IFACE", "HOROVOD_ADASUM_MPI_CHUNK_SIZE", "HOROVOD_THREAD_AFFINITY",
        "HOROVOD_DISABLE_GROUP_FUSION", "HOROVOD_DISABLE_NVTX_RANGES", "HOROVOD_ENABLE_ASYNC_COMPLETION",
        "HOROVOD_DYNAMIC_PROCESS_SETS", "HOROVOD_ENABLE_XLA_OPS", "HOROVOD_BATCH_D2D_MEMCOPIES",
        "HOROVOD_LOG_LEVEL", "HOROVOD_LOG_HIDE_TIME",
    }
    assert horovod_runtime - honoured == set(REFUSED)
    assert not honoured & set(REFUSED)
    assert settings.DEFAULT_FUSION_BYTES == 134217728
