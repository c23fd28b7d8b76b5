"""trainbridge.launch.rendezvous: the rendezvous store, served where the job lives and kept to one job."""
import socket
import subprocess
import time

import pytest
from conftest import PYTHON, kill_tree, launcher_env, run
from python_child import run_python

from trainbridge.errors import UserError
from trainbridge.launch.environment import LaunchEnv
from trainbridge.launch.network import first_external_address
from trainbridge.launch.rendezvous import agree_on_world_size, claim_rank, free_port, launch_identity, open_store

RANK_0, RANK_1 = LaunchEnv("spawn", rank=0, world_size=2), LaunchEnv("spawn", rank=1, world_size=2)


def test_a_local_jobs_store_is_served_on_loopback_only():
    external = first_external_address()
    if external is None:
        pytest.skip("this host has no address but loopback")
    port = free_port()
    store = open_store(RANK_0, 10, "127.0.0.1", port)
    store.set("k", "v")
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass  # the job's ranks reach it
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((external, port), timeout=5)  # no other host does


def test_a_port_held_by_another_program_is_one_line():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(UserError, match=rf"^rank 0 cannot serve the rendezvous on port {port} of 127\.0\.0\.1: "
                                            rf"another program holds it \(.*\); choose a free MASTER_PORT$"):
            open_store(RANK_0, 10, "127.0.0.1", port)


def test_a_rank_of_a_second_job_on_the_port_is_refused_at_once():
    port = free_port()
    store = open_store(RANK_0, 10, "127.0.0.1", port)
    claim_rank(store, RANK_0, "127.0.0.1", port, "")
    claim_rank(store, RANK_0, "127.0.0.1", port, "")  # this process again (a second tb.init): its own place
    first_job = run_python(f"""
        from trainbridge.launch.environment import LaunchEnv
        from trainbridge.launch.rendezvous import claim_rank, open_store
        rank_1 = LaunchEnv("env", rank=1, world_size=2)
        claim_rank(open_store(rank_1, 10, "127.0.0.1", {port}), rank_1, "127.0.0.1", {port}, "")
        print("joined")
    """)
    assert first_job.stdout.strip() == "joined", first_job
    with pytest.raises(UserError, match=rf"^rank 1 found its place in the rendezvous store at 127\.0\.0\.1:{port} "
                                        rf"taken by another job's rank 1 \(a job, host {socket.gethostname()}, pid "
                                        rf"\d+\): two jobs share MASTER_PORT {port}; give each job its own "
                                        rf"MASTER_PORT$"):
        claim_rank(open_store(RANK_1, 10, "127.0.0.1", port), RANK_1, "127.0.0.1", port, "")
    # A whole process of the second job, through tb.init: one line, at once, not gloo's traceback later.
    second_job = run([PYTHON, "-c", "import trainbridge as tb; tb.init(timeout=60)"], timeout=60,
                     env={"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    assert second_job.returncode == 2, second_job
    assert second_job.stderr.strip().startswith("trainbridge: error: rank 1 found its place in the rendezvous store"), (
        second_job.stderr)
    assert len(second_job.stderr.strip().splitlines()) == 1, second_job.stderr


def test_a_rank_outside_the_world_stops_its_peers_at_once_not_at_their_timeout():
    port = free_port()
    rank = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    join = [PYTHON, "-c", "import trainbridge as tb; tb.init(timeout=120)"]
    rank_0 = subprocess.Popen(join, env=launcher_env({**rank, "RANK": "0"}), stderr=subprocess.PIPE, text=True)
    try:
        started = time.monotonic()
        refused = run(join, timeout=60, env={**rank, "RANK": "2"})
        assert refused.returncode == 2 and refused.stderr.strip() == (
            "trainbridge: error: RANK=2 with WORLD_SIZE=2: RANK must be 0 to 1; give the job's processes RANK 0, 1, "
            "... WORLD_SIZE-1, one each"), refused
        _, err = rank_0.communicate(timeout=60)
        assert rank_0.returncode == 2 and time.monotonic() - started < 60, err  # not its 120 s timeout
        assert err.strip() == ("trainbridge: error: rank 0: a process of this job was refused and will never join "
                               "(RANK=2 with WORLD_SIZE=2: RANK must be 0 to 1; give the job's processes RANK 0, 1, "
                               "... WORLD_SIZE-1, one each); this rank stops too"), err
    finally:
        kill_tree(rank_0.pid)


def test_ranks_of_two_launched_jobs_in_one_store_are_one_line():
    port = free_port()
    store = open_store(RANK_0, 10, "127.0.0.1", port)
    store.set("trainbridge/world_size/0", "2 SLURM job 7.0")
    with pytest.raises(UserError, match=r"^rank 1 of SLURM job 8\.0 met rank 0 of SLURM job 7\.0 in one rendezvous "
                                        r"store: two jobs share MASTER_PORT; give each job its own MASTER_PORT$"):
        agree_on_world_size(open_store(RANK_1, 10, "127.0.0.1", port), RANK_1, 10, "SLURM job 8.0")


def test_the_launch_identity_is_the_launchers_job():
    assert launch_identity({"TORCHELASTIC_RUN_ID": "abc"}) == "torchrun run id abc"
    assert launch_identity({"TORCHELASTIC_RUN_ID": "none"}) == ""  # every static torchrun job has it
    assert launch_identity({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"}) == "SLURM job 7.0"
    assert launch_identity({"OMPI_MCA_ess_base_jobid": "98159", "PMIX_NAMESPACE": "x"}) == "mpirun job 98159"
    assert launch_identity({"HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1", "HOROVOD_GLOO_RENDEZVOUS_PORT": "4000"}) == (
        "horovodrun at 10.0.0.1:4000")
    assert launch_identity({"MASTER_PORT": "29500"}) == ""
