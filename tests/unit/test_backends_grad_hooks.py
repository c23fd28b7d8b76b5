"""trainbridge.backends.grad_hooks: DDP's contract for Horovod, with a stand-in for the collective library.

The stand-in averages over one rank (a copy of the gradient) and records every average it
starts and when each is waited for, so these tests see what the hooks do within a backward
pass: which gradients are averaged, and that the wait comes after the last of them.
"""
import copy

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel
from torch.utils.checkpoint import checkpoint

from trainbridge.backends.grad_hooks import HookedAverage
from trainbridge.errors import UserError


class Recorder:
    """start_average and agree_used of one rank; ``events``: ("start", name) and ("wait", name) in order."""

    def __init__(self):
        self.events = []

    def start_average(self, tensor, name):
        self.events.append(("start", name))

        def wait():
            self.events.append(("wait", name))
            return tensor.clone()

        return wait

    def agree_used(self, used):
        self.events.append(("agree", int(used.sum())))
        return used

    def started(self):
        return [name for kind, name in self.events if kind == "start"]


class Net(nn.Module):
    """Four layers; ``segments`` says which run under a reentrant checkpoint: "last" (the last two), "middle"."""

    def __init__(self, segments=(), unused=False):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c, self.d = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)
        self.unused = nn.Linear(1, 1) if unused else None
        self.segments = segments

    def forward(self, x):
        h = torch.tanh(self.a(x))
        middle = lambda t: torch.tanh(self.b(t))  # noqa: E731
        h = checkpoint(middle, h, use_reentrant=True) if "middle" in self.segments else middle(h)
        last = lambda t: self.d(torch.tanh(self.c(t)))  # noqa: E731
        return checkpoint(last, h, use_reentrant=True) if "last" in self.segments else last(h)


def hooked(model, find_unused=False):
    recorder = Recorder()
    average = HookedAverage(model, "m", recorder.start_average, recorder.agree_used, find_unused)
    return average, recorder


@pytest.mark.parametrize("segments", [("last",), ("middle",), ("middle", "last")])
@pytest.mark.parametrize("find_unused", [False, True])
def test_reentrant_checkpointing_anywhere_averages_every_gradient_after_the_last(segments, find_unused):
    model = Net(segments)
    plain = Net()
    _, recorder = hooked(model, find_unused)
    x = torch.randn(5, 3)
    model(x).sum().backward()  # one line before: "2 parameter(s) ... got no gradient" with segments ("last",)
    plain(x).sum().backward()
    names = {f"m.{n}" for n, _ in model.named_parameters()}
    assert sorted(recorder.started()) == sorted(names)  # each averaged once
    waits = [i for i, (kind, _) in enumerate(recorder.events) if kind == "wait"]
    starts = [i for i, (kind, _) in enumerate(recorder.events) if kind == "start"]
    assert len(waits) == len(names) and min(waits) > max(starts)  # one wait, at the end of the outer pass
    assert [kind for kind, _ in recorder.events].count("agree") == (1 if find_unused else 0)
    for (n, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.allclose(p.grad, q.grad), n


def test_a_parameter_without_gradient_is_still_named_after_a_reentrant_pass():
    model = Net(("last",), unused=True)
    hooked(model)
    missing = r"2 parameter\(s\) of the prepared model got no gradient"
    missing += r" in this backward pass \(unused.weight, unused.bias\)"
    with pytest.raises(UserError, match=missing):
        model(torch.randn(5, 3)).sum().backward()


def test_a_second_backward_of_a_kept_graph_waits_once_more():
    model = Net(("last",))
    _, recorder = hooked(model)
    loss = model(torch.randn(5, 3)).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    assert len(recorder.started()) == 2 * len(list(model.parameters()))
    assert [kind for kind, _ in recorder.events].count("wait") == 2 * len(list(model.parameters()))


@pytest.mark.parametrize("make_copy", [copy.deepcopy, lambda m: AveragedModel(m).module])
def test_a_copy_of_a_hooked_model_is_the_plain_module_and_the_model_stays_hooked(make_copy):
    model = Net()
    _, recorder = hooked(model)
    copied = make_copy(model)
    assert type(copied) is Net and not copied._forward_pre_hooks and "__deepcopy__" not in vars(copied)
    assert all(p._post_accumulate_grad_hooks is None for p in copied.parameters())
    assert all(torch.equal(p, q) and p is not q for p, q in zip(copied.parameters(), model.parameters()))
    copied(torch.randn(5, 3)).sum().backward()
    assert recorder.events == []  # the copy's gradients are its own
    model(torch.randn(5, 3)).sum().backward()
    assert len(recorder.started()) == len(list(model.parameters()))  # the model's hooks were put back
    assert len(model._forward_pre_hooks) == 1 and "__deepcopy__" in vars(model)
