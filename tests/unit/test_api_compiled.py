"""trainbridge.api.compiled: a module compiled by ``torch.compile``, seen as the module itself.

``torch.compile`` only wraps here (nothing is traced until a call), so these tests cost no compilation.
"""
import torch
from torch import nn

from trainbridge.api.compiled import keys_as_in, uncompiled, uncompiled_key, without_compiled_keys


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3), nn.Linear(3, 1))


def test_uncompiled_takes_off_every_compile_wrapper_and_nothing_else():
    module = model()
    assert uncompiled(module) is module
    assert uncompiled(torch.compile(module)) is module
    outer = nn.Sequential(torch.compile(module))
    assert uncompiled(outer) is outer  # a compiled submodule stays where it is


def test_keys_lose_their_orig_mod_segments_wherever_they_are():
    assert uncompiled_key("_orig_mod.0.weight") == "0.weight"
    assert uncompiled_key("blocks.1._orig_mod.weight") == "blocks.1.weight"
    assert uncompiled_key("_orig_mod") == "" and uncompiled_key("my_orig_mode.w") == "my_orig_mode.w"


def test_a_compiled_models_state_has_the_uncompiled_keys_and_module_versions():
    module = model()
    plain = module.state_dict()
    state = without_compiled_keys(torch.compile(module).state_dict())
    assert list(state) == list(plain)
    assert state._metadata["1"] == plain._metadata["1"] == {"version": 2}  # BatchNorm's, read by its loader
    assert without_compiled_keys(plain) is plain  # nothing to rename: the same object
    fresh = model()
    fresh.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), plain.values()))


def test_a_state_is_renamed_to_the_keys_of_the_model_it_loads_into():
    plain_state = model().state_dict()
    compiled = torch.compile(model())
    compiled.load_state_dict(keys_as_in(plain_state, compiled))  # strict
    inner = model()
    inner[0] = torch.compile(inner[0])  # one compiled submodule: "0._orig_mod.weight"
    inner.load_state_dict(keys_as_in(without_compiled_keys(compiled.state_dict()), inner))
    back = model()
    back.load_state_dict(keys_as_in(inner.state_dict(), back))
    assert torch.equal(back[0].weight, plain_state["0.weight"])
    assert keys_as_in(plain_state, back) is plain_state
