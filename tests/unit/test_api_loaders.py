"""trainbridge.api.loaders: this rank's batch from the global batch, a pure function of the world size.

How the loaders deal, shuffle and resume is tests/test_loaders.py's and tests/test_sharding.py's.
"""
import pytest

from trainbridge.api.loaders import per_rank_batch_size
from trainbridge.errors import UserError


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 12])
def test_a_global_batch_is_dealt_evenly_among_the_ranks(world):
    assert per_rank_batch_size(None, 12, world) * world == 12


def test_a_per_rank_batch_is_kept_as_given():
    assert per_rank_batch_size(5, None, 3) == 5
    assert per_rank_batch_size(2.5, None, 3) == 2.5  # TrainLoader refuses it, naming batch_size


@pytest.mark.parametrize("given,world,line", [
    (13, 2, "a global batch of 13 cannot be dealt evenly among 2 ranks; use a multiple of 2 (12 or 14)"),
    (64, 3, "a global batch of 64 cannot be dealt evenly among 3 ranks; use a multiple of 3 (63 or 66)"),
    (2, 3, "a global batch of 2 cannot be dealt evenly among 3 ranks; use a multiple of 3 (3)"),
    (0, 1, "global_batch_size must be a whole number of at least 1 (got 0)"),
    (6.0, 1, "global_batch_size must be a whole number of at least 1 (got 6.0)"),
    (True, 1, "global_batch_size must be a whole number of at least 1 (got True)"),
])
def test_a_global_batch_the_ranks_cannot_share_is_one_line_with_the_fix(given, world, line):
    with pytest.raises(UserError) as error:
        per_rank_batch_size(None, given, world)
    assert str(error.value) == f"train_loader: {line}"


@pytest.mark.parametrize("batch_size,global_batch_size,said", [(None, None, "neither"), (4, 8, "both")])
def test_exactly_one_of_the_two_batch_sizes(batch_size, global_batch_size, said):
    line = f"^train_loader: give either batch_size= .* or global_batch_size= .*, not {said}$"
    with pytest.raises(UserError, match=line):
        per_rank_batch_size(batch_size, global_batch_size, 2)
