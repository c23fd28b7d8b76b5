"""Start every configuration under its real launcher, with a timeout, and aggregate repeats.

Repeats are interleaved (repeat r runs the whole matrix, its order rotated by r),
so slow drifts of a shared machine hit every configuration alike, and each
figure is the median over repeats. Each run records how busy the machine was
with work that was not its own (``foreign_cpu``: the share of all cores used by
other processes during the run). With a noise limit, a run that other work
disturbed more than that is run again (a few times at most) and the quietest
attempt is kept. A run killed by SIGKILL or SIGTERM that the bench did not send
(another user cleaning up on a shared machine) is run again the same way; a
crash or a non-zero exit is not.

A run that exits non-zero, writes no ``final`` line, or outlives its timeout
(its whole process tree is then killed) is a failed run; a configuration with a
failed run is failed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import resource
import shutil
import signal
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import psutil

from .configs import COMPARED, REPO_ROOT, BenchConfig, build_matrix
from .gpu_busy import GpuBusy
from .measure import read_final
from .workloads import Workload

# A benchmark run must not inherit the launcher of whoever started the bench.
LAUNCHER_PREFIXES = ("OMPI_", "PMI_", "PMIX_", "HOROVOD_", "SLURM_", "TORCHELASTIC_")
LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TRAINBRIDGE_SPAWNED",
    "OMP_NUM_THREADS",
)


def run_environment(threads: int) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES) and k not in LAUNCHER_VARIABLES}
    env.update(
        {
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
            "OMP_NUM_THREADS": str(threads),  # the same as --threads; also silences torchrun's warning
            # Open MPI's shared-memory single-copy needs ptrace rights that containers lack.
            "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
        }
    )
    return env


# Checkpoint files of every row: torch.save (trainbridge, DDP), Fabric, Accelerate's save_state.
CHECKPOINT_SUFFIXES = (".pt", ".ckpt", ".safetensors", ".bin", ".pkl")


@dataclasses.dataclass
class RunResult:
    key: str
    repeat: int
    status: str  # "ok", "failed" or "timeout"
    wall_seconds: float
    foreign_cpu: Optional[float]  # share of all cores busy with other processes' work during the run
    samples_per_second: Optional[float] = None
    first_step_seconds: Optional[float] = None  # launch to the end of rank 0's first optimizer step
    gpu_busy: Optional[float] = None  # share of the wall time a kernel ran on the GPUs (None without one)
    val_samples: Optional[int] = None  # validation samples the run's own metric code counted
    step_time_median: Optional[float] = None
    step_time_p90: Optional[float] = None
    peak_rss_mb_per_rank: Optional[List[float]] = None
    error: str = ""
    log_dir: str = ""
    attempts: int = 1  # more than 1 when noisy or externally killed runs were repeated
    exit_code: Optional[int] = None  # negative: killed by that signal


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent not idle (steal included: a neighbour VM's work)."""
    t = psutil.cpu_times()
    return sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))


def children_cpu_seconds() -> float:
    """CPU seconds of this process's finished and waited-for descendants."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the run's whole process tree (mpirun may start its ranks in other process groups).

    The tree is frozen with SIGSTOP until a listing finds no new process, so that
    nothing forks between the listing and the kill.
    """
    frozen: Dict[int, psutil.Process] = {}
    try:
        root = psutil.Process(proc.pid)
        for _ in range(10):
            found = {p.pid: p for p in [root, *root.children(recursive=True)] if p.pid not in frozen}
            if not found:
                break
            for p in found.values():
                try:
                    p.suspend()
                except psutil.NoSuchProcess:
                    pass
            frozen.update(found)
    except psutil.NoSuchProcess:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for p in frozen.values():
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(list(frozen.values()), timeout=10)  # the next run starts on a machine without them


def tail(path: Path, chars: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


@contextlib.contextmanager
def cpu_affinity(cores: int) -> Iterator[None]:
    """Processes started inside inherit only the first ``cores`` of this process's CPUs (0: all of them)."""
    if not cores or not hasattr(os, "sched_setaffinity"):
        yield
        return
    allowed = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, allowed[:cores])
    try:
        yield
    finally:
        os.sched_setaffinity(0, allowed)


def run_once(config: BenchConfig, repeat: int, run_dir: Path, timeout: float) -> RunResult:
    """One run of ``config`` writing into ``run_dir``; never takes longer than ``timeout`` seconds."""
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh folder: nothing to resume from, no stale metrics
    run_dir.mkdir(parents=True)
    stdout, stderr = run_dir / "stdout.log", run_dir / "stderr.log"
    busy0, ours0, start, launched = busy_cpu_seconds(), children_cpu_seconds(), time.perf_counter(), time.time()
    with (
        open(stdout, "w") as out,
        open(stderr, "w") as err,
        cpu_affinity(config.cores_used if config.pinned else 0),
        GpuBusy() as gpu,
    ):
        proc = subprocess.Popen(
            config.command(str(run_dir)),
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            env={**run_environment(config.threads), **dict(config.env)},
            cwd=str(REPO_ROOT),
            start_new_session=True,
        )
        try:
            code: Optional[int] = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            code = None
    wall = time.perf_counter() - start
    foreign = (busy_cpu_seconds() - busy0) - (children_cpu_seconds() - ours0)
    foreign_share = max(0.0, foreign / (wall * (psutil.cpu_count() or 1))) if wall > 0 else None
    result = RunResult(
        config.key,
        repeat,
        "ok",
        round(wall, 2),
        foreign_share and round(foreign_share, 3),
        log_dir=str(run_dir),
        exit_code=code,
        gpu_busy=gpu.fraction,
    )
    # The bench keeps logs, metrics and reports, not weights: a DesignSafe ResNet34 run
    # leaves about 800 MB of checkpoints (last, previous, best, final; the peers' in their formats).
    for path in sorted(run_dir.rglob("*"), reverse=True):  # files before the folders that hold them
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()
        elif path.is_file() and path.suffix in CHECKPOINT_SUFFIXES:
            path.unlink(missing_ok=True)
    if code is None:
        result.status, result.error = "timeout", f"killed after {timeout:.0f}s; stderr tail:\n{tail(stderr)}"
        return result
    final = read_final(str(run_dir))
    if code != 0 or not final.get("samples_per_second"):
        result.status = "failed"
        result.error = (
            f"exit {code}, {'no final metrics' if not final else 'no throughput'}; stderr tail:\n{tail(stderr)}"
        )
        return result
    for field in ("samples_per_second", "step_time_median", "step_time_p90", "peak_rss_mb_per_rank", "val_samples"):
        setattr(result, field, final.get(field))
    if final.get("first_step_at"):
        result.first_step_seconds = round(final["first_step_at"] - launched, 3)
    return result


def wait_until_quiet(limit_seconds: float, busy_share: float = 0.25, sample_seconds: float = 2.0) -> float:
    """Wait (at most ``limit_seconds``) until the machine is less than ``busy_share`` busy; returns the last share."""
    deadline = time.monotonic() + limit_seconds
    while True:
        share = psutil.cpu_percent(interval=sample_seconds) / 100.0
        if share < busy_share or time.monotonic() >= deadline:
            return share


def run_quietly(
    config: BenchConfig,
    repeat: int,
    run_dir: Path,
    timeout: float,
    settle_seconds: float,
    noise_limit: Optional[float],
    noisy_retries: int,
) -> RunResult:
    """``run_once``, repeated while other processes used more than ``noise_limit`` of the cores or killed it.

    Returns the quietest successful attempt (else the last one), with ``attempts`` set.
    """
    attempts: List[RunResult] = []
    for attempt in range(1 + noisy_retries):
        if settle_seconds > 0:
            wait_until_quiet(settle_seconds)
        attempt_dir = run_dir if attempt == 0 else run_dir.with_name(f"{run_dir.name}-try{attempt + 1}")
        result = run_once(config, repeat, attempt_dir, timeout)
        attempts.append(result)
        killed_from_outside = result.status == "failed" and result.exit_code in (-signal.SIGKILL, -signal.SIGTERM)
        noisy = (
            result.status == "ok"
            and noise_limit is not None
            and result.foreign_cpu is not None
            and result.foreign_cpu > noise_limit
        )
        if not (killed_from_outside or noisy):
            break
    ok = [r for r in attempts if r.status == "ok"]
    best = min(ok, key=lambda r: r.foreign_cpu or 0.0) if ok else result
    best.attempts = len(attempts)
    return best


def run_matrix(
    configs: List[BenchConfig],
    repeats: int,
    out_dir: Path,
    timeout: float,
    settle_seconds: float = 0.0,
    noise_limit: Optional[float] = None,
    noisy_retries: int = 0,
    report: Callable[[str], None] = print,
) -> List[RunResult]:
    """Run every configuration ``repeats`` times, interleaved; results in run order."""
    results = []
    for repeat in range(repeats):
        order = configs[repeat % len(configs) :] + configs[: repeat % len(configs)]
        for config in order:
            result = run_quietly(
                config,
                repeat,
                out_dir / config.key / f"repeat{repeat + 1}",
                timeout,
                settle_seconds,
                noise_limit,
                noisy_retries,
            )
            results.append(result)
            shown = f"{result.samples_per_second:,.0f} samples/s" if result.status == "ok" else result.status.upper()
            foreign = f", other load {result.foreign_cpu:.0%}" if result.foreign_cpu is not None else ""
            tries = f", best of {result.attempts} tries" if result.attempts > 1 else ""
            report(
                f"[bench] repeat {repeat + 1}/{repeats} {config.key}: {shown} "
                f"({result.wall_seconds:.1f}s{foreign}{tries})"
            )
    return results


COUNT_RANKS = 3  # validation sets of 1,000 do not split evenly into 3 shards


def count_validation_samples(
    workload: Workload, keys: List[str], out_dir: Path, timeout: float, cores: int
) -> Dict[str, RunResult]:
    """Each compared row once more with 3 ranks and few steps: the validation samples its metric code counts.

    A padded evaluation shard counts some samples twice; an exact one counts the set's size.
    """
    import torch

    # One GPU per rank: with fewer GPUs than that, the count (a property of each row's metric code) runs on the CPUs.
    gpus = torch.cuda.device_count()
    on_gpus = gpus >= COUNT_RANKS
    hidden = (("CUDA_VISIBLE_DEVICES", ""),) if 0 < gpus < COUNT_RANKS else ()
    three = {
        c.key: dataclasses.replace(c, env=c.env + hidden)
        for c in build_matrix(workload, COUNT_RANKS, quick=True, cores=cores, gpu=on_gpus)
    }
    return {
        key: run_once(three[key], 0, out_dir / key / f"{COUNT_RANKS}-ranks", timeout) for key in keys if key in COMPARED
    }


def median_or_none(values: Sequence[Optional[float]]) -> Optional[float]:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def aggregate(config: BenchConfig, runs: List[RunResult], skipped: Optional[str] = None) -> Dict[str, Any]:
    """Medians over the successful runs of one configuration; failed if any run failed; ``skipped``: not run, why."""
    ok = [r for r in runs if r.status == "ok"]
    rates = [r.samples_per_second for r in ok if r.samples_per_second is not None]  # set on every ok run
    rss = [r.peak_rss_mb_per_rank for r in ok if r.peak_rss_mb_per_rank]
    return {
        "label": config.label,
        "kind": config.kind,
        "group": config.group,
        "nproc": config.nproc,
        "threads_per_rank": config.threads,
        "cores_used": config.cores_used,
        "command": config.command("DIR"),
        "status": "skipped" if skipped else "ok" if ok and len(ok) == len(runs) else "failed",
        "skip_reason": skipped,
        "errors": [f"repeat {r.repeat + 1}: {r.error}" for r in runs if r.status != "ok"],
        "samples_per_second": median_or_none(rates),
        "samples_per_second_min": min(rates) if rates else None,
        "samples_per_second_max": max(rates) if rates else None,
        "step_time_median": median_or_none([r.step_time_median for r in ok]),
        "step_time_p90": median_or_none([r.step_time_p90 for r in ok]),
        "wall_seconds": median_or_none([r.wall_seconds for r in ok]),
        "first_step_seconds": median_or_none([r.first_step_seconds for r in ok]),
        "gpu_busy": median_or_none([r.gpu_busy for r in ok]),
        "val_samples": median_or_none([r.val_samples for r in ok]),
        "peak_rss_mb_per_rank": [statistics.median(col) for col in zip(*rss)] if rss else None,
        "foreign_cpu_median": median_or_none([r.foreign_cpu for r in runs]),
        "runs": [dataclasses.asdict(r) for r in runs],
    }
