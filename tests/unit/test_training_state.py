"""trainbridge.training.state: the progress counters, which result is best, and the checkpoint dict."""
import dataclasses

import pytest
import torch

from trainbridge.api.files import atomic_save, unloadable_value
from trainbridge.training.checkpoint import FORMAT, read_checkpoint
from trainbridge.training.state import Progress, TrainState


@pytest.mark.parametrize("best, accuracy, loss, improves", [
    ((None, None), 0.1, 9.0, True),   # the first evaluation is the best so far
    ((0.5, 1.0), 0.6, 2.0, True),     # higher accuracy wins, whatever the loss
    ((0.5, 1.0), 0.4, 0.1, False),
    ((0.5, 1.0), 0.5, 0.9, True),     # a tie: the lower loss breaks it
    ((0.5, 1.0), 0.5, 1.0, False),    # no better at all
    ((None, 1.0), None, 0.9, True),   # no accuracy (regression): the loss decides alone
    ((None, 1.0), None, 1.1, False),
    ((None, None), None, 5.0, True),
])
def test_improves(best, accuracy, loss, improves):
    progress = Progress(best_accuracy=best[0], best_loss=best[1])
    assert progress.improves(accuracy, loss) is improves


def make_state(progress=None):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return TrainState(model, optimizer, scheduler, progress or Progress())


def train_one_step(state):
    state.optimizer.zero_grad()
    state.model(torch.ones(4, 3)).sum().backward()
    state.optimizer.step()
    state.scheduler.step()
    state.progress.step += 1


def test_a_snapshot_is_a_copy_that_restore_puts_back():
    state = make_state()
    train_one_step(state)
    snapshot = state.snapshot()
    weights, lr = state.model.weight.detach().clone(), state.optimizer.param_groups[0]["lr"]
    train_one_step(state)  # training on must not change the snapshot
    state.progress.epoch = 3
    assert not torch.equal(state.model.weight, weights)
    assert torch.equal(snapshot["model"]["weight"], weights) and snapshot["progress"]["step"] == 1
    state.restore(snapshot)
    assert torch.equal(state.model.weight, weights) and state.optimizer.param_groups[0]["lr"] == lr
    assert state.progress == Progress(step=1) and state.scheduler.last_epoch == 1
    momentum = state.optimizer.state[state.model.weight]["momentum_buffer"]
    assert torch.equal(momentum, snapshot["optimizer"]["state"][0]["momentum_buffer"])


def test_the_checkpoint_holds_the_counters_and_summaries_and_reads_back_with_weights_only(tmp_path):
    progress = Progress(epoch=2, position=96, step=40, samples=1376, best_accuracy=0.75, best_loss=0.5,
                        best_epoch=1)
    state = make_state(progress)
    config = {"seed": 7, "lr": 0.1, "model": "plaincnn", "milestones": [1, 2]}
    checkpoint = state.checkpoint(config=config, backend="torch", world_size=2, batch_size=16)
    assert checkpoint["format"] == FORMAT and checkpoint["progress"] == dataclasses.asdict(progress)
    assert (checkpoint["epoch"], checkpoint["step"], checkpoint["step_in_epoch"]) == (2, 40, 3)  # 96 // (2 * 16)
    assert checkpoint["sampler"] == {"seed": 7, "epoch": 2, "position": 96}
    assert checkpoint["best"] == {"val_accuracy": 0.75, "val_loss": 0.5, "epoch": 1}
    assert (checkpoint["backend"], checkpoint["world_size"], checkpoint["batch_size"]) == ("torch", 2, 16)
    assert checkpoint["scaler"] is None and checkpoint["config"] == config
    assert unloadable_value(checkpoint) is None
    atomic_save(checkpoint, str(tmp_path / "last.pt"))
    loaded = read_checkpoint(str(tmp_path / "last.pt"))
    fresh = make_state()
    fresh.restore(loaded)  # the same keys as a snapshot
    assert fresh.progress == progress and torch.equal(fresh.model.bias, state.model.bias)


def test_the_fp16_loss_scale_is_part_of_the_state():
    state = make_state()
    state.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    snapshot = state.snapshot()
    assert snapshot["scaler"]["scale"] == 1024.0
    state.scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    state.restore(snapshot)
    assert state.scaler.get_scale() == 1024.0
