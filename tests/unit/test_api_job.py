"""trainbridge.api.job: ``tb.init`` and the ``Job`` a loop uses, on a one-rank torch job in this process.

One ``tb.init`` serves the module (:mod:`one_rank_job` puts the process back afterwards).
What needs several ranks (averaging, ranks that disagree) is the launches' to test.
"""
import argparse
import copy
import os
import random
import signal
import sys

import numpy
import pytest
import torch
import torch.distributed as dist
from one_rank_job import one_rank_job
from python_child import run_python
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset

import trainbridge as tb
from trainbridge.api.process_end import current, excepthook
from trainbridge.api.stop import StopSignal
from trainbridge.errors import UserError


@pytest.fixture(scope="module")
def job():
    with one_rank_job() as job:
        yield job
    assert current.job is None


def test_init_joins_as_rank_0_of_1_and_installs_the_one_line_excepthook(job):
    assert (job.rank, job.world_size, job.local_rank, job.is_main) == (0, 1, 0, True)
    assert (job.backend_name, job.launcher, job.device) == ("torch", "env", torch.device("cpu"))
    assert current.job is job and sys.excepthook is excepthook
    assert isinstance(signal.getsignal(signal.SIGTERM).__self__, StopSignal)
    assert repr(job) == "Job(backend=torch, rank=0, world_size=1, local_rank=0, device=cpu, launcher=env)"
    assert job.watchdog.what is None  # disarmed once joined


def test_a_second_init_is_one_line_naming_the_fix(job):
    with pytest.raises(UserError, match=r"tb.init\(\) was already called in this process; use the job it returned"):
        tb.init(backend="torch")
    assert current.job is job


# ----- prepare, backward, step ------------------------------------------------------------------
def test_training_through_the_job_matches_the_plain_loop(job):
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    module = copy.deepcopy(plain)
    model, optimizer = job.prepare(module, torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9))
    reference = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9)
    for _ in range(4):
        x, y = torch.randn(16, 4), torch.randn(16, 1)
        optimizer.zero_grad()
        job.backward(torch.nn.functional.mse_loss(model(x), y))
        norm = job.clip_grad_norm_(model, max_norm=1e9)
        job.step(optimizer)
        reference.zero_grad()
        torch.nn.functional.mse_loss(plain(x), y).backward()
        assert torch.isclose(norm, torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e9))
        reference.step()
    for ours, theirs in zip(job.unwrap(model).parameters(), plain.parameters()):
        assert torch.equal(ours, theirs)
    assert job.unwrap(model) is module and list(model.state_dict()) == list(plain.state_dict())


def test_no_sync_then_one_backward_averages_the_summed_micro_batches(job):
    torch.manual_seed(1)
    module = torch.nn.Linear(3, 1)
    plain = copy.deepcopy(module)
    model, _ = job.prepare(module)
    first, second = torch.randn(5, 3), torch.randn(5, 3)
    with job.no_sync(model):
        job.backward(model(first).sum())
    job.backward(model(second).sum())
    plain(torch.cat([first, second])).sum().backward()
    assert torch.allclose(module.weight.grad, plain.weight.grad, atol=1e-6)


def test_a_model_is_prepared_once(job):
    model, _ = job.prepare(torch.nn.Linear(1, 1))
    with pytest.raises(UserError, match="this model was already prepared"):
        job.prepare(model)
    with pytest.raises(UserError, match="this model was already prepared"):
        job.prepare(job.unwrap(model))


# ----- torch.compile before or after prepare (backend="eager": dynamo and its wrapper, no code generation) --------
@pytest.mark.parametrize("when", ["before", "after"])
def test_a_model_compiled_before_or_after_prepare_is_seen_through(job, tmp_path, when):
    torch.manual_seed(2)
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    model, _ = job.prepare(torch.compile(module, backend="eager") if when == "before" else module)
    if when == "after":
        model = torch.compile(model, backend="eager")
    assert job.unwrap(model) is module
    with pytest.raises(UserError, match="this model was already prepared"):
        job.prepare(model)
    with pytest.raises(UserError, match="this model was already prepared"):
        job.prepare(torch.compile(module, backend="eager"))
    wrapper = model if when == "before" else model._orig_mod  # the DDP wrapper: no_sync switches it off
    assert isinstance(wrapper, DistributedDataParallel)
    with job.no_sync(model):
        assert wrapper.require_backward_grad_sync is False
        job.backward(model(torch.randn(2, 3)).sum())
    assert wrapper.require_backward_grad_sync is True

    job.save({"model": model}, str(tmp_path / "ckpt.pt"))
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)["model"]
    assert list(saved) == ["0.weight", "0.bias", "2.weight", "2.bias"]  # the uncompiled module's keys
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    fresh.load_state_dict(saved)  # strict: exactly these keys
    assert torch.equal(fresh[0].weight, module[0].weight)
    with torch.no_grad():
        module[0].weight.zero_()
    job.load(str(tmp_path / "ckpt.pt"), into={"model": model})
    assert torch.equal(module[0].weight, fresh[0].weight)


def test_a_checkpoint_with_compiled_keys_loads_into_an_uncompiled_model(job, tmp_path):
    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    compiled = torch.compile(copy.deepcopy(module), backend="eager")
    torch.nn.init.ones_(compiled._orig_mod[0].weight)
    torch.save({"model": compiled.state_dict()}, tmp_path / "compiled.pt")  # "_orig_mod.0.weight", ...
    model, _ = job.prepare(module)
    job.load(str(tmp_path / "compiled.pt"), into={"model": model})
    assert torch.equal(module[0].weight, torch.ones(2, 2))


def test_an_unknown_amp_is_one_line(job):
    with pytest.raises(UserError, match="amp 'fp8' is not supported; use off, bf16 or fp16"):
        job.prepare(torch.nn.Linear(1, 1), amp="fp8")
    assert job.amp == "off"


class Recommender(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(6, 3, sparse=True)
        self.head = torch.nn.Linear(3, 1)

    def forward(self, ids):
        return self.head(self.table(ids)).square().mean()


def test_several_optimizers_come_back_in_order_and_a_sparse_gradient_stays_sparse(job):
    torch.manual_seed(2)
    module = Recommender()
    plain = copy.deepcopy(module)
    sparse_opt, dense_opt = torch.optim.SparseAdam([module.table.weight], lr=0.1), torch.optim.Adam(
        module.head.parameters(), lr=0.1)
    model, first, second = job.prepare(module, sparse_opt, dense_opt)
    assert first is sparse_opt and second is dense_opt
    references = torch.optim.SparseAdam([plain.table.weight], lr=0.1), torch.optim.Adam(plain.head.parameters(), lr=0.1)
    for ids in ([1, 4, 4], [0, 5, 1], [2, 2, 3]):
        for opt in (sparse_opt, dense_opt, *references):
            opt.zero_grad()
        job.backward(model(torch.tensor(ids)))
        assert module.table.weight.grad.is_sparse
        job.step(sparse_opt)
        job.step(dense_opt)
        plain(torch.tensor(ids)).backward()
        for opt in references:
            opt.step()
    for ours, theirs in zip(module.parameters(), plain.parameters()):
        assert torch.equal(ours, theirs)
    with pytest.raises(UserError, match=r"job\.clip_grad_norm_: some of these parameters have sparse gradients"):
        job.clip_grad_norm_(model, 1.0)  # torch's would end in a traceback from linalg_vector_norm
    assert job.clip_grad_norm_(module.head.parameters(), 1.0) > 0


def test_prepare_returns_the_shape_it_was_given(job):
    alone = job.prepare(torch.nn.Linear(1, 1))
    assert len(alone) == 2 and alone[1] is None
    assert job.prepare(torch.nn.Linear(1, 1), None)[1] is None
    module = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    one = job.prepare(module, optimizer)
    assert len(one) == 2 and one[1] is optimizer


def test_clip_grad_norm_unscales_every_optimizer_holding_the_parameters(job):
    torch.manual_seed(3)
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    plain = copy.deepcopy(module)
    model, _, _ = job.prepare(module, torch.optim.SGD(module[0].parameters(), lr=0.1),
                              torch.optim.SGD(module[1].parameters(), lr=0.1))
    job.scaler = torch.amp.GradScaler("cpu", init_scale=8.0)  # as prepare(amp="fp16") makes it
    try:
        x = torch.randn(5, 3)
        job.backward(model(x).sum())
        norm = job.clip_grad_norm_(model, max_norm=1e9)
    finally:
        job.scaler = None
    plain(x).sum().backward()
    assert torch.equal(norm, torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e9))
    for ours, theirs in zip(module.parameters(), plain.parameters()):
        assert torch.equal(ours.grad, theirs.grad)  # both optimizers' gradients unscaled


def test_a_parameter_in_two_optimizers_or_an_argument_that_is_not_one_is_one_line(job):
    module = torch.nn.Sequential(torch.nn.Embedding(4, 2, sparse=True), torch.nn.Linear(2, 1))
    table = torch.optim.SparseAdam(module[0].parameters())
    with pytest.raises(UserError, match=r"job\.prepare: the parameter '0\.weight' is in optimizer 1 and in "
                                        r"optimizer 2, so each step would update it twice; give each parameter to one"):
        job.prepare(module, torch.optim.Adam(module.parameters()), table)
    loader = torch.utils.data.DataLoader(TensorDataset(torch.ones(2, 1)))
    with pytest.raises(UserError, match=r"optimizer 2 is a DataLoader, not an optimizer; .*job\.train_loader"):
        job.prepare(module, table, loader)
    job.prepare(module, table, torch.optim.Adam(module[1].parameters()))  # refused before anything was prepared
    other = torch.nn.Linear(2, 1)
    with pytest.raises(UserError, match=r"the parameter of shape \(4, 2\) is in an optimizer given to an earlier "
                                        r"job\.prepare and in optimizer 1"):
        job.prepare(other, torch.optim.SGD([*other.parameters(), module[0].weight], lr=0.1))
    # A parameter of a model not prepared (a GAN's other network, a loss's own weights) is allowed.
    extra = torch.nn.Parameter(torch.zeros(1))
    job.prepare(other, torch.optim.SGD([*other.parameters(), extra], lr=0.1))


# ----- collectives ------------------------------------------------------------------------------
def test_collectives_of_one_rank(job):
    tensor = torch.tensor([2.0, -1.0])
    for op in ("sum", "mean", "max"):
        assert torch.equal(job.allreduce(tensor, op), tensor)
    with pytest.raises(UserError, match="allreduce op 'min' is not supported; use sum, mean or max"):
        job.allreduce(tensor, "min")
    gathered = job.allgather(torch.arange(3))
    assert len(gathered) == 1 and torch.equal(gathered[0], torch.arange(3))
    assert job.allgather_object({"loss": 0.5}) == [{"loss": 0.5}]
    assert job.broadcast(("a", 1)) == ("a", 1)
    assert job.decide_on_main(lambda: 42) == 42
    job.barrier()
    with job.main_first():
        pass
    assert job.watchdog.what is None  # every call disarmed its wait on the way out


# ----- save and load ----------------------------------------------------------------------------
def draws():
    return torch.rand(3).tolist(), random.random(), numpy.random.rand()


def test_a_checkpoint_without_random_streams_is_restored_with_a_note(job, capsys):
    into = {"step": 0}
    assert job.restore({"step": 7}, into, source="by_hand.pt") == {"step": 7}
    assert capsys.readouterr().out == (
        "[trainbridge] by_hand.pt holds no random streams ('rng', which job.save adds): they go on from this "
        "process's seeds, so dropout and augmentation draw other numbers than the run that wrote it would have\n")


def test_load_puts_back_the_state_and_every_random_stream(job, tmp_path):
    torch.manual_seed(2)
    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
    model, optimizer = job.prepare(module, torch.optim.Adam(module.parameters(), lr=0.01))
    job.backward(model(torch.ones(4, 2)).sum())
    job.step(optimizer)
    job.set_seed(5)
    saved_weights = copy.deepcopy(module.state_dict())
    job.save({"model": model, "optimizer": optimizer, "epoch": 3}, str(tmp_path / "ckpt.pt"))
    expected = draws()
    job.backward(model(torch.ones(4, 2)).sum())
    job.step(optimizer)  # the weights and Adam's moments move on
    job.set_seed(99)
    into = {"model": model, "optimizer": optimizer, "epoch": 0}
    assert job.load(str(tmp_path / "ckpt.pt"), into) is into
    assert draws() == expected  # torch, Python and numpy continue where the save was
    assert into["epoch"] == 3
    for key, value in saved_weights.items():
        assert torch.equal(module.state_dict()[key], value)
    assert optimizer.state_dict()["state"][0]["step"] == 1
    raw = job.load(str(tmp_path / "ckpt.pt"))
    assert set(raw) == {"model", "optimizer", "epoch", "rng"} and raw["rng"]["world_size"] == 1


def test_background_saves_rotate_and_copy_and_a_load_waits_for_them(job, tmp_path):
    last, previous, copy_path = (str(tmp_path / name) for name in ("last.pt", "previous.pt", "copy.pt"))
    for value in range(3):
        job.save({"value": torch.tensor(value)}, last, keep_previous=previous, background=True, copies=[copy_path])
    assert job.load(last)["value"] == 2  # the writes in flight land first
    assert job.load(previous)["value"] == 1 and job.load(copy_path)["value"] == 2
    job.wait_for_saves()


def test_a_failed_background_save_raises_at_the_next_wait(job, tmp_path):
    (tmp_path / "a_file").write_text("")
    job.save({"v": 1}, str(tmp_path / "a_file" / "x.pt"), background=True)
    with pytest.raises(UserError, match=r"cannot write the checkpoint .*a_file/x\.pt"):
        job.wait_for_saves()
    job.wait_for_saves()  # reported once


@pytest.mark.parametrize("obj, message", [
    ([1, 2], "job.save takes a dict of what to save, got a list"),
    ({"rng": 1}, "the key 'rng' is where every rank's random streams are saved"),
    ({"args": argparse.Namespace(lr=0.1)}, r"job.save: \['args'\] holds a argparse.Namespace .*could never be loaded"),
])
def test_what_save_refuses_is_one_line_and_writes_nothing(job, tmp_path, obj, message):
    with pytest.raises(UserError, match=message):
        job.save(obj, str(tmp_path / "x.pt"))
    assert list(tmp_path.iterdir()) == []


def test_load_into_names_a_missing_key_and_another_model(job, tmp_path):
    job.save({"model": torch.nn.Linear(2, 2)}, str(tmp_path / "ckpt.pt"))
    with pytest.raises(UserError, match="has no 'optimizer'; it holds model; load it into the same keys"):
        job.load(str(tmp_path / "ckpt.pt"), {"optimizer": None})
    with pytest.raises(UserError, match=r"'model' is for another model: missing keys: none; unexpected keys: none; "
                                        r"shape mismatches: weight, bias"):
        job.load(str(tmp_path / "ckpt.pt"), {"model": torch.nn.Linear(3, 3)})


def test_the_train_loader_resumes_from_a_saved_file_at_the_next_batch(job, tmp_path):
    dataset = TensorDataset(torch.arange(40.0).unsqueeze(1))
    loader = job.train_loader(dataset, batch_size=4, seed=3)
    batches = iter(loader)
    seen = [next(batches)[0] for _ in range(3)]
    job.save({"loader": loader}, str(tmp_path / "ckpt.pt"))
    rest = [batch[0] for batch in batches]
    assert len(seen) + len(rest) == len(loader) == 10
    resumed = job.train_loader(dataset, batch_size=4, seed=3)
    job.load(str(tmp_path / "ckpt.pt"), {"loader": resumed})
    assert len(resumed) == 7
    assert all(torch.equal(a, b) for a, b in zip(rest, (batch[0] for batch in resumed), strict=True))
    assert resumed.epoch == 1 and resumed.position == 0  # the next pass is the next epoch, whole
    other_seed = job.train_loader(dataset, batch_size=4, seed=4)
    with pytest.raises(UserError, match="seeded with 3, this one with 4; pass seed=3"):
        job.load(str(tmp_path / "ckpt.pt"), {"loader": other_seed})


def test_the_eval_loader_gives_every_sample_once(job):
    loader = job.eval_loader(TensorDataset(torch.arange(10)), batch_size=4)
    assert [batch[0].tolist() for batch in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


@pytest.mark.parametrize("workers", [0, 1])
def test_an_evaluation_draws_nothing_from_the_global_random_stream(job, workers):
    loader = job.eval_loader(TensorDataset(torch.arange(10)), batch_size=4, num_workers=workers)
    torch.manual_seed(3)
    for _ in loader:  # iter() of a DataLoader takes its workers' base seed from a generator
        pass
    after = torch.rand(3)
    torch.manual_seed(3)
    assert torch.equal(after, torch.rand(3))  # dropout's next masks are the ones it would draw without evaluating


# ----- stopping ---------------------------------------------------------------------------------
def test_should_stop_agrees_one_step_after_sigterm(job, monkeypatch):
    def refuse(pid, signum):  # a handler that would kill pytest raises instead
        raise AssertionError(f"the handler sent signal {signum} to pid {pid}")
    monkeypatch.setattr(os, "kill", refuse)
    try:
        assert job.should_stop() is False  # the loop asks: SIGTERM now only sets the flag
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
        assert job.should_stop() is False
        assert job.should_stop() is True and job.drain_stop() is True
    finally:
        job._stop.drain()
        job._stop.received = job._stop.stopping = False  # the other tests' job is not stopping
    assert dist.is_initialized()


def test_a_call_after_shutdown_is_one_line_and_a_second_shutdown_nothing():
    # A job of its own, in a child: the module's job stays joined for the other tests.
    result = run_python("""
        import sys, torch
        sys.path[:0] = [{tests!r}, {unit!r}]
        from one_rank_job import one_rank_env
        import trainbridge as tb
        from trainbridge.errors import UserError
        with one_rank_env():
            job = tb.init(backend="torch", timeout=30, malloc_tuning="off")
            job.shutdown()
            job.shutdown()
            for call in (lambda: job.allreduce(torch.ones(2)), lambda: job.save({{"a": 1}}, "x.pt"),
                         lambda: job.should_stop(), lambda: job.prepare(torch.nn.Linear(2, 2), None)):
                try:
                    call()
                except UserError as exc:
                    print(exc)
    """.format(tests=os.path.dirname(os.path.dirname(__file__)), unit=os.path.dirname(__file__)))
    assert result.returncode == 0, result
    ended = ("after job.shutdown() (or job.exit()): this process has left the job; make that the last call, or call "
             "tb.init() again to join a new job")
    assert result.stdout.splitlines()[-4:] == [f"{call} {ended}" for call in (
        "job.allreduce", "job.save('x.pt')", "job.should_stop (the stop agreement)", "job.prepare")], result.stdout
