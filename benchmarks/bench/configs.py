"""The configuration matrix: which launcher starts what, with how many processes and threads.

Threads per rank follow one policy for every row, trainbridge and baselines
alike, and are passed explicitly (``--threads`` and ``OMP_NUM_THREADS``): the
available cores shared evenly among the processes, at least one. The
one-thread row is the per-core unit that scaling efficiency is measured against;
it is also pinned to one core (``pinned``), so that helpers it starts
(DataLoader workers for image-folder workloads) share that core instead of
running on an idle one: one core's worth of training, as the name says.

The baselines are scripts in ``benchmarks/baselines/``; :func:`baseline_parser`
is the command line they all accept, built here next to the code that builds
their commands. The peers are among them: the loop a user would write with
Hugging Face Accelerate or Lightning Fabric instead, each as its documentation
recommends, beside trainbridge's own API in a loop of one's own. These rows and
the DDP tutorial evaluate at every epoch end and write a checkpoint, as
``trainbridge train`` does, so that their wall times compare whole runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import shutil
import sys
from pathlib import Path
from typing import List, Optional, Tuple

from trainbridge.errors import UserError
from trainbridge.launch.environment import available_cores

from .workloads import WORKLOADS, Workload

REPO_ROOT = Path(__file__).resolve().parents[2]  # benchmarks/bench/configs.py -> the checkout
BASELINES_DIR = REPO_ROOT / "benchmarks" / "baselines"


LAUNCHERS = ("torchrun", "horovodrun")


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    key: str  # stable JSON key, e.g. "torch_gloo"
    label: str  # for tables and the chart
    kind: str  # "trainbridge", "baseline" or "peer"
    group: str  # the chart puts a group's bars side by side: trainbridge beside its baseline
    nproc: int
    threads: int  # per rank
    argv: Tuple[str, ...]  # the command, less --output-dir
    needs_cpu_bf16: bool = False  # a reference row that only means something where the CPU computes in bf16
    pinned: bool = False  # the run and everything it starts may use only cores_used of the available cores
    env: Tuple[Tuple[str, str], ...] = ()  # set for this row only
    needs: str = ""  # a Python package the row imports (an optional extra)

    def command(self, output_dir: str) -> List[str]:
        return [*self.argv, "--output-dir", output_dir]

    @property
    def launcher(self) -> Optional[str]:
        """The launcher the row starts (torchrun, horovodrun), or None for a plain Python process."""
        name = Path(self.argv[0]).name
        return name if name in LAUNCHERS else None

    @property
    def cores_used(self) -> int:
        return self.nproc * self.threads


def threads_per_rank(nproc: int, cores: int) -> int:
    """The policy for every row: cores shared evenly among the local processes, at least one each."""
    return max(1, cores // nproc)


def skip_reason(config: BenchConfig) -> Optional[str]:
    """Why ``config`` is not run on this machine unless asked for by name (``--only``), or None.

    bf16 autocast on a CPU without bfloat16 instructions converts around every
    kernel: 0.21x fp32 on MNIST, and past the 300 s limit on ResNet34 (an AVX2 EPYC).
    Such a run measures nothing the reference row is for and costs the bench minutes.
    """
    from trainbridge.training.step import cpu_has_bf16  # imports torch: only when the matrix is run

    if config.needs_cpu_bf16 and not cpu_has_bf16():
        return "this CPU has no bfloat16 instructions (AVX512-BF16 or AMX); run it with --only " + config.key
    if config.needs and importlib.util.find_spec(config.needs) is None:
        return f"{config.needs} is not installed; pip install -e '.[bench]' installs the peers"
    return None


def find_launcher(name: str) -> Optional[str]:
    """A launcher installed beside this Python (the virtual environment), else on the PATH; None if neither."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


def check_launchers(configs: List[BenchConfig]) -> None:
    """Raise UserError naming the first launcher that one of ``configs`` starts and this machine lacks.

    Only the rows that will run are checked: ``--only ddp_tutorial`` needs no horovodrun.
    """
    for name in dict.fromkeys(c.launcher for c in configs if c.launcher):
        if find_launcher(name) is None:
            rows = ", ".join(c.key for c in configs if c.launcher == name)
            raise UserError(
                f"{name} is not installed beside {sys.executable} nor on the PATH, and it starts {rows}; "
                f"install it, or choose other rows with --only"
            )


def baseline_parser(description: str) -> argparse.ArgumentParser:
    """The command line of every script in ``benchmarks/baselines/``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--workload", default="mnist-convnet", choices=list(WORKLOADS))
    p.add_argument("--threads", type=int, required=True, help="intra-op threads per process")
    p.add_argument("--steps", type=int, default=160, help="optimizer steps per process, warm-up included")
    p.add_argument("--warmup-steps", type=int, default=10, help="steps left out of the timing")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--log-interval", type=int, default=10, help="print the loss every N batches (rank 0)")
    p.add_argument("--output-dir", required=True, help="where metrics.jsonl is written")
    return p


# The rows that a user choosing a library compares, each under torchrun: whole runs, not only steady state.
PEER_SCRIPTS = {
    "trainbridge_loop": "trainbridge_loop.py",
    "accelerate": "accelerate_loop.py",
    "fabric": "fabric_loop.py",
}
PEERS = ("ddp_tutorial", "accelerate", "fabric")  # what users would pick instead of trainbridge
COMPARED = ("torch_gloo", "trainbridge_loop", *PEERS)  # also run with 3 ranks to count validation samples


def build_matrix(
    workload: Workload, nproc: int, quick: bool, cores: int = 0, gpu: Optional[bool] = None
) -> List[BenchConfig]:
    """Every configuration, baseline and peer for ``workload``, with ``nproc`` processes where distributed.

    Where there are GPUs (``gpu``: default, whether CUDA is available) every row trains
    on them, one per process, over nccl; else on the CPUs.
    """
    import torch  # only when the matrix is run

    cores = cores or available_cores()
    gpu = torch.cuda.is_available() if gpu is None else gpu
    steps, warmup = workload.steps(quick)
    python = sys.executable
    # A launcher this machine lacks stays a bare name here: check_launchers names it if a row that runs needs it.
    torchrun = [find_launcher("torchrun") or "torchrun", "--standalone", f"--nproc-per-node={nproc}"]
    horovodrun = [find_launcher("horovodrun") or "horovodrun", "-np", str(nproc)]
    # Open MPI refuses more ranks than cores unless told; the other launchers do not care.
    hvd_gloo, hvd_mpi = [*horovodrun, "--gloo", python], [*horovodrun, "--mpi", "--mpi-args=--oversubscribe", python]

    def trainbridge(backend: str, threads: int) -> Tuple[str, ...]:
        return (
            "-m",
            "trainbridge.train",
            *workload.train_args,
            "--backend",
            backend,
            "--batch-size",
            str(workload.batch_size),
            "--threads",
            str(threads),
            "--max-steps",
            str(steps),
            "--epochs",
            "100000",
            "--warmup-steps",
            str(warmup),
            "--no-progress",
        )

    def baseline(script: str, threads: int) -> Tuple[str, ...]:
        return (
            str(BASELINES_DIR / script),
            "--workload",
            workload.name,
            "--threads",
            str(threads),
            "--steps",
            str(steps),
            "--warmup-steps",
            str(warmup),
        )

    all_cores, one, per_rank = threads_per_rank(1, cores), 1, threads_per_rank(nproc, cores)
    n = f"×{nproc}"
    return [
        BenchConfig(
            "local_all_cores",
            "trainbridge local, 1 process",
            "trainbridge",
            "1 process, all cores",
            1,
            all_cores,
            (python, *trainbridge("local", all_cores)),
        ),
        BenchConfig(
            "bare_loop",
            "bare loop (no distribution)",
            "baseline",
            "1 process, all cores",
            1,
            all_cores,
            (python, *baseline("bare_loop.py", all_cores)),
        ),
        BenchConfig(
            "local_1_thread",
            "trainbridge local, 1 thread on 1 core (unit)",
            "trainbridge",
            "1 process, 1 thread",
            1,
            one,
            (python, *trainbridge("local", one)),
            pinned=True,
        ),
        BenchConfig(
            "torch_gloo",
            f"trainbridge torch/{'nccl' if gpu else 'gloo'} {n}",
            "trainbridge",
            f"torchrun {n}",
            nproc,
            per_rank,
            (*torchrun, *trainbridge("torch", per_rank)),
        ),
        BenchConfig(
            "ddp_tutorial",
            f"DDP tutorial {n}",
            "baseline",
            f"torchrun {n}",
            nproc,
            per_rank,
            (*torchrun, *baseline("ddp_tutorial.py", per_rank)),
        ),
        BenchConfig(
            "trainbridge_loop",
            f"trainbridge API, own loop {n}",
            "trainbridge",
            f"torchrun {n}",
            nproc,
            per_rank,
            (*torchrun, *baseline(PEER_SCRIPTS["trainbridge_loop"], per_rank)),
        ),
        # Without ACCELERATE_USE_CPU=1 Accelerate under torchrun on a CPU trains each rank alone.
        BenchConfig(
            "accelerate",
            f"Accelerate {n}" + ("" if gpu else " (ACCELERATE_USE_CPU=1)"),
            "peer",
            f"torchrun {n}",
            nproc,
            per_rank,
            (*torchrun, *baseline(PEER_SCRIPTS["accelerate"], per_rank)),
            env=() if gpu else (("ACCELERATE_USE_CPU", "1"),),
            needs="accelerate",
        ),
        BenchConfig(
            "fabric",
            f"Lightning Fabric {n}",
            "peer",
            f"torchrun {n}",
            nproc,
            per_rank,
            (*torchrun, *baseline(PEER_SCRIPTS["fabric"], per_rank)),
            needs="lightning",
        ),
        # The same job with gradients through gloo instead of shared memory: what --shm-allreduce buys.
        BenchConfig(
            "torch_gloo_no_shm",
            f"trainbridge torch/gloo {n} --shm-allreduce off",
            "trainbridge",
            f"torchrun {n}",
            nproc,
            per_rank,
            (*torchrun, *trainbridge("torch", per_rank), "--shm-allreduce", "off"),
        ),
        # Opt-in bf16 autocast (other numerics than fp32): the gain of --amp, not a target.
        BenchConfig(
            "torch_gloo_bf16",
            f"trainbridge torch/gloo {n} --amp bf16",
            "trainbridge",
            f"torchrun {n}",
            nproc,
            per_rank,
            (*torchrun, *trainbridge("torch", per_rank), "--amp", "bf16"),
            needs_cpu_bf16=True,
        ),
        # The ceiling of N-process scaling here: N bare loops that never communicate.
        BenchConfig(
            "independent_bare_loops",
            f"bare loop {n}, no communication (ceiling)",
            "baseline",
            f"torchrun {n}",
            nproc,
            per_rank,
            (*torchrun, *baseline("bare_loop.py", per_rank)),
        ),
        BenchConfig(
            "horovod_gloo",
            f"trainbridge horovod/gloo {n}",
            "trainbridge",
            f"horovodrun --gloo {n}",
            nproc,
            per_rank,
            (*hvd_gloo, *trainbridge("horovod", per_rank)),
        ),
        BenchConfig(
            "horovod_tutorial_gloo",
            f"Horovod tutorial gloo {n}",
            "baseline",
            f"horovodrun --gloo {n}",
            nproc,
            per_rank,
            (*hvd_gloo, *baseline("horovod_tutorial.py", per_rank)),
        ),
        BenchConfig(
            "horovod_mpi",
            f"trainbridge horovod/mpi {n}",
            "trainbridge",
            f"horovodrun --mpi {n}",
            nproc,
            per_rank,
            (*hvd_mpi, *trainbridge("horovod", per_rank)),
        ),
        BenchConfig(
            "horovod_tutorial_mpi",
            f"Horovod tutorial mpi {n}",
            "baseline",
            f"horovodrun --mpi {n}",
            nproc,
            per_rank,
            (*hvd_mpi, *baseline("horovod_tutorial.py", per_rank)),
        ),
    ]
