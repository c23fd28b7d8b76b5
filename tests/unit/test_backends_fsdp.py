"""The pure parts of trainbridge/backends/fsdp.py: which modules are sharded as units, and shard='s values."""
import pytest
import torch
from torch import nn

from trainbridge.backends.fsdp import repeated_blocks, replicated_part, shard_blocks
from trainbridge.errors import UserError


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)


def test_the_repeated_blocks_of_a_container_are_the_units_outermost_only():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.ModuleList([Block(), Block()]), nn.Linear(4, 1))
    units = repeated_blocks(model)
    # The two Blocks (not the Linears inside them); the Sequential's two Linears repeat too, so each is one.
    assert units == [model[0], model[3], model[2][0], model[2][1]]


def test_a_model_without_repeated_blocks_is_one_unit_the_root():
    assert repeated_blocks(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Conv1d(4, 4, 1))) == []


def test_named_classes_are_the_units_wherever_they_are():
    model = nn.Sequential(Block(), nn.Sequential(Block(), nn.Linear(4, 4)))
    assert repeated_blocks(model, (Block,)) == [model[0], model[1][0]]


def test_shard_takes_a_bool_or_module_classes_and_says_what_else_is_wrong():
    assert shard_blocks(False) is None and shard_blocks(True) == ()
    assert shard_blocks([Block]) == (Block,) and shard_blocks(Block) == (Block,)
    for wrong in ("yes", [nn.Linear(2, 2)], [], [int]):
        with pytest.raises(UserError, match="shard=True"):
            shard_blocks(wrong)


def test_a_plain_tensor_is_compared_whole():
    tensor = torch.ones(3)
    assert replicated_part(tensor) is tensor
