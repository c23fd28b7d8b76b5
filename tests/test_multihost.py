"""Across two hosts on the real engines: torchrun, mpirun, horovodrun and a SLURM cluster.

The two hosts are network namespaces on this machine (tests/multihost/hosts.py):
``tbnode1`` (10.77.0.1) and ``tbnode2`` (10.77.0.2), one rank on each, talking
only over their veth link. Every path must end within 1e-5 of the single-host
2-process run, for trainbridge's own loop (the parity run of test_parity.py)
and for the public API's examples/own_loop.py in float64.

Needs root and iproute2 (skips with the reason elsewhere); sshd and SLURM are
installed by scripts/setup.sh. Everything the tests make is removed at the end,
also after a failure, and leftovers of a crashed run (prefix ``tbmh``) at the start.
"""
from __future__ import annotations

import dataclasses
import os
import re
import time
from pathlib import Path
from typing import Dict, List, Optional

import psutil
import pytest
from conftest import (
    HOROVODRUN,
    PARITY,
    PARITY_BATCH,
    PARITY_STEPS,
    PYTHON,
    TORCHRUN,
    TRAIN,
    check,
    launcher_env,
    load_final,
    max_abs_diff,
    read_metrics,
    run,
    start_waits,
)
from multihost.hosts import IFACE, Host, TwoHosts, kill_pids, missing_requirements, remove_leftovers, run_on
from multihost.jobs import HostProcess, wait_all
from multihost.openmpi import mpirun_flags, write_rsh_agent
from multihost.slurm import SlurmCluster, job_state, missing_daemons, submit, wait_job
from multihost.sshd import SSHD, SshdPerHost

# Two hosts and SLURM are the launcher matrix (conftest.in_matrix): make test-e2e runs this file, and make test
# its in-process parts (tests/test_multihost_units.py).
pytestmark = pytest.mark.matrix

ROOT = Path(__file__).resolve().parent.parent
OWN_LOOP = str(ROOT / "examples" / "own_loop.py")
K, B = PARITY_STEPS, PARITY_BATCH
# The parity run of test_parity.py, one rank per host; --threads 1, or each host's one rank would take every core of
# the one machine the two hosts share.
PARITY = [*PARITY, "--batch-size", str(B), "--threads", "1"]
OWN = ["--float64", "--epochs", "1"]  # 25 steps of a global batch of 60
TOLERANCE = 1e-5
RUN_TIMEOUT = 180


# ----- the two hosts and the single-host references ----------------------------------
@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    why = missing_requirements()
    if why:
        pytest.skip(why)
    remove_leftovers()
    with TwoHosts(tmp_path_factory.mktemp("hosts")) as two:
        yield two


@pytest.fixture(scope="module")
def references(tmp_path_factory, parity_spawn_run) -> Dict[str, dict]:
    """Final weights of the single-host 2-process runs (trainbridge's --nproc 2 spawner; the parity run's is
    test_parity's, started once per session)."""
    own = tmp_path_factory.mktemp("ref_own")
    check(run([PYTHON, OWN_LOOP, *OWN, "--nproc", "2", "--output-dir", str(own)], timeout=RUN_TIMEOUT))
    return {"parity": load_final(parity_spawn_run)["model"], "own": load_final(own)["model"]}


def programs(out: Path) -> Dict[str, List[str]]:
    """The two programs, as arguments after ``python``."""
    return {"parity": [*TRAIN, *PARITY, "--output-dir", str(out / "parity")],
            "own": [OWN_LOOP, *OWN, "--output-dir", str(out / "own")]}


def assert_matches(references: Dict[str, dict], out: Path, path: str, program: str) -> float:
    final = load_final(out / program)
    diff = max_abs_diff(final["model"], references[program])
    print(f"{path} {program}: max abs diff {diff:.3g} vs the single-host 2-process run")
    assert diff < TOLERANCE, f"{path}, {program}: max abs weight difference {diff:.3g} vs the single-host run"
    if program == "parity":
        metrics = read_metrics(out / program)[-1]
        assert (metrics["world_size"], final["step"]) == (2, K)
    else:
        assert final["world_size"] == 2
    return diff


def on_hosts(commands: Dict[Host, List[str]], logdir: Path, env: Optional[Dict[str, str]] = None,
             timeout: float = RUN_TIMEOUT) -> List[HostProcess]:
    """Start one command per host together; fail the test on a hang or a non-zero exit."""
    logdir.mkdir(parents=True, exist_ok=True)
    procs = [HostProcess(host, argv, logdir / f"{host.name}.log", launcher_env(env), cwd=str(ROOT))
             for host, argv in commands.items()]
    codes, hang = wait_all(procs, timeout)
    if hang:
        pytest.fail(hang)
    assert codes == [0] * len(procs), "\n".join(p.describe() for p in procs)
    return procs


# ----- torchrun ------------------------------------------------------------------------
def torchrun_static(host_rank: int, master: Host, port: int, program: List[str]) -> List[str]:
    return [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(host_rank),
            "--master-addr", master.addr, "--master-port", str(port), *program]


def torchrun_c10d(endpoint: str, run_id: str, program: List[str]) -> List[str]:
    return [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, *program]


@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_torchrun_across_hosts_matches_one_host(rendezvous, hosts, references, tmp_path):
    a, b = hosts.hosts
    for program, args in programs(tmp_path).items():
        if rendezvous == "static":
            commands = {h: torchrun_static(r, a, 29611, args) for r, h in enumerate(hosts.hosts)}
        else:  # the agent on tbnode1 serves the store: the endpoint is its resolvable host name
            commands = {h: torchrun_c10d(f"{a.name}:29612", f"tbmh-{program}", args) for h in hosts.hosts}
        procs = on_hosts(commands, tmp_path / f"logs-{program}")
        assert_matches(references, tmp_path, f"torchrun {rendezvous}", program)
        if program == "parity":  # really on two hosts: no shared-memory exchange between them
            assert "the ranks are on several hosts" in procs[0].output()


# ----- mpirun (Open MPI, no ssh) -------------------------------------------------------
@pytest.fixture(scope="module")
def rsh_agent(hosts, tmp_path_factory) -> Path:
    return write_rsh_agent(hosts.hosts, tmp_path_factory.mktemp("openmpi") / "rsh_agent")


@pytest.mark.parametrize("backend", ["torch", "horovod"])
def test_mpirun_across_hosts_matches_one_host(backend, hosts, rsh_agent, references, tmp_path):
    a = hosts.hosts[0]
    for program, args in programs(tmp_path).items():
        cmd = ["mpirun", *mpirun_flags(hosts.hosts, rsh_agent), PYTHON, *args, "--backend", backend]
        on_hosts({a: cmd}, tmp_path / f"logs-{program}")
        assert_matches(references, tmp_path, f"mpirun --backend {backend}", program)


# ----- horovodrun (over a test sshd) ---------------------------------------------------
@pytest.fixture(scope="module")
def sshd(hosts, tmp_path_factory):
    if not os.path.exists(SSHD):
        pytest.skip(f"{SSHD} is missing: scripts/setup.sh installs openssh-server")
    with SshdPerHost(hosts.hosts, tmp_path_factory.mktemp("sshd")) as server:
        yield server


@pytest.mark.parametrize("mode", ["gloo", "mpi"])
def test_horovodrun_across_hosts_matches_one_host(mode, hosts, sshd, references, tmp_path):
    a = hosts.hosts[0]
    for program, args in programs(tmp_path).items():
        cmd = [HOROVODRUN, "-np", "2", "-H", ",".join(f"{h.name}:1" for h in hosts.hosts), f"--{mode}",
               *sshd.horovodrun_flags(), PYTHON, *args]
        on_hosts({a: cmd}, tmp_path / f"logs-{program}", env={"PATH": sshd.path()})
        assert_matches(references, tmp_path, f"horovodrun --{mode}", program)


# ----- SLURM: the job scripts of examples/slurm on a 2-node cluster ------------------------
SLURM_SCRIPTS = ROOT / "examples" / "slurm"


@pytest.fixture(scope="module")
def slurm(hosts, tmp_path_factory):
    missing = missing_daemons()
    if missing:
        pytest.skip(f"SLURM is missing ({', '.join(missing)}): "
                    f"scripts/setup.sh installs slurmctld, slurmd, slurm-client")
    with SlurmCluster(hosts.hosts, tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


def slurm_env(slurm: SlurmCluster, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    return {**slurm.env(), "PATH": f"{Path(PYTHON).parent}:{os.environ.get('PATH', '')}", "PYTHON": PYTHON,
            **(extra or {})}


def sbatch(slurm: SlurmCluster, script: str, args: List[str], log: Path, env: Optional[Dict[str, str]] = None,
           timeout: float = RUN_TIMEOUT) -> str:
    """Run one of examples/slurm/ with sbatch from tbnode1 and wait; its output, after a zero exit."""
    job = submit(slurm, ["--output", str(log), "--chdir", str(ROOT), str(SLURM_SCRIPTS / script), *args],
                 env=launcher_env(slurm_env(slurm, env)))
    try:
        fields = wait_job(slurm, job, timeout)
    except TimeoutError as exc:
        pytest.fail(f"{script}: {exc}\n{log.read_text()[-4000:] if log.exists() else ''}")
    output = log.read_text() if log.exists() else ""
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), f"{script}: {fields}\n{output[-4000:]}"
    return output


@pytest.mark.parametrize("script", ["srun.sbatch", "torchrun_c10d.sbatch"])
def test_slurm_job_scripts_across_hosts_match_one_host(script, hosts, slurm, references, tmp_path):
    for program, args in programs(tmp_path).items():
        sbatch(slurm, script, args, tmp_path / f"{program}.out")
        assert_matches(references, tmp_path, script, program)


@pytest.mark.parametrize("script", ["horovod_pmix.sbatch", "horovodrun.sbatch"])
def test_slurm_horovod_job_scripts_match_one_host(script, hosts, slurm, sshd, references, tmp_path):
    args = programs(tmp_path)["parity"]
    env = {"PATH": f"{sshd.bin}:{Path(PYTHON).parent}:{os.environ.get('PATH', '')}",
           "HOROVODRUN": HOROVODRUN, "HOROVODRUN_ARGS": " ".join(sshd.horovodrun_flags())}
    output = sbatch(slurm, script, args, tmp_path / "job.out", env=env)
    assert_matches(references, tmp_path, script, "parity")
    assert read_metrics(tmp_path / "parity")[-1]["backend"] == "horovod", output[-2000:]


def test_slurm_requeue_resumes_from_the_sigterm_checkpoint(hosts, slurm, tmp_path):
    # What a preemption does: SIGTERM to every task, then the job goes back to the queue.
    out, log = tmp_path / "out", tmp_path / "job.out"
    args = [*TRAIN, *FAULT_RUN, "--output-dir", str(out)]
    job = submit(slurm, ["--output", str(log), "--chdir", str(ROOT), str(SLURM_SCRIPTS / "requeue.sbatch"), *args],
                 env=launcher_env(slurm_env(slurm)))
    deadline = time.monotonic() + RUN_TIMEOUT
    while "epoch 1 step 62" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, f"no progress in SLURM job {job}:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)
    requeue = slurm.client(["scontrol", "requeue", str(job)], timeout=30)
    assert requeue.returncode == 0, requeue.stderr
    # SLURM holds a requeued job back for 2 minutes (its BeginTime); let it start at once.
    while job_state(slurm, job).get("JobState") != "PENDING":
        assert time.monotonic() < deadline, f"job {job} never went back to the queue: {job_state(slurm, job)}"
        time.sleep(0.2)
    slurm.client(["scontrol", "update", f"JobId={job}", "StartTime=now"], timeout=30)
    try:
        fields = wait_job(slurm, job, RUN_TIMEOUT)
    except TimeoutError as exc:
        pytest.fail(f"{exc}\n{log.read_text()[-4000:]}")
    output = log.read_text()
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "1"), \
        f"{fields}\n{output[-4000:]}"
    stopped = re.findall(r"stopped by SIGTERM after step (\d+)", output)
    assert len(stopped) == 1 and 62 <= int(stopped[0]) < FAULT_STEPS, output[-4000:]
    assert f"resuming from {out}/last.pt" in output, output[-4000:]
    assert load_final(out)["step"] == FAULT_STEPS


# ----- a host fails -------------------------------------------------------------------
FAULT_STEPS = 124  # 2 epochs of 62 steps of 2 x 32 samples (4,000 // 64)
FAULT_TIMEOUT = 20
FAULT_RUN = ["--model", "plaincnn", "--optimizer", "sgd", "--lr", "0.05", "--dataset", "mnist-sample", "--seed", "5",
             "--batch-size", "32", "--epochs", "2", "--threads", "1", "--no-progress", "--checkpoint-every", "10",
             "--timeout", str(FAULT_TIMEOUT)]


def test_losing_a_host_ends_the_other_within_the_timeout_and_the_relaunch_resumes(hosts, tmp_path):
    a, b = hosts.hosts
    out = tmp_path / "out"
    args = [*TRAIN, *FAULT_RUN, "--output-dir", str(out)]
    commands = {h: torchrun_static(r, a, 29621, args) for r, h in enumerate(hosts.hosts)}
    procs = [HostProcess(h, argv, tmp_path / f"{h.name}.log", launcher_env(), cwd=str(ROOT))
             for h, argv in commands.items()]
    survivor, lost = procs
    try:
        deadline = time.monotonic() + RUN_TIMEOUT
        while "epoch 1 step 62" not in survivor.output():
            assert survivor.poll() is None and lost.poll() is None and time.monotonic() < deadline, \
                "\n".join(p.describe() for p in procs)
            time.sleep(0.1)
        # Every process of the job on tbnode2 at once: its torchrun agent and its worker.
        killed = [pid for pid in b.pids() if pid in descendants(lost.proc.pid)]
        kill_pids(killed)
        lost_at = time.monotonic()
        codes, hang = wait_all([survivor], timeout=FAULT_TIMEOUT + 30)
        detected = (survivor.ended or time.monotonic()) - lost_at
    finally:
        for p in procs:
            p.kill()
    output = survivor.output()
    print(f"host tbnode2 lost ({len(killed)} processes killed): tbnode1 exited {codes[0]} after {detected:.1f}s")
    assert not hang, hang
    assert codes[0] != 0, output[-3000:]
    assert detected < FAULT_TIMEOUT + 5, f"tbnode1 took {detected:.1f}s (--timeout {FAULT_TIMEOUT}):\n{output[-3000:]}"
    errors = [line for line in output.splitlines() if line.startswith("trainbridge: error:")]
    assert errors and any(b.addr in line or b.name in line for line in errors), \
        f"no one-line error naming the lost peer {b.name} ({b.addr}):\n{output[-3000:]}"
    # The relaunch on both hosts continues from the last checkpoint.
    procs = on_hosts(commands, tmp_path / "relaunch")
    assert "resuming from" in procs[0].output()
    assert load_final(out)["step"] == FAULT_STEPS


def descendants(pid: int) -> List[int]:
    try:
        parent = psutil.Process(pid)
        return [pid] + [child.pid for child in parent.children(recursive=True)]
    except psutil.Error:
        return []


# ----- host names that resolve to loopback, unreachable addresses: start-up fails fast or adapts ----
@pytest.fixture(scope="module")
def loopback_named(hosts) -> List[Host]:
    """The same two hosts with hosts files as often found: tbnode1's own name on 127.0.1.1
    (Debian's default line), tbnode2's own name missing (it does not resolve there)."""
    renamed = []
    for host in hosts.hosts:
        others = "".join(f"{h.addr}\t{h.name}\n" for h in hosts.hosts if h is not host)
        own = f"127.0.1.1\t{host.name}\n" if host is hosts.hosts[0] else ""
        path = host.hosts_file.with_name(host.hosts_file.name + ".loopback")
        path.write_text(f"127.0.0.1\tlocalhost\n{own}{others}")
        renamed.append(dataclasses.replace(host, hosts_file=path))
    return renamed


def test_host_names_on_loopback_or_unresolved_need_no_gloo_socket_ifname(hosts, loopback_named, rsh_agent, references,
                                                                         tmp_path):
    # gloo would listen on loopback on both hosts; trainbridge gives it the interface towards the rendezvous.
    a = loopback_named[0]
    args = programs(tmp_path)["parity"]
    procs = on_hosts({h: torchrun_static(r, a, 29631, args) for r, h in enumerate(loopback_named)},
                     tmp_path / "torchrun")
    assert f"resolves only to loopback (127.0.1.1); gloo uses tbv0, the interface towards {a.addr}" in procs[0].output()
    expected = f"does not resolve (gloo takes loopback); gloo uses tbv0, the interface towards {a.addr}"
    assert expected in procs[1].output()
    assert_matches(references, tmp_path, "torchrun static, loopback host names", "parity")
    # Under mpirun rank 0 publishes an address the other host can reach, not its name.
    agent = write_rsh_agent(loopback_named, tmp_path / "rsh_agent")
    on_hosts({a: ["mpirun", *mpirun_flags(loopback_named, agent), PYTHON, *args, "--backend", "torch"]},
             tmp_path / "mpirun")
    assert_matches(references, tmp_path, "mpirun --backend torch, loopback host names", "parity")


START_TIMEOUT = 10


def test_a_failed_gloo_connection_ends_every_rank_within_the_timeout(hosts, tmp_path):
    # gloo on loopback on both hosts, as where host names do not resolve: each rank is
    # given the other's 127.0.0.1, rank 1 fails, and rank 0 waits in gloo's
    # connectFullMesh for a peer that never comes (it once hung past --timeout).
    a, b = hosts.hosts
    args = [*TRAIN, *PARITY, "--timeout", str(START_TIMEOUT), "--output-dir", str(tmp_path / "out")]
    procs = [HostProcess(h, torchrun_static(r, a, 29641, args), tmp_path / f"{h.name}.log",
                         launcher_env({"GLOO_SOCKET_IFNAME": "lo"}), cwd=str(ROOT))
             for r, h in enumerate(hosts.hosts)]
    codes, hang = wait_all(procs, timeout=START_TIMEOUT + 60)
    took = [p.ended - p.started for p in procs]
    print(f"gloo start-up failure: exits {codes} after {took[0]:.1f}s (tbnode1) and {took[1]:.1f}s (tbnode2)")
    assert not hang, hang
    waits = []
    for proc, seconds in zip(procs, took):
        assert proc.proc.returncode != 0, proc.describe()
        assert "trainbridge: error:" in proc.output(), proc.describe()
        waits += start_waits(proc.output())
        # On top of the join's bound come torchrun's own start-up and the imports: 19.5 s on a slow
        # 2-core CI machine running three test workers. A hang (as once in connectFullMesh) is wait_all's.
        assert seconds < START_TIMEOUT + 5 + 45, f"{proc.host.name} ended after {seconds:.1f}s\n{proc.describe()}"
    # The rank left waiting for the peer that failed ends at the join's bound (timeout + 5 s; the
    # watchdog looks once a second), whatever the machine's start-up took.
    assert waits and max(waits) <= START_TIMEOUT + 5 + 1, (waits, [p.describe() for p in procs])


def test_an_exported_master_addr_is_honoured_under_mpirun(hosts, rsh_agent, tmp_path):
    # An address no host has: the job must use it (and fail on it, naming it) rather than pick its own.
    a = hosts.hosts[0]
    args = [*TRAIN, *PARITY, "--backend", "torch", "--timeout", str(START_TIMEOUT), "--output-dir", str(tmp_path)]
    cmd = ["mpirun", *mpirun_flags(hosts.hosts, rsh_agent), "-x", "MASTER_ADDR=10.77.0.99", "-x", "MASTER_PORT=29651",
           PYTHON, *args]
    started = time.monotonic()
    result = run_on(a, cmd, timeout=START_TIMEOUT + 60, env=launcher_env())
    took = time.monotonic() - started
    print(f"unreachable MASTER_ADDR under mpirun: exit {result.returncode} after {took:.1f}s")
    assert result.returncode != 0
    assert "10.77.0.99:29651" in result.stderr, result.stderr[-3000:]
    # As above: the ranks' own waits end at the join's bound; on top of it come mpirun's start of
    # both hosts and the imports (22 s on a slow 2-core CI machine running three test workers).
    waits = start_waits(result.stderr)
    assert waits and max(waits) <= START_TIMEOUT + 5 + 1, (waits, result.stderr[-3000:])
    assert took < START_TIMEOUT + 5 + 45, result.stderr[-3000:]


# ----- trainbridge doctor --hosts --------------------------------------------------------
def doctor_hosts(host: Host, sshd: SshdPerHost, *extra: str, env: Optional[Dict[str, str]] = None):
    cmd = [PYTHON, "-m", "trainbridge", "doctor", "--hosts", "tbnode1,tbnode2", "--ssh-port", "2222", *extra]
    return run_on(host, cmd, timeout=120, env=launcher_env({"PATH": sshd.path(), **(env or {})}),
                        cwd=str(ROOT))


def test_doctor_hosts_names_each_problem_in_one_line_with_its_fix(hosts, loopback_named, sshd):
    a, b = hosts.hosts
    good = doctor_hosts(a, sshd, "--rdzv-endpoint", "tbnode1:29400",
                        env={"MASTER_ADDR": a.addr, "MASTER_PORT": "29500"})
    assert good.returncode == 0 and "hosts: no problem found" in good.stdout, good.stdout + good.stderr
    assert "interfaces towards the other hosts: tbnode1 tbv0, tbnode2 tbv0" in good.stdout, good.stdout
    # Every problem at once: tbnode1's name on loopback, tbnode2's link under another
    # name, an endpoint no agent serves, a MASTER_ADDR nobody has.
    hosts.rename_link(b, IFACE, "tbv1")
    try:
        bad = doctor_hosts(loopback_named[0], sshd, "--rdzv-endpoint", "10.77.0.9:29400",
                           env={"MASTER_ADDR": "10.77.0.99", "MASTER_PORT": "29500"})
    finally:
        hosts.rename_link(b, "tbv1", IFACE)
    problems = [line for line in bad.stdout.splitlines() if line.startswith("problem: ")]
    print("\n".join(problems))
    assert bad.returncode == 1, bad.stdout + bad.stderr
    expected = {"resolves only to loopback": "GLOO_SOCKET_IFNAME=tbv0",
                "interfaces with different names (tbnode1: tbv0, tbnode2: tbv1)": "--network-interface",
                "rendezvous endpoint 10.77.0.9:29400 is none of the hosts": "--local-addr",
                "MASTER_ADDR 10.77.0.99 is not reachable": "use an address of the first host"}
    for what, fix in expected.items():
        assert [line for line in problems if what in line and fix in line], (what, bad.stdout)
    assert len(problems) == len(expected), bad.stdout
