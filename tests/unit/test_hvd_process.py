"""hvd.init() and the timeline calls in a one-rank job in the test process: Horovod's variables at init."""
import os
import re

import pytest
import torch
from one_rank_hvd import hvd_job

import trainbridge.hvd as hvd


def test_a_refused_variable_stops_init_with_one_line_before_joining(capfd):
    with pytest.raises(SystemExit) as stopped:
        with hvd_job(HOROVOD_AUTOTUNE="1"):
            pass
    assert stopped.value.code == 2
    err = capfd.readouterr().err
    assert err == ("trainbridge: error: HOROVOD_AUTOTUNE=1: the torch backend does not autotune: set "
                   "HOROVOD_FUSION_THRESHOLD and HOROVOD_CYCLE_TIME yourself (the autotuner's main knobs), or launch "
                   "with horovodrun (the real Horovod)\n")
    assert not hvd.is_initialized()


def test_start_timeline_needs_horovod_timeline_as_in_horovod():
    with pytest.raises(ValueError, match="Horovod has not been initialized"):
        hvd.start_timeline("/tmp/never.json")
    with hvd_job():
        with pytest.raises(ValueError, match="^Set HOROVOD_TIMELINE=DYNAMIC to enable dynamic timeline usage.$"):
            hvd.start_timeline("/tmp/never.json")
        hvd.stop_timeline()  # nothing to stop: no error, as in Horovod
    assert not os.path.exists("/tmp/never.json")


def test_log_level_and_hidden_time(capfd):
    with hvd_job(HOROVOD_LOG_LEVEL="debug", HOROVOD_LOG_HIDE_TIME="1"):
        hvd.allreduce(torch.ones(1), name="logged")
    out = capfd.readouterr().out
    assert re.search(r"^trainbridge\.hvd: info: rank 0 of 1 joined; fusion threshold 134217728 bytes, cycle time 1 ms",
                     out, re.M), out
    assert re.search(r"^trainbridge\.hvd: debug: rank 0 cycle \d+: allreduce 'logged' runs$", out, re.M), out
    with hvd_job(HOROVOD_LOG_LEVEL="info"):
        hvd.allreduce(torch.ones(1), name="not_logged")
    out = capfd.readouterr().out
    assert re.search(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\] trainbridge\.hvd: info: rank 0 of 1 joined", out), out
    assert "not_logged" not in out
    with hvd_job():  # warning, Horovod's default: nothing at init
        pass
    assert capfd.readouterr().out == ""


def test_horovod_gloo_iface_names_gloos_interface(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)  # restored (unset) after the test
    with hvd_job(HOROVOD_GLOO_IFACE="lo"):
        assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
        assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == 1


def test_mpi_threads_supported_is_horovods_value_error_outside_mpirun():
    with hvd_job():
        with pytest.raises(ValueError, match="Horovod MPI is not enabled"):
            hvd.mpi_threads_supported()
        assert hvd.mpi_enabled() is False
