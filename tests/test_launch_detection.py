"""Launcher detection and ``--backend auto`` are pure functions of the environment."""
import pytest

from trainbridge.backends import choose_backend
from trainbridge.errors import UserError
from trainbridge.launch import LaunchEnv, detect_launch
from trainbridge.launch.slurm import first_host, tasks_on_first_node

TORCHRUN = {"TORCHELASTIC_RUN_ID": "x", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "MASTER_ADDR": "n0", "MASTER_PORT": "1234"}
HOROVODRUN = {"HOROVOD_RANK": "2", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "0",
              "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "1"}
OPENMPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "0"}
MPICH = {"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"}
SRUN = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_STEP_ID": "0", "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1", "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
        "SLURM_JOB_ID": "4242"}


def test_torchrun():
    env = detect_launch(TORCHRUN)
    assert env == LaunchEnv("torchrun", rank=3, world_size=4, local_rank=1, local_size=2, node_rank=1,
                            master_addr="n0", master_port=1234)


def test_spawned_workers_report_spawn():
    assert detect_launch({**TORCHRUN, "TRAINBRIDGE_SPAWNED": "1"}).launcher == "spawn"


def test_horovodrun_gloo():
    env = detect_launch(HOROVODRUN)
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_size, env.node_rank) == \
        ("horovodrun", 2, 4, 0, 2, 1)


def test_open_mpi_and_mpich():
    ompi = detect_launch(OPENMPI)
    assert (ompi.launcher, ompi.rank, ompi.world_size, ompi.local_rank, ompi.local_size) == ("mpirun", 1, 2, 1, 2)
    mpich = detect_launch(MPICH)
    assert (mpich.launcher, mpich.rank, mpich.world_size, mpich.local_rank, mpich.local_size) == ("mpirun", 5, 8, 1, 4)


def test_srun_step():
    env = detect_launch(SRUN)
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_size, env.node_rank) == \
        ("srun", 5, 8, 1, 4, 1)
    assert env.master_addr == "gpu07" and env.master_port == 29500 + 4242 % 1000


def test_sbatch_script_without_step_is_plain_python():
    assert detect_launch({"SLURM_JOB_ID": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"}).launcher == "python"


def test_plain_python():
    assert detect_launch({}) == LaunchEnv("python")


def test_torchrun_wins_inside_slurm_and_mpi():
    assert detect_launch({**SRUN, **OPENMPI, **TORCHRUN}).launcher == "torchrun"


@pytest.mark.parametrize("nodelist,host", [("node1", "node1"), ("gpu[03-05,9],cpu1", "gpu03"),
                                           ("a-b[10,12]", "a-b10"), ("x1,x2", "x1")])
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


def test_tasks_on_first_node():
    assert tasks_on_first_node("2(x3),1") == 2 and tasks_on_first_node("4") == 4


@pytest.mark.parametrize("launcher,with_hvd,expected", [
    ("torchrun", True, "torch"), ("spawn", True, "torch"), ("horovodrun", False, "horovod"),
    ("mpirun", True, "horovod"), ("mpirun", False, "torch"), ("srun", True, "torch"), ("python", True, "local"),
])
def test_auto_backend(launcher, with_hvd, expected):
    assert choose_backend("auto", LaunchEnv(launcher), horovod_available=lambda: with_hvd) == expected


def test_explicit_backend_is_kept_and_unknown_rejected():
    assert choose_backend("torch", LaunchEnv("mpirun")) == "torch"
    with pytest.raises(UserError, match="unknown backend"):
        choose_backend("jax", LaunchEnv("python"))


def test_world_size_without_the_rest_of_env_is_one_line_naming_what_is_missing():
    # Run alone, each process would train its own model as a one-process job.
    with pytest.raises(UserError, match=r"WORLD_SIZE=2 is set but RANK, MASTER_ADDR, MASTER_PORT are not"):
        detect_launch({"WORLD_SIZE": "2"})
    assert detect_launch({"WORLD_SIZE": "1"}).launcher == "python"


@pytest.mark.parametrize("environ", [{"TORCHELASTIC_RUN_ID": "x", "MASTER_PORT": "abc"},
                                     {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "abc"}])
def test_a_variable_that_is_not_a_number_is_named(environ):
    with pytest.raises(UserError, match=r"MASTER_PORT='abc' is not a whole number"):
        detect_launch(environ)
