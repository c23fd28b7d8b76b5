"""The tutorial models have the documented architectures; the optimizers behind --optimizer."""
import copy

import pytest
import torch
from torch import nn

from trainbridge.errors import UserError
from trainbridge.models import MODELS, build_model


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_for_a_batch_of_digits(name):
    out = build_model(name)(torch.randn(4, 1, 28, 28))
    assert out.shape == (4, 10)


def layers(model, kind):
    return [m for m in model.modules() if isinstance(m, kind)]


def test_architectures():
    bn = build_model("convnet-bn")
    assert [c.kernel_size for c in layers(bn, nn.Conv2d)] == [(5, 5), (5, 5)]
    assert len(layers(bn, nn.BatchNorm2d)) == 2 and layers(bn, nn.Linear)[0].in_features == 1568
    drop = build_model("convnet-dropout")
    assert [(lin.in_features, lin.out_features) for lin in layers(drop, nn.Linear)] == [(4608, 64), (64, 10)]
    assert layers(drop, nn.Dropout) and not layers(drop, nn.Dropout2d)
    mlp = build_model("mlp")
    shapes = [(lin.in_features, lin.out_features) for lin in layers(mlp, nn.Linear)]
    assert shapes == [(784, 128), (128, 128), (128, 10)]
    assert all(d.p == 0.2 for d in layers(mlp, nn.Dropout))
    plain = build_model("plaincnn")
    assert not layers(plain, nn.Dropout) and not layers(plain, nn.BatchNorm2d)


def test_unknown_model():
    with pytest.raises(UserError, match="unknown model"):
        build_model("vgg")


def test_optimizers_and_scale_lr():
    from trainbridge.training.config import TrainConfig
    from trainbridge.training.loop import build_optimizer

    params = list(build_model("mlp").parameters())
    for name, cls in (("sgd", torch.optim.SGD), ("adam", torch.optim.Adam), ("adadelta", torch.optim.Adadelta)):
        cfg = TrainConfig(optimizer=name, lr=0.1, scale_lr=True)
        optimizer = build_optimizer(cfg, params, world_size=4)
        assert isinstance(optimizer, cls) and optimizer.param_groups[0]["lr"] == pytest.approx(0.4)
    assert build_optimizer(TrainConfig(optimizer="sgd", lr=0.1), params, 4).param_groups[0]["lr"] == 0.1


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_adam_and_sgd_use_fused_kernels_with_the_same_update(name):
    from trainbridge.training.config import TrainConfig
    from trainbridge.training.loop import build_optimizer

    torch.manual_seed(0)
    model = build_model("convnet-dropout")
    looped, initial = copy.deepcopy(model), copy.deepcopy(model)
    cfg = TrainConfig(optimizer=name, lr=1e-3, momentum=0.9)
    fused = build_optimizer(cfg, model.parameters(), world_size=1)
    assert fused.param_groups[0]["fused"] is True
    reference = (torch.optim.Adam(looped.parameters(), lr=1e-3, foreach=False) if name == "adam"
                 else torch.optim.SGD(looped.parameters(), lr=1e-3, momentum=0.9, foreach=False))
    for _ in range(3):
        grads = [torch.randn_like(p) for p in model.parameters()]
        for params, optimizer in ((model.parameters(), fused), (looped.parameters(), reference)):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            optimizer.step()
    diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), looped.parameters()))
    moved = max((a - b).abs().max().item() for a, b in zip(model.parameters(), initial.parameters()))
    assert diff < 1e-6 and moved > 1e-4, (diff, moved)  # the same update, and an update at all


def test_a_checkpoint_from_the_looped_kernel_resumes_on_the_fused_one():
    from trainbridge.training.config import TrainConfig
    from trainbridge.training.loop import build_optimizer
    from trainbridge.training.optimizers import load_keeping_kernels

    torch.manual_seed(0)
    model = build_model("mlp")
    resumed_model = copy.deepcopy(model)
    old = torch.optim.Adam(model.parameters(), lr=1e-3)  # as written before fused kernels: fused None
    assert old.param_groups[0]["fused"] is None

    def step(params, optimizer, grads):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizer.step()

    for _ in range(2):
        step(model.parameters(), old, [torch.randn_like(p) for p in model.parameters()])
    resumed_model.load_state_dict(model.state_dict())
    resumed = build_optimizer(TrainConfig(optimizer="adam", lr=1e-3), resumed_model.parameters(), world_size=1)
    load_keeping_kernels(resumed, copy.deepcopy(old.state_dict()))
    assert resumed.param_groups[0]["fused"] is True  # this run's kernel, not the checkpoint's
    first = next(iter(resumed.state.values()))
    assert int(first["step"]) == 2 and first["exp_avg"].abs().sum() > 0  # the moments came along

    grads = [torch.randn_like(p) for p in model.parameters()]
    step(model.parameters(), old, grads)
    step(resumed_model.parameters(), resumed, grads)
    diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), resumed_model.parameters()))
    assert diff < 1e-6, diff  # the third step continues the same Adam state


def test_loading_a_state_with_other_parameter_groups_still_fails_loudly():
    from trainbridge.training.optimizers import load_keeping_kernels

    one = torch.optim.Adam([nn.Parameter(torch.zeros(2))], fused=True)
    two = torch.optim.Adam([{"params": [nn.Parameter(torch.zeros(2))]}, {"params": [nn.Parameter(torch.zeros(3))]}])
    with pytest.raises(ValueError, match="parameter groups"):
        load_keeping_kernels(one, two.state_dict())
