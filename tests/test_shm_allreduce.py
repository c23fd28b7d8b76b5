"""The torch backend's shared-memory gradient exchange (--shm-allreduce), in real processes.

The exchange itself is driven by tests/speed_scripts/shm_probe.py (ranks joined by a
gloo process group, as under torchrun); training runs use real torchrun.
"""
import json
from pathlib import Path

import pytest
from conftest import PYTHON, bitwise_equal, check, horovodrun, load_final, max_abs_diff, plain, run, torchrun
from test_bad_input import assert_one_clear_line

from trainbridge.backends.shm_allreduce import MAX_CHUNK_BYTES, MIN_CHUNK_BYTES, SHM_BUDGET_BYTES, chunk_bytes

PROBE = str(Path(__file__).parent / "speed_scripts" / "shm_probe.py")
COMMON = ["--model", "plaincnn", "--optimizer", "sgd", "--lr", "0.05", "--max-steps", "8",
          "--dataset", "mnist-sample", "--seed", "5", "--no-progress"]


def probe(*args: str) -> dict:
    result = check(run([PYTHON, PROBE, *args], timeout=90))
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("world_size,largest,expected", [
    (2, 1_201_704, 1_201_728),  # the MNIST convnet's gradients fit one slot (rounded up to 64 bytes)
    (2, 85 << 20, MAX_CHUNK_BYTES),  # ResNet34: 4 MiB chunks
    (64, 85 << 20, max(MIN_CHUNK_BYTES, SHM_BUDGET_BYTES // 128)),  # many ranks: the budget caps the slots
    (2, 10, 64),
])
def test_chunk_size(world_size, largest, expected):
    assert chunk_bytes(world_size, largest) == expected


# 3 ranks (chunks that do not divide evenly: test_chunk_size) are the launcher matrix, as the 3-rank training below.
@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.matrix)])
def test_every_rank_ends_with_the_same_average(world_size):
    out = probe("average", str(world_size))
    # A rank names its segment trainbridge-<its pid>-...: the other workers' jobs make and unlink their own meanwhile.
    left = [path for pid in out["pids"] for path in Path("/dev/shm").glob(f"trainbridge-{pid}-*")]
    assert not left, left  # unlinked once mapped: nothing left behind
    assert out["exitcodes"] == [0] * world_size, out
    for rank in range(world_size):
        report = json.loads(out["results"][str(rank)])
        assert report["identical_on_all_ranks"], report
        assert report["max_error_fp32"] < 1e-6, report  # vs the float64 mean of the inputs
        assert report["max_error_bf16"] < 0.02, report  # bfloat16 buckets (bf16 models) too
        assert report["chunks"] > 200, report  # 256-byte slots: both slot sets reused many times


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.matrix)])
def test_small_asynchronous_allreduces_agree_on_every_rank(world_size):
    out = probe("small", str(world_size))
    assert out["exitcodes"] == [0] * world_size, out
    for rank in range(world_size):
        report = json.loads(out["results"][str(rank)])
        assert report["identical_on_all_ranks"], report
        assert report["count"] == 300 and report["dtypes"] == ["torch.float32"], report
        assert report["max_error"] < 1e-5, report  # vs the float64 sum / mean / max of the inputs


@pytest.mark.parametrize("scenario,what", [("exit", "the shared-memory gradient exchange"),
                                           ("small-exit", "a shared-memory allreduce")])
def test_a_peer_that_exits_is_named_within_a_second(scenario, what):
    out = probe(scenario)
    report = json.loads(out["results"]["0"])
    assert out["exitcodes"][:2] == [1, 3], out
    assert f"rank(s) 1 exited during {what}" in report["error"], report
    assert report["seconds"] < 1.0, report


def test_a_peer_that_stalls_ends_in_the_timeout():
    out = probe("stall")
    report = json.loads(out["results"]["0"])
    assert out["exitcodes"][0] == 1, out
    assert "rank(s) 1 did not reach the shared-memory gradient exchange: timed out after 3s" in report["error"]
    assert 3.0 <= report["seconds"] < 4.0, report


def test_two_ranks_train_the_same_bits_as_gloo(tmp_path):
    finals = {}
    for mode in ("on", "off"):
        out = tmp_path / mode
        result = check(run(torchrun(2, COMMON + ["--batch-size", "32", "--shm-allreduce", mode,
                                                 "--output-dir", str(out)]), timeout=180))
        assert "averaged by gloo" not in result.stdout + result.stderr
        finals[mode] = load_final(out)["model"]
    assert bitwise_equal(finals["on"], finals["off"])


@pytest.mark.matrix  # a third rank: make test trains 2 ranks (above) and checks 3 ranks' chunk sizes
def test_three_ranks_match_one_process_with_three_times_the_batch(tmp_path):
    check(run(plain(COMMON + ["--batch-size", "48", "--backend", "local", "--output-dir", str(tmp_path / "one")]),
              timeout=120))
    check(run(torchrun(3, COMMON + ["--batch-size", "16", "--shm-allreduce", "on",
                                    "--output-dir", str(tmp_path / "three")]), timeout=240))
    diff = max_abs_diff(load_final(tmp_path / "three")["model"], load_final(tmp_path / "one")["model"])
    assert diff < 1e-5, diff


def test_on_with_compression_is_refused(tmp_path):
    result = run(torchrun(2, COMMON + ["--batch-size", "32", "--shm-allreduce", "on", "--compression", "fp16",
                                       "--output-dir", str(tmp_path)]), timeout=120)
    assert_one_clear_line(result, r"--shm-allreduce on is not possible: --compression fp16 sends gradients "
                                  r"through gloo; use --shm-allreduce auto or off")
    assert not (tmp_path / "final.pt").exists()


def test_on_with_horovod_is_refused(tmp_path):
    result = run(horovodrun(2, "gloo", COMMON + ["--batch-size", "32", "--shm-allreduce", "on",
                                                 "--output-dir", str(tmp_path)]), timeout=120)
    assert_one_clear_line(result, r"--shm-allreduce on needs --backend torch")
