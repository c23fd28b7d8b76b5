"""Helpers for tests that start real launchers (torchrun, horovodrun, mpirun) as subprocesses.

Every multi-process run has a timeout; on expiry the whole process group is
killed and the test fails, so a hang can never block CI.
"""
from __future__ import annotations

import json
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

# The launches' settings (launcher_env), for the runs in this process too (train_here), before torch loads
# its OpenMP runtime, which reads them once: a waiting OpenMP thread sleeps instead of spinning on a core
# that another worker's launch needs.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import psutil  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from filelock import FileLock  # noqa: E402

BIN = Path(sys.executable).parent
PYTHON = sys.executable
TORCHRUN = str(BIN / "torchrun")
HOROVODRUN = str(BIN / "horovodrun")
MPIRUN = "mpirun"
# As root, Open MPI refuses to start without these; --oversubscribe lets 3 ranks share 2 cores.
MPIRUN_FLAGS = ["--allow-run-as-root", "--oversubscribe", "--bind-to", "none"]
TRAIN = ["-m", "trainbridge.train"]
# trainbridge train on the embedded MNIST sample without a progress bar: the start of most test runs.
SAMPLE = ["--dataset", "mnist-sample", "--no-progress"]
# A small deterministic model and optimizer for runs whose weights are compared.
PLAIN_SGD = ["--model", "plaincnn", "--optimizer", "sgd", "--batch-size", "100"]
# The parity run: 12 steps of plaincnn and SGD; 2 processes with a batch of 32 each must end with the weights of
# one process with 64 (test_parity.py), and of the single-host run on two hosts (test_multihost.py).
PARITY_STEPS, PARITY_BATCH = 12, 32
PARITY = ["--model", "plaincnn", "--optimizer", "sgd", "--lr", "0.05", "--max-steps", str(PARITY_STEPS),
          "--dataset", "mnist-sample", "--seed", "5", "--no-progress"]
# A short 2-rank run of plaincnn and SGD in float32 under torchrun: the reference that test_speed_features'
# --amp and --compression runs move away from, and the launched job whose start-up line test_malloc_tuning reads.
SHORT_SGD = ["--model", "plaincnn", "--optimizer", "sgd", "--lr", "0.05", "--dataset", "mnist-sample", "--seed", "7",
             "--no-progress", "--max-steps", "8", "--batch-size", "32"]


def inherited_launcher_variables(env: Dict[str, str]) -> List[str]:
    """The variables of ``env`` that announce a launcher: a test must not inherit the one of whoever ran pytest."""
    return [k for k in env if k.startswith(("OMPI_", "PMI_", "PMIX_", "HOROVOD_", "SLURM_", "TORCHELASTIC_"))
            or k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                     "MASTER_ADDR", "MASTER_PORT", "TRAINBRIDGE_SPAWNED")]


def launcher_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ)
    for key in inherited_launcher_variables(env):
        del env[key]
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                # The suite runs three workers' launches on 2 cores: an OpenMP thread that spins while it
                # waits for work (libgomp's default) takes a core another process needs. It changes no result.
                "OMP_WAIT_POLICY": "PASSIVE",
                # Open MPI's shared-memory single-copy needs ptrace rights containers lack.
                "OMPI_MCA_btl_vader_single_copy_mechanism": "none"})
    env.update(extra or {})
    return env


def run(cmd: List[str], timeout: float, env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None
        ) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group; kill the group and fail the test on timeout."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=launcher_env(env), cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stacks = dump_stacks(proc.pid)
        kill_tree(proc.pid)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout}s (a hang): {' '.join(cmd)}\n"
                    f"stdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
                    f"\nstacks of its Python processes:\n{stacks}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _tree(pid: int) -> List[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def dump_stacks(pid: int) -> str:
    """py-spy's dump of every Python process under ``pid``: where a hung launch waits."""
    dumps = []
    for process in _tree(pid):
        try:
            if "python" not in process.name():
                continue
            for native in (["--native"], []):  # the Python frames where native unwinding fails
                dump = subprocess.run([str(BIN / "py-spy"), "dump", *native, "--pid", str(process.pid)],
                                      capture_output=True, text=True, timeout=30)
                if dump.returncode == 0:
                    break
            dumps.append(dump.stdout + dump.stderr)
        except (psutil.Error, OSError, subprocess.SubprocessError) as e:
            dumps.append(f"{process.pid}: no dump ({e})")
    return "\n".join(dumps)


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s process group and every process under it (torchrun starts each rank in a session
    of its own, so killing the launcher's group would leave the ranks running into later tests)."""
    tree = _tree(pid)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for process in tree:
        try:
            process.kill()
        except psutil.Error:
            pass


def check(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    # stderr's tail is long enough for a launcher's traceback after a rank's line and its py-spy dump.
    assert result.returncode == 0, (f"exit {result.returncode}: {' '.join(result.args)}\n"
                                    f"stdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-12000:]}")
    return result


def torchrun(nproc: int, args: List[str]) -> List[str]:
    return [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", *TRAIN, *args]


def horovodrun(nproc: int, mode: str, args: List[str]) -> List[str]:
    return [HOROVODRUN, "-np", str(nproc), f"--{mode}", PYTHON, *TRAIN, *args]


def mpirun(nproc: int, args: List[str]) -> List[str]:
    return [MPIRUN, *MPIRUN_FLAGS, "-np", str(nproc), PYTHON, *TRAIN, *args]


def plain(args: List[str]) -> List[str]:
    return [PYTHON, *TRAIN, *args]


def train_here(args: List[str]) -> subprocess.CompletedProcess:
    """``python -m trainbridge.train ARGS`` (one process, no launcher) run in this test process, through
    the same ``main`` and ``tb.init``, with its exit status and its output as :func:`run` gives them.

    For the checks of what one process trains, resumes or refuses, where the process itself is not the
    point: a launched ``python`` spends about 6 CPU-s on importing torch and torch._dynamo before its first
    step, which this process has already paid. What the run changes in this process is put back as its
    end would: the exception hook, the SIGTERM, SIGINT and SIGHUP handlers, the thread count, the random
    generators, the environment, and the output folder's lock (held until a process ends, so that a later
    launch there finds it free).
    A process's own end (``exit_process``, a signal, a bug's traceback) is what :func:`plain` runs check.
    """
    from trainbridge.cli.train import main as train_main
    from trainbridge.training import checkpoint

    hook, threads = sys.excepthook, torch.get_num_threads()
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    rngs = torch.random.get_rng_state(), np.random.get_state(), random.getstate()
    locks = set(checkpoint._held)
    streams, fds = (sys.stdout, sys.stderr), (os.dup(1), os.dup(2))
    environ = dict(os.environ)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        try:
            for key in inherited_launcher_variables(environ):
                del os.environ[key]
            for stream in streams:
                stream.flush()
            os.dup2(out.fileno(), 1)  # C-level writes too (torch's and gloo's warnings)
            os.dup2(err.fileno(), 2)
            sys.stdout, sys.stderr = out, err
            code = train_main(list(args))
        finally:
            out.flush()
            err.flush()
            sys.stdout, sys.stderr = streams
            os.dup2(fds[0], 1)
            os.dup2(fds[1], 2)
            for fd in fds:
                os.close(fd)
            os.environ.clear()
            os.environ.update(environ)
            sys.excepthook = hook
            for signum, handler in handlers.items():  # the stop agreement's (job.should_stop)
                signal.signal(signum, handler)
            torch.set_num_threads(threads)
            torch.random.set_rng_state(rngs[0])
            np.random.set_state(rngs[1])
            random.setstate(rngs[2])
            for directory in set(checkpoint._held) - locks:
                checkpoint._held.pop(directory).close()  # closing the lock file drops its lock, as an exit would
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(["train_here", *args], code, out.read(), err.read())


def env_ranks(argv: List[str], port: int, world_size: int = 2, one_host: bool = False) -> List[subprocess.Popen]:
    """A job started by the env:// variables alone, with no launcher: ``python argv`` once per rank, the
    rendezvous on 127.0.0.1:``port``. No launcher ends a rank when another exits. ``one_host``: also
    LOCAL_RANK and LOCAL_WORLD_SIZE, as torchrun sets them on one host (without them, each rank is
    taken to be alone on its host)."""
    def rank_env(rank: int) -> Dict[str, str]:
        env = {"WORLD_SIZE": str(world_size), "RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        return {**env, "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size)} if one_host else env
    return [subprocess.Popen([PYTHON, *argv], env=launcher_env(rank_env(rank)), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True) for rank in range(world_size)]


def start_waits(output: str) -> List[int]:
    """The seconds that the ranks' lines in ``output`` say they waited in the start of the job."""
    return [int(seconds) for seconds in re.findall(r"waited (\d+)s in start of the job", output)]


def copy_of(run_dir: Path, folder: Path) -> Path:
    """``run_dir``'s files copied into ``folder`` (made if missing), as if that run had written them there."""
    shutil.copytree(run_dir, folder, dirs_exist_ok=True)
    return folder


def load_final(output_dir: Path) -> dict:
    return torch.load(output_dir / "final.pt", weights_only=True)


def read_metrics(output_dir: Path) -> List[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


class Job:
    """A launcher running in the background, its output going to a log file.

    For tests that act on a job while it runs (kill a rank, send SIGTERM).
    """

    def __init__(self, cmd: List[str], log: Path, env: Optional[Dict[str, str]] = None) -> None:
        self.cmd, self.log = cmd, log
        self._out = open(log, "w")
        # Ctrl-C's SIGINT at its default, as for a command started from a terminal: a shell starts a
        # background job (`make test &`, nohup, some CI runners) with SIGINT ignored, and that carries
        # through pytest to the job, which then rightly ignores the Ctrl-C a test sends.
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT, text=True,
                                     env=launcher_env(env), start_new_session=True,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

    def output(self) -> str:
        return self.log.read_text()

    def wait_for_output(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"never printed {text!r} within {timeout}s:\n{self.output()[-3000:]}")
            time.sleep(0.2)

    def rank_process(self, rank: int) -> psutil.Process:
        """The worker process of ``rank`` (read from its launcher-set environment)."""
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                environ, cmdline = child.environ(), " ".join(child.cmdline())
            except psutil.Error:
                continue
            if "trainbridge.train" in cmdline and any(environ.get(k) == str(rank) for k in RANK_VARIABLES):
                return child
        pytest.fail(f"no worker process with rank {rank} under {self.cmd[0]}")

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"timed out after {timeout}s (a hang): {' '.join(self.cmd)}\n{self.output()[-3000:]}")
        finally:
            self._out.close()

    def kill(self) -> None:
        kill_tree(self.proc.pid)


RANK_VARIABLES = ("RANK", "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK")


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def bitwise_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----- the launcher matrix (marker matrix) ------------------------------------------------------------------
# make test checks each guarantee once per backend: under torchrun (the torch backend) and, where the
# Horovod backend's own code is on the path, under horovodrun --gloo. The same guarantee under the other
# launchers (horovodrun's MPI controller, mpirun, the --nproc spawner), on a third rank where two ranks already
# check it, across two hosts, on SLURM and against the real Horovod is the matrix: `make test-e2e` runs it,
# and CI runs both. Every launcher but SLURM's srun still starts in make test, in at least one test.
def in_matrix(names, matrix_names) -> list:
    """The names as parametrize values; those in matrix_names marked matrix."""
    unknown = set(matrix_names) - set(names)
    assert not unknown, f"matrix names that are not cases: {sorted(unknown)}"
    return [pytest.param(name, marks=pytest.mark.matrix) if name in matrix_names else name for name in names]


# ----- the parallel workers of make test and make test-e2e (--dist loadfile --no-loadscope-reorder) ---------
# A worker takes a whole test file, so that a file's module-scoped runs start once (spread test by test, each
# worker started them again) and a file's two-host namespaces are made once. The costliest files go first, so
# that none is left running alone at the end; the in-process tests (tests/unit) come last and fill the cores as
# the launches end. The order is from pytest --cpu-report on a 2-core machine; a file not listed keeps its place
# after these. make test deselects the first (the matrix); make test-e2e runs it first.
COSTLIEST_FIRST = [
    "tests/test_multihost.py",
    "tests/test_fault_tolerance.py",
    "tests/test_speed_features.py",
    "tests/test_waits_and_signals.py",
    "tests/test_resume_randomness.py",
    "tests/test_api.py",
    "tests/test_shm_allreduce.py",
    "tests/test_real_programs.py",
    "tests/test_same_model.py",
    "tests/test_misuse.py",
    "tests/test_bad_input_sweep.py",
    "tests/test_resume_errors.py",
    "tests/test_designsafe_launchers.py",
    "tests/test_parity.py",
    "tests/test_loaders.py",
    "tests/test_hvd_faults.py",
    "tests/test_checkpoint_faults.py",
    "tests/test_training.py",
    "tests/test_hvd_api.py",
]


def pytest_collection_modifyitems(items) -> None:
    place = {path: n for n, path in enumerate(COSTLIEST_FIRST)}
    items.sort(key=lambda item: place.get(item.nodeid.split("::")[0], len(place)))  # stable: the rest keep order


# ----- where the suite's CPU time goes: pytest --cpu-report N ----------------------------------------------
CPU_AT_START = pytest.StashKey[float]()


def _cpu_seconds() -> float:
    """CPU time of this process and of the processes it has waited for (a launcher waits for its ranks)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def pytest_addoption(parser) -> None:
    parser.addoption("--cpu-report", type=int, default=0, metavar="N",
                     help="list the N tests whose setup, call and teardown used the most CPU time (their processes "
                          "included): the suite is CPU-bound on 2 cores, so this is where its time goes")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    item.stash[CPU_AT_START] = _cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "teardown" and CPU_AT_START in item.stash:  # user_properties travel to xdist's controller
        report.user_properties.append(("cpu_seconds", _cpu_seconds() - item.stash[CPU_AT_START]))


def pytest_terminal_summary(terminalreporter, config) -> None:
    count = config.getoption("--cpu-report")
    if not count:
        return
    used = [(dict(report.user_properties).get("cpu_seconds", 0.0), report.nodeid)
            for reports in terminalreporter.stats.values() for report in reports
            if getattr(report, "when", None) == "teardown"]
    terminalreporter.write_sep("=", f"CPU time of the {count} costliest tests, of {sum(s for s, _ in used):.0f} s")
    for seconds, nodeid in sorted(used, reverse=True)[:count]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {nodeid}")


# ----- a script started once per launcher and compared with one plain python process ------------------------
def one_process_reference(out: Path, script: str, programs, timeout: float) -> dict:
    """``script --output-dir out`` in one plain python process (the local backend): {program: its saved dict}."""
    result = check(run([PYTHON, script, "--output-dir", str(out)], timeout=timeout))
    saved = {program: torch.load(out / f"{program}.pt", weights_only=True) for program in programs}
    for program, final in saved.items():
        assert (final["world_size"], final["backend"]) == (1, "local"), program
    return {"out": out, "stdout": result.stdout, **saved}


def launch_once(tmp_path_factory, prefix: str, commands: Dict[str, Callable[[List[str]], List[str]]],
                timeout: float) -> Callable[[str], Tuple[Path, subprocess.CompletedProcess]]:
    """``launch(name)``: (output dir, checked result) of ``commands[name](["--output-dir", dir])``, run once."""
    done: dict = {}

    def launch(name: str) -> Tuple[Path, subprocess.CompletedProcess]:
        if name not in done:
            out = tmp_path_factory.mktemp(f"{prefix}_{name}")
            done[name] = out, run(commands[name](["--output-dir", str(out)]), timeout=timeout)
        out, result = done[name]
        return out, check(result)
    return launch


# ----- runs that tests in several modules check, each started once per session -----------------------------
def once_per_session(tmp_path_factory, worker_id: str, name: str, cmd: Callable[[Path], List[str]]
                     ) -> Tuple[Path, subprocess.CompletedProcess]:
    """``cmd(out)`` run and checked once in the whole session: its output folder and the launch's output.

    A session fixture is set up once per pytest-xdist worker, and two test files on two workers would start
    the same run twice. The first worker to ask runs it in the folder the run's workers share, under a file
    lock; the others wait for it and read what it left (pytest-xdist's documented way).
    """
    if worker_id == "master":  # no workers: this process is the session
        out = tmp_path_factory.mktemp(name)
        return out, check(run(cmd(out), timeout=180))
    out = tmp_path_factory.getbasetemp().parent / name  # popen-gwN's parent: this run's, shared by its workers
    record = out.parent / f"{name}.json"
    with FileLock(f"{record}.lock"):
        if not record.exists():
            result = check(run(cmd(out), timeout=180))
            record.write_text(json.dumps([result.stdout, result.stderr]))
        stdout, stderr = json.loads(record.read_text())
    return out, subprocess.CompletedProcess(cmd(out), 0, stdout, stderr)


@pytest.fixture(scope="session")
def parity_spawn_run(tmp_path_factory, worker_id) -> Path:
    """The parity run on 2 processes of trainbridge's --nproc spawner (batch 32 each): its output folder."""
    return once_per_session(tmp_path_factory, worker_id, "parity_spawn", lambda out: plain(
        PARITY + ["--batch-size", str(PARITY_BATCH), "--nproc", "2", "--output-dir", str(out)]))[0]


@pytest.fixture(scope="session")
def short_sgd_torchrun_run(tmp_path_factory, worker_id) -> Tuple[Path, subprocess.CompletedProcess]:
    """``SHORT_SGD`` under torchrun with 2 processes: its output folder and the launch's output."""
    return once_per_session(tmp_path_factory, worker_id, "short_sgd_torchrun",
                            lambda out: torchrun(2, SHORT_SGD + ["--output-dir", str(out)]))
