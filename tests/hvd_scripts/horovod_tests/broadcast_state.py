"""broadcast_parameters and broadcast_optimizer_state: every stock optimizer's state and options,
parameters without gradients, Muon, SparseAdam, and LBFGS (refused)."""

import inspect
import itertools
import os
import tempfile
from collections.abc import Iterable

import torch

import trainbridge.hvd as hvd

from .common import (
    OPTIMIZER_OPTIONS,
    NotApplicable,
    expect_error,
    mse_step,
    new_optimizer,
    optimizer_classes,
    regression_batch,
    regression_model,
)


def test_broadcast_state():
    x, y = regression_batch()

    def create_model(opt_class, opt_params):
        model = regression_model()
        optimizer = hvd.DistributedOptimizer(new_optimizer(opt_class, opt_params, model),
                                             named_parameters=model.named_parameters())
        return model, optimizer

    def model_values(model):
        return [(k, v.clone()) for k, v in sorted(model.state_dict().items())]

    def optimizer_values(optimizer):
        state_dict, results = optimizer.state_dict(), []
        for group in state_dict["param_groups"]:
            for pid in group["params"]:
                for k, v in sorted(state_dict["state"].get(pid, {}).items()):
                    results.append((k, v.clone() if torch.is_tensor(v) else v))
        return results

    checked = []
    for (name, opt_class), opt_params in itertools.product(optimizer_classes(), OPTIMIZER_OPTIONS):
        model, optimizer = create_model(opt_class, opt_params)
        mse_step(model, optimizer, x, y)

        model_before = model_values(model)
        for _, value in model_before:
            hvd.broadcast_(value, root_rank=0)
        opt_before = []
        for key, value in optimizer_values(optimizer):
            if torch.is_tensor(value):
                hvd.broadcast_(value, root_rank=0)
            else:
                value = type(value)(hvd.broadcast(torch.Tensor([value]), root_rank=0).numpy()[0])
            opt_before.append((key, value))

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "state.pt")
            if hvd.rank() == 0:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
            model, optimizer = create_model(opt_class, opt_params)
            if hvd.rank() == 0:
                checkpoint = torch.load(path, weights_only=False)
                model.load_state_dict(checkpoint["model"])
                optimizer.load_state_dict(checkpoint["optimizer"])

        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        for (k0, v0), (k1, v1) in zip(model_before, model_values(model)):
            assert k0 == k1 and type(v0) is type(v1) and (v0 == v1).all(), (name, k0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        if not hvd.using_real_horovod:
            # trainbridge's addition: the fresh optimizers' state-creating step (weight decay) leaves the weights
            # the root's, which Horovod does not (its ranks other than 0 end up decayed, apart).
            for (k0, v0), (_, v1) in zip(model_before, model_values(model)):
                assert torch.equal(v0, v1), (name, k0, "moved by broadcast_optimizer_state")
        expected_tensors = 0 if opt_class == torch.optim.SGD and "momentum" not in opt_params else 4
        assert len(optimizer.state_dict()["state"]) == expected_tensors, (name, optimizer.state_dict()["state"])
        after = optimizer_values(optimizer)
        assert len(after) == len(opt_before), name
        for (k0, v0), (k1, v1) in zip(opt_before, after):
            assert k0 == k1 and type(v0) is type(v1), (name, k0, type(v0), type(v1))
            assert (v0 == v1).all() if torch.is_tensor(v0) else v0 == v1, (name, k0)
        checked.append(name)
    assert len(set(checked)) >= 10, checked  # every stock optimizer but LBFGS and SparseAdam


def test_broadcast_state_options():
    x, y = regression_batch()
    params_0 = dict(lr=0.1, momentum=0.8, weight_decay=0.2, nesterov=True, betas=(0.9, 0.999), etas=(0.8, 2.4),
                    step_sizes=(1e-5, 100))
    params_1 = dict(lr=0.2, momentum=0.9, weight_decay=0.1, nesterov=False, betas=(0.8, 0.9), etas=(0.25, 1.75),
                    step_sizes=(1e-7, 5))
    for _, opt_class in optimizer_classes():
        model = regression_model()
        optimizer = hvd.DistributedOptimizer(
            new_optimizer(opt_class, params_0 if hvd.rank() == 0 else params_1, model),
            named_parameters=model.named_parameters())
        for _ in range(2):
            mse_step(model, optimizer, x, y)
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        accepted = inspect.signature(opt_class.__init__).parameters
        for key, expected in ((k, v) for k, v in params_0.items() if k in accepted):
            actual = optimizer.param_groups[0][key]
            if not isinstance(expected, Iterable):
                actual, expected = [actual], [expected]
            for a, e in zip(actual, expected):
                assert type(a) is type(e) and abs(a - e) < 1e-5, (opt_class.__name__, key, a, e)


def test_broadcast_state_no_grad():
    class ModelNoGrad(torch.nn.Module):
        def __init__(self, a, b):
            super().__init__()
            self.a = torch.nn.Parameter(a.int(), requires_grad=False)
            self.b = torch.nn.Parameter(b)

        def forward(self, x):
            return torch.index_select(self.b, 0, self.a.long()) * x

    model = ModelNoGrad(torch.Tensor([1, 3]), torch.rand(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001, weight_decay=1e-6, momentum=0.9, nesterov=True)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    grad = optimizer.param_groups[0]["params"][1].grad
    assert optimizer.param_groups[0]["params"][0].grad is None
    assert torch.equal(grad, hvd.broadcast(grad, root_rank=0))


def test_broadcast_state_muon():
    if not hasattr(torch.optim, "Muon"):
        raise NotApplicable(f"torch {torch.__version__} has no Muon")
    torch.manual_seed(hvd.rank())
    model = torch.nn.Sequential(torch.nn.Linear(8, 6, bias=False), torch.nn.Linear(6, 2, bias=False))
    optimizer = hvd.DistributedOptimizer(torch.optim.Muon(model.parameters(), lr=0.02 * (hvd.rank() + 1)),
                                         named_parameters=model.named_parameters())
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    states = hvd.allgather_object(optimizer.state_dict())
    assert all(s["param_groups"][0]["lr"] == 0.02 for s in states), [s["param_groups"][0]["lr"] for s in states]
    for key in states[0]["state"]:
        for name, value in states[0]["state"][key].items():
            assert all(torch.equal(s["state"][key][name], value) for s in states), (key, name)


def test_broadcast_state_sparse_adam():
    torch.manual_seed(hvd.rank())
    embedding = torch.nn.Embedding(10, 3, sparse=True)
    optimizer = torch.optim.SparseAdam(embedding.parameters(), lr=0.01 * (hvd.rank() + 1))
    embedding(torch.tensor([1, 2, 3])).sum().backward()
    optimizer.step()
    hvd.broadcast_optimizer_state(optimizer, root_rank=0, model=embedding)
    states = hvd.allgather_object(optimizer.state_dict())
    assert all(s["param_groups"][0]["lr"] == 0.01 for s in states)
    assert all(torch.equal(s["state"][0]["exp_avg"], states[0]["state"][0]["exp_avg"]) for s in states)


def test_broadcast_state_lbfgs_refused():
    model = torch.nn.Linear(2, 1)
    expect_error(lambda: hvd.broadcast_optimizer_state(torch.optim.LBFGS(model.parameters()), 0), ValueError)
