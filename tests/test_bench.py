"""The peer bench (``python -m benchmarks``): the quick smoke run produces every number,
and failures are reported, not hung.

Speed is never asserted here: the ratios live in benchmarks/RESULTS.md.
"""
import json
import os
import sys
from pathlib import Path

import pytest
from conftest import PYTHON, TORCHRUN, check, run

from benchmarks.bench import cli as bench_cli
from benchmarks.bench.configs import COMPARED, BenchConfig, build_matrix, check_launchers, skip_reason
from benchmarks.bench.runner import CHECKPOINT_SUFFIXES, run_once
from benchmarks.bench.targets import TARGETS, evaluate
from benchmarks.bench.workloads import WORKLOADS
from trainbridge.errors import UserError
from trainbridge.training import step as train_step
from trainbridge.training.step import cpu_has_bf16

ROOT = Path(__file__).resolve().parents[1]

CONFIGS = ["local_all_cores", "bare_loop", "local_1_thread", "torch_gloo", "ddp_tutorial", "trainbridge_loop",
           "accelerate", "fabric", "torch_gloo_no_shm", "torch_gloo_bf16",
           "independent_bare_loops", "horovod_gloo", "horovod_tutorial_gloo", "horovod_mpi", "horovod_tutorial_mpi"]


# A hang guard for the whole bench: each of its runs has the bench's own limit (120 s with --quick).
# The 14 MNIST runs took 15-33 s each on a slow 2-core machine, so 240 s was their sum there, not a hang.
BENCH_TIMEOUT = 900


@pytest.mark.e2e
def test_quick_bench_reports_every_configuration(tmp_path):
    """The CI smoke test as the README gives it: ``python -m benchmarks --quick`` runs MNIST's every configuration."""
    out = tmp_path / "bench"
    result = check(run([PYTHON, "-m", "benchmarks", "--quick", "--out", str(out)], timeout=BENCH_TIMEOUT,
                       cwd=str(ROOT)))
    assert "T1 torch backend vs hand-written DDP" in result.stdout
    report = json.loads((out / "bench.json").read_text())
    assert report["ok"] is True and report["settings"]["mode"] == "quick"
    assert list(report["workloads"]) == ["mnist-convnet"]
    workload = report["workloads"]["mnist-convnet"]
    assert list(workload["configs"]) == CONFIGS
    # The bf16 reference row runs only where the CPU computes in bf16
    # (skip_reason; the test below fakes the other case).
    ran = [key for key in CONFIGS if key != "torch_gloo_bf16" or cpu_has_bf16()]
    for key, config in workload["configs"].items():
        if key not in ran:
            assert config["status"] == "skipped" and "no bfloat16 instructions" in config["skip_reason"], key
            continue
        assert config["status"] == "ok", (key, config["errors"])
        assert config["samples_per_second"] > 0, key
        assert 0 < config["step_time_median"] <= config["step_time_p90"], key
        assert config["scaling_efficiency"] > 0, key
        assert len(config["peak_rss_mb_per_rank"]) == config["nproc"], key
        assert all(mb > 0 for mb in config["peak_rss_mb_per_rank"]), key
    assert_whole_runs(workload)
    assert [t["id"] for t in workload["targets"]] == [t.id for t in TARGETS]
    assert all(t["ratio"] > 0 for t in workload["targets"] if t["config"] in ran)
    assert all(t["met"] in (True, False) for t in workload["targets"] if t["id"].startswith(("T", "P")))
    assert all(t["met"] is None for t in workload["targets"] if t["id"].startswith("R"))
    table = (out / "bench.md").read_text()
    assert "| T4 trainbridge, 1 process vs bare loop |" in table
    assert "| R2 torch backend, shared-memory gradient exchange vs gloo" in table
    assert "| R3 ceiling for T3: N bare loops without communication" in table and "| reference |" in table
    assert "| P1 trainbridge train, end-to-end wall time vs the best peer |" in table
    assert "| Accelerate ×2 (ACCELERATE_USE_CPU=1) (`accelerate`) |" in table
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The runs wrote checkpoints (every row, the peers in their own formats) and the bench removed them:
    # logs, metrics and reports stay.
    left = [p for p in (out / "runs").rglob("*") if p.is_file()]
    assert [p for p in left if p.name == "metrics.jsonl"], left
    assert not [p for p in left if p.suffix in CHECKPOINT_SUFFIXES], left


def assert_whole_runs(workload):
    """The compared rows report whole runs, and the 3-rank runs count what each one's metric code counts."""
    size = workload["val_set_size"]
    padded = size + (-size % 3)  # a DistributedSampler pads the set to a multiple of the ranks
    compared = [key for key in COMPARED if key in workload["configs"]]
    assert compared, list(workload["configs"])
    for key in compared:
        config = workload["configs"][key]
        assert 0 < config["first_step_seconds"] < config["wall_seconds"], key
        # trainbridge's unpadded shards and Accelerate's gather_for_metrics count each sample once; the
        # DDP tutorial's all_reduce and Fabric's recommended all_reduce count the padding again.
        expected = padded if key in ("ddp_tutorial", "fabric") else size
        assert config["val_samples_3_ranks"] == expected, (key, config["val_samples_3_ranks"], expected)


# The rows whose image-folder path differs from MNIST's in-memory one: trainbridge's loaders with DataLoader
# workers (CLI, API loop, both backends), the DDP tutorial's DataLoader and the bare loop's. The peers' and the
# Horovod tutorial's scripts read both workloads through the same DataLoader code, run above on MNIST.
DESIGNSAFE_CONFIGS = ["local_all_cores", "bare_loop", "torch_gloo", "ddp_tutorial", "trainbridge_loop", "horovod_gloo"]


@pytest.mark.e2e
def test_quick_bench_runs_the_designsafe_workload_everywhere(tmp_path):
    """ResNet34 on the image folder: trainbridge, the DDP tutorial and the DataLoader bare loop run."""
    out = tmp_path / "bench"
    only = [arg for key in DESIGNSAFE_CONFIGS for arg in ("--only", key)]
    check(run([PYTHON, "-m", "benchmarks", "--quick", "--workload", "designsafe-resnet34", *only,
               "--out", str(out)], timeout=BENCH_TIMEOUT, cwd=str(ROOT)))
    workload = json.loads((out / "bench.json").read_text())["workloads"]["designsafe-resnet34"]
    assert list(workload["configs"]) == DESIGNSAFE_CONFIGS
    for key, config in workload["configs"].items():
        assert config["status"] == "ok" and config["samples_per_second"] > 0, (key, config["errors"])
    assert_whole_runs(workload)
    t1 = next(t for t in workload["targets"] if t["id"] == "T1")
    assert t1["ratio"] > 0


def test_the_bf16_reference_row_is_skipped_with_its_reason_on_a_cpu_without_bf16(tmp_path, monkeypatch, capsys):
    """Without bf16 instructions the --amp bf16 row would run at a fraction of fp32 (or time out): skipped, said,
    and the bench still exits 0; asked for by name with --only, it runs."""
    matrix = build_matrix(WORKLOADS["mnist-convnet"], 2, quick=True, cores=2)
    monkeypatch.setattr(train_step, "cpu_has_bf16", lambda: False)
    assert [c.key for c in matrix if skip_reason(c)] == ["torch_gloo_bf16"]
    assert bench_cli.skipped_rows(matrix, only=["torch_gloo_bf16"]) == {}
    assert "--only torch_gloo_bf16" in skip_reason(next(c for c in matrix if c.key == "torch_gloo_bf16"))
    monkeypatch.setattr(bench_cli, "build_matrix", lambda *args: [c for c in matrix
                                                                  if c.key in ("local_1_thread", "torch_gloo_bf16")])
    out = tmp_path / "bench"
    assert bench_cli.main(["--quick", "--out", str(out)]) == 0
    assert "[bench] skipping torch_gloo_bf16: this CPU has no bfloat16 instructions" in capsys.readouterr().out
    configs = json.loads((out / "bench.json").read_text())["workloads"]["mnist-convnet"]["configs"]
    assert configs["local_1_thread"]["status"] == "ok"
    assert configs["torch_gloo_bf16"]["status"] == "skipped" and configs["torch_gloo_bf16"]["runs"] == []
    assert "**torch_gloo_bf16 skipped**: this CPU has no bfloat16 instructions" in (out / "bench.md").read_text()
    monkeypatch.setattr(train_step, "cpu_has_bf16", lambda: True)
    assert skip_reason(next(c for c in matrix if c.key == "torch_gloo_bf16")) is None


def test_a_peer_whose_library_is_missing_is_skipped_with_the_install_command():
    config = BenchConfig("peer", "peer", "peer", "torchrun", 2, 1, ("python",), needs="no_such_library_here")
    assert skip_reason(config) == "no_such_library_here is not installed; pip install -e '.[bench]' installs the peers"


def test_only_the_rows_that_run_need_their_launcher(tmp_path, monkeypatch, capsys):
    """On a machine without horovodrun (neither beside this Python nor on the PATH), ``--only ddp_tutorial``
    needs none; a Horovod row asked for is one line naming horovodrun and the rows that start it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").symlink_to(TORCHRUN)
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    monkeypatch.setenv("PATH", str(bin_dir))
    matrix = build_matrix(WORKLOADS["mnist-convnet"], 2, quick=True, cores=2)
    check_launchers([c for c in matrix if c.key == "ddp_tutorial"])
    with pytest.raises(UserError, match=r"^horovodrun is not installed .*"
                                        r"it starts horovod_gloo, horovod_tutorial_gloo, "
                                        r"horovod_mpi, horovod_tutorial_mpi; install it, or choose other rows"):
        check_launchers(matrix)
    assert bench_cli.main(["--quick", "--only", "horovod_gloo", "--out", str(tmp_path / "bench")]) == 2
    assert "trainbridge: error: horovodrun is not installed" in capsys.readouterr().err


def python_config(key: str, code: str) -> BenchConfig:
    return BenchConfig(key, key, "baseline", key, 1, 1, (sys.executable, "-c", code, "--"))


def test_a_failing_run_is_reported_with_its_error(tmp_path):
    config = python_config("fails", "import sys; print('boom', file=sys.stderr); sys.exit(3)")
    result = run_once(config, 0, tmp_path / "fails", timeout=60)
    assert result.status == "failed" and "exit 3" in result.error and "boom" in result.error


def test_a_pinned_run_and_its_children_see_only_that_many_cores(tmp_path):
    # The unit row is pinned to one core: its DataLoader workers (children) must share it.
    code = ("import os, subprocess, sys; "
            "child = subprocess.run([sys.executable, '-c', 'import os; print(len(os.sched_getaffinity(0)))'], "
            "capture_output=True, text=True).stdout.strip(); "
            "open(sys.argv[-1] + '/cores.txt', 'w').write(f'{len(os.sched_getaffinity(0))} {child}')")
    before = os.sched_getaffinity(0)
    config = BenchConfig("pinned", "pinned", "baseline", "pinned", 1, 1, (sys.executable, "-c", code), pinned=True)
    run_once(config, 0, tmp_path / "pinned", timeout=60)
    assert (tmp_path / "pinned" / "cores.txt").read_text() == "1 1"
    assert os.sched_getaffinity(0) == before  # the bench itself keeps every core
    if len(before) > 1:
        unpinned = BenchConfig("free", "free", "baseline", "free", 1, 1, (sys.executable, "-c", code))
        run_once(unpinned, 0, tmp_path / "free", timeout=60)
        assert (tmp_path / "free" / "cores.txt").read_text() == f"{len(before)} {len(before)}"


def test_a_run_without_metrics_is_failed(tmp_path):
    result = run_once(python_config("silent", "pass"), 0, tmp_path / "silent", timeout=60)
    assert result.status == "failed" and "no final metrics" in result.error


def test_a_hanging_run_is_killed_with_its_children(tmp_path):
    # The child starts a grandchild in its own session (as mpirun may), then both sleep.
    code = ("import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True); "
            "open(sys.argv[-1] + '/grandchild.pid', 'w').write(str(p.pid)); time.sleep(600)")
    config = BenchConfig("hangs", "hangs", "baseline", "hangs", 1, 1, (sys.executable, "-c", code))
    result = run_once(config, 0, tmp_path / "hangs", timeout=6)
    assert result.status == "timeout" and result.wall_seconds < 30
    grandchild = int((tmp_path / "hangs" / "grandchild.pid").read_text())
    assert not Path(f"/proc/{grandchild}").exists() or "Z" in Path(f"/proc/{grandchild}/stat").read_text().split()[2]


def summary(nproc, rates):
    return {"nproc": nproc, "samples_per_second": sorted(rates)[len(rates) // 2],
            "runs": [{"repeat": i, "status": "ok", "samples_per_second": r} for i, r in enumerate(rates)]}


def test_target_ratios_pair_runs_of_the_same_repeat():
    scaling = next(t for t in TARGETS if t.id == "T3a")
    row = evaluate(scaling, {"torch_gloo": summary(2, [3600, 4000, 3800]),
                             "local_1_thread": summary(1, [2000, 2000, 2000])})
    assert row["ratio"] == 3800 / 4000 and row["met"] is True
    assert row["ratio_per_repeat"] == [0.9, 1.0, 0.95]
    assert evaluate(scaling, {"torch_gloo": summary(2, [3000])})["met"] is None


def whole_run(walls, rates):
    return {"nproc": 2, "wall_seconds": sorted(walls)[1], "samples_per_second": sorted(rates)[1],
            "runs": [{"repeat": i, "status": "ok", "wall_seconds": w, "samples_per_second": r}
                     for i, (w, r) in enumerate(zip(walls, rates))]}


def test_peer_targets_compare_with_the_best_peer_of_each_repeat():
    configs = {"torch_gloo": whole_run([9, 10, 11], [100, 100, 100]),
               "ddp_tutorial": whole_run([12, 12, 12], [90, 90, 90]),
               "accelerate": whole_run([10, 14, 13], [80, 120, 80]),
               "fabric": whole_run([15, 11, 20], [70, 70, 70])}
    wall = evaluate(next(t for t in TARGETS if t.id == "P1"), configs)
    # Lower is better: the best peer median is the DDP tutorial's 12 s; per repeat the fastest peer that repeat.
    assert wall["best_reference"] == "ddp_tutorial" and wall["ratio"] == 10 / 12 and wall["met"] is True
    assert wall["ratio_per_repeat"] == [0.9, round(10 / 11, 4), round(11 / 12, 4)]
    rate = evaluate(next(t for t in TARGETS if t.id == "P2"), configs)
    assert rate["best_reference"] == "ddp_tutorial" and rate["ratio"] == 100 / 90 and rate["met"] is True
    assert rate["ratio_per_repeat"] == [round(100 / 90, 4), round(100 / 120, 4), round(100 / 90, 4)]
    configs["torch_gloo"] = whole_run([11, 11, 11], [80, 80, 80])
    assert evaluate(next(t for t in TARGETS if t.id == "P1"), configs)["met"] is False
    assert evaluate(next(t for t in TARGETS if t.id == "P2"), configs)["met"] is False
