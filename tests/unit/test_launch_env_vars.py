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
