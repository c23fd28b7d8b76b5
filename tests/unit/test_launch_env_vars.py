"""trainbridge.launch.env_vars: the env:// variables set by hand, read or refused in one line."""
import pytest

from trainbridge.errors import UserError
from trainbridge.launch import detect_launch

ENV = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("rank", ["-1", "2", "7"])
def test_a_rank_outside_the_world_is_one_line_naming_both_numbers(rank):
    with pytest.raises(UserError, match=rf"^RANK={rank} with WORLD_SIZE=2: RANK must be 0 to 1; give the job's "
                                        rf"processes RANK 0, 1, \.\.\. WORLD_SIZE-1, one each$"):
        detect_launch({**ENV, "RANK": rank, "WORLD_SIZE": "2"})


def test_a_world_of_no_process_is_one_line():
    with pytest.raises(UserError, match=r"^RANK=0 with WORLD_SIZE=-3: WORLD_SIZE must be at least 1; "):
        detect_launch({**ENV, "RANK": "0", "WORLD_SIZE": "-3"})


def test_every_rank_of_the_world_is_read():
    assert [detect_launch({**ENV, "RANK": str(r), "WORLD_SIZE": "3"}).rank for r in range(3)] == [0, 1, 2]


@pytest.mark.parametrize("port", ["0", "70000", "-1"])
def test_a_master_port_that_is_no_tcp_port_is_one_line(port):
    with pytest.raises(UserError, match=rf"^MASTER_PORT={port} is not a TCP port; set it to a free port from 1 to "
                                        r"65535 \(e\.g\. 29500\)$"):
        detect_launch({**ENV, "RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": port})


def test_a_number_past_pythons_digit_limit_is_named_as_too_large():
    with pytest.raises(UserError, match=r"^the environment variable WORLD_SIZE holds a number of 5000 digits, far too "
                                        r"large for a count of processes, ranks or a port; set it to the intended "
                                        r"value \(or unset it\)$"):
        detect_launch({**ENV, "RANK": "0", "WORLD_SIZE": "9" * 5000})
    with pytest.raises(UserError, match=r"^the environment variable WORLD_SIZE='x{40}\.\.\.' is not a whole number"):
        detect_launch({**ENV, "RANK": "0", "WORLD_SIZE": "x" * 5000})
