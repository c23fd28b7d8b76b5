"""The speed features on both backends: --accumulate, --amp, --compression, --channels-last,
and Horovod's cycle time on CPUs.

Each test compares weights or numbers that would differ if the feature were
ignored, so a silently dropped flag fails.
"""
import json
import statistics
from pathlib import Path

import pytest
import torch
from conftest import (
    PYTHON,
    SHORT_SGD,
    check,
    horovodrun,
    load_final,
    max_abs_diff,
    read_metrics,
    run,
    torchrun,
    train_here,
)

from trainbridge.backends.horovod import CPU_CYCLE_TIME_MS, horovod_defaults
from trainbridge.cli.train import main as train_main
from trainbridge.training.step import cpu_bf16_warning

SCRIPTS = Path(__file__).parent / "speed_scripts"
COMMON = ["--model", "plaincnn", "--optimizer", "sgd", "--lr", "0.05", "--dataset", "mnist-sample", "--seed", "7",
          "--no-progress"]
LAUNCHERS = {
    "torchrun": lambda args: torchrun(2, args),
    "horovodrun-gloo": lambda args: horovodrun(2, "gloo", args),
}
EXPECTED_BACKEND = {"torchrun": "torch", "horovodrun-gloo": "horovod"}


# ----- --accumulate ---------------------------------------------------------
# One epoch of the 4,000-image sample with 2 ranks x 4 micro-batches x 96 = 768
# samples per step: 5 whole steps (3,840 samples; the 160 left over wait for a later
# epoch, on every world size). Few large steps keep floating-point drift
# (different summation orders) far below the 1e-5 bound.
ONE_EPOCH = COMMON + ["--epochs", "1"]


@pytest.fixture(scope="module")
def one_batch_of_768(tmp_path_factory):
    out = tmp_path_factory.mktemp("batch768")
    check(train_here(ONE_EPOCH + ["--backend", "local", "--batch-size", "768", "--output-dir", str(out)]))
    return load_final(out)


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_accumulated_micro_batches_match_one_large_batch(launcher, one_batch_of_768, tmp_path):
    check(run(LAUNCHERS[launcher](ONE_EPOCH + ["--batch-size", "96", "--accumulate", "4",
                                               "--output-dir", str(tmp_path)]), timeout=240))
    final = load_final(tmp_path)
    row = read_metrics(tmp_path)[-1]
    assert (row["backend"], row["world_size"], final["step"]) == (EXPECTED_BACKEND[launcher], 2, 5)
    assert row["samples"] == 5 * 768
    diff = max_abs_diff(final["model"], one_batch_of_768["model"])
    assert diff < 1e-5, f"{launcher}: 4 x 96 on 2 ranks vs 1 x 768: max abs weight difference {diff:.3g}"


def test_accumulate_below_one_is_refused(tmp_path, capsys):
    # Refused before any job starts: trainbridge train's main, in this process.
    assert train_main(COMMON + ["--accumulate", "0", "--output-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        "trainbridge: error: --accumulate must be at least 1 (got 0)"


# ----- --amp -----------------------------------------------------------------
STEPS = ["--max-steps", "8", "--batch-size", "32"]


@pytest.fixture(scope="module")
def fp32_two_ranks(short_sgd_torchrun_run):
    """COMMON + STEPS in float32 under torchrun: conftest's SHORT_SGD run, started once per session."""
    assert COMMON + STEPS == SHORT_SGD
    return load_final(short_sgd_torchrun_run[0])


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_amp_gives_the_same_weights_on_both_backends(amp, fp32_two_ranks, tmp_path):
    finals = {}
    for launcher in LAUNCHERS:
        out = tmp_path / launcher
        check(run(LAUNCHERS[launcher](COMMON + STEPS + ["--amp", amp, "--output-dir", str(out)]), timeout=240))
        finals[launcher] = load_final(out)
        assert read_metrics(out)[-1]["backend"] == EXPECTED_BACKEND[launcher]
    # fp16 steps through a GradScaler: Horovod must unscale the averaged gradients
    # (synchronize first), or its weights would drift from DDP's.
    across = max_abs_diff(finals["torchrun"]["model"], finals["horovodrun-gloo"]["model"])
    assert across < 1e-5, f"--amp {amp}: torch vs horovod max abs weight difference {across:.3g}"
    # Autocast really ran: reduced-precision matmuls move the weights off the fp32 run.
    off_fp32 = max_abs_diff(finals["torchrun"]["model"], fp32_two_ranks["model"])
    assert off_fp32 > 1e-6, f"--amp {amp} gave the fp32 weights ({off_fp32:.3g}): autocast was not applied"
    assert all(t.dtype == torch.float32 for t in finals["torchrun"]["model"].values())  # master weights stay fp32


def test_fp16_loss_scale_survives_a_resume(tmp_path):
    """The GradScaler's state is in the checkpoint: a resumed run continues its growth count."""
    args = COMMON + ["--batch-size", "32", "--amp", "fp16", "--backend", "local"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    check(train_here(args + ["--max-steps", "6", "--output-dir", str(whole)]))
    check(train_here(args + ["--max-steps", "3", "--output-dir", str(split)]))
    check(train_here(args + ["--max-steps", "6", "--output-dir", str(split)]))
    a = torch.load(whole / "last.pt", weights_only=True)
    b = torch.load(split / "last.pt", weights_only=True)
    assert a["scaler"]["scale"] > 0 and a["scaler"]["_growth_tracker"] == 6  # 6 unskipped steps
    assert b["scaler"] == a["scaler"]  # 3 + 3, not a fresh scaler's 3
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


# ----- --compression ---------------------------------------------------------
EXACT_AVERAGE = {"none": 1 + 2 ** -9 + 2 ** -13, "fp16": 1 + 2 ** -9, "bf16": 1.0}


PROBED = {"torchrun": ["none", "fp16", "bf16"], "horovodrun-gloo": ["none", "fp16"]}  # Horovod has no bf16


@pytest.mark.parametrize("launcher", list(PROBED))
def test_compression_averages_gradients_in_the_named_dtype(launcher):
    probe = [str(SCRIPTS / "compression_probe.py"), *PROBED[launcher]]
    cmd = torchrun(2, [])[:3] + probe if launcher == "torchrun" else horovodrun(2, "gloo", [])[:4] + [PYTHON, *probe]
    result = check(run(cmd, timeout=120))
    printed = [text for text in result.stdout.splitlines() if "{" in text][-1]
    line = json.loads(printed[printed.index("{"):])  # horovodrun prefixes "[0]<stdout>:"
    assert (line["backend"], line["world_size"]) == (EXPECTED_BACKEND[launcher], 2)
    assert {k: line[k] for k in PROBED[launcher]} == {k: EXACT_AVERAGE[k] for k in PROBED[launcher]}


def test_bf16_compression_under_horovod_is_refused_with_one_line(tmp_path):
    result = run(horovodrun(2, "gloo", COMMON + STEPS + ["--compression", "bf16", "--output-dir", str(tmp_path)]),
                 timeout=120)
    assert result.returncode != 0
    lines = [text for text in (result.stdout + result.stderr).splitlines() if "trainbridge: error:" in text]
    assert len(lines) == 1 and "--compression bf16 is not available with --backend horovod" in lines[0], lines
    assert not (tmp_path / "last.pt").exists()


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_compressed_training_stays_close_to_fp32(compression, fp32_two_ranks, tmp_path):
    check(run(torchrun(2, COMMON + STEPS + ["--compression", compression, "--output-dir", str(tmp_path)]),
              timeout=180))
    diff = max_abs_diff(load_final(tmp_path)["model"], fp32_two_ranks["model"])
    assert 0 < diff < 1e-2, f"--compression {compression}: max abs weight difference {diff:.3g} vs fp32"


@pytest.mark.parametrize("avx512_bf16, amx, warned", [(False, False, True), (True, False, False), (False, True, False)])
def test_bf16_on_a_cpu_without_bf16_instructions_is_warned_about(monkeypatch, avx512_bf16, amx, warned):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    warning = cpu_bf16_warning("bf16", torch.device("cpu"))
    assert (warning is not None) == warned
    if warned:
        assert "--amp off" in warning
    assert cpu_bf16_warning("off", torch.device("cpu")) is None
    assert cpu_bf16_warning("bf16", torch.device("cuda")) is None


# ----- --channels-last -------------------------------------------------------
def test_channels_last_trains_the_same_model(tmp_path):
    args = COMMON + ["--backend", "local", "--batch-size", "32", "--max-steps", "6"]
    check(train_here(args + ["--channels-last", "off", "--output-dir", str(tmp_path / "off")]))
    check(train_here(args + ["--channels-last", "on", "--output-dir", str(tmp_path / "on")]))
    off, on = load_final(tmp_path / "off")["model"], load_final(tmp_path / "on")["model"]
    conv = next(k for k, v in on.items() if v.dim() == 4 and v.shape[1] > 1)  # 1 input channel: both layouts agree
    assert on[conv].is_contiguous(memory_format=torch.channels_last)  # the layout was applied
    assert not off[conv].is_contiguous(memory_format=torch.channels_last)
    assert max_abs_diff(on, off) < 1e-5


# ----- Horovod's cycle time on CPUs -------------------------------------------
def horovod_cycle_ms(folder: Path, env: dict) -> float:
    """Median time between the starts of Horovod's background cycles, from Horovod's own timeline."""
    folder.mkdir()
    timeline = folder / "timeline.json"
    env = {"HOROVOD_TIMELINE": str(timeline), "HOROVOD_TIMELINE_MARK_CYCLES": "1", **env}
    check(run(horovodrun(2, "gloo", COMMON + STEPS + ["--output-dir", str(folder / "out")]), timeout=180, env=env))
    text = timeline.read_text().rstrip().rstrip(",")  # Horovod may leave the JSON array open
    events = json.loads(text if text.endswith("]") else text + "]")
    starts = [e["ts"] for e in events if e.get("name") == "CYCLE_START"]  # microseconds
    assert len(starts) > 20, f"only {len(starts)} cycles in {timeline}"
    return statistics.median(b - a for a, b in zip(starts, starts[1:])) / 1000


def test_horovod_on_cpus_cycles_every_5_ms_unless_the_user_says_otherwise(tmp_path):
    # Horovod's own default is 1 ms; a cycle never starts before its time is up.
    assert horovod_cycle_ms(tmp_path / "default", {}) >= 0.9 * CPU_CYCLE_TIME_MS
    assert horovod_cycle_ms(tmp_path / "user", {"HOROVOD_CYCLE_TIME": "20"}) >= 18


def test_gpus_and_elastic_jobs_keep_horovods_cycle_time():
    assert horovod_defaults("cpu", 60)["HOROVOD_CYCLE_TIME"] == str(CPU_CYCLE_TIME_MS)
    gpu = horovod_defaults("cuda", 60)
    assert "HOROVOD_CYCLE_TIME" not in gpu and "OMPI_MCA_mpi_yield_when_idle" not in gpu
    assert gpu["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] == "60"
    assert "HOROVOD_CYCLE_TIME" not in horovod_defaults("cpu", 60, elastic=True)  # see horovod_defaults
