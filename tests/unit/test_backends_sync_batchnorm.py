"""trainbridge.backends.sync_batchnorm: BatchNorm layers converted to synchronized ones, in this process.

One process shows the conversion (the same parameters, buffers and keys; eval mode; the
settings kept) and the arithmetic: a converted model matches plain BatchNorm on the whole
batch, and ranks simulated by threads that sum through a barrier (each holding a slice of
the batch, one holding none) match it too. The real collectives over several processes are
tests/api_scripts/same_model_programs/sync_bn.py's (tests/test_same_model.py).
"""
import copy
import threading

import pytest
import torch
from one_rank_job import one_rank_job
from torch import nn

import trainbridge.hvd as hvd
from trainbridge.backends.sync_batchnorm import SyncBatchNorm, synchronize_batchnorm
from trainbridge.backends.torch_ddp import PreparedDDP, TorchBackend
from trainbridge.errors import UserError


def alone(tensor):
    return tensor  # the sum over the ranks of a job of one


def refuse(tensor):
    raise AssertionError("this forward must not wait for the other ranks")


def net(**batchnorm):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, **batchnorm), nn.ReLU(), nn.Flatten(),
                         nn.Linear(64, 5), nn.BatchNorm1d(5, **batchnorm)).double()


def batch(n=6, seed=1):
    return torch.randn(n, 3, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def max_diff(a, b):
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.mark.parametrize("batchnorm", [{}, {"momentum": None}, {"affine": False}, {"track_running_stats": False}],
                         ids=["default", "momentum-none", "no-affine", "no-running-stats"])
def test_a_converted_model_trains_as_plain_batchnorm_in_one_process(batchnorm):
    plain = net(**batchnorm)
    synced = synchronize_batchnorm(copy.deepcopy(plain), alone, every_batchnorm=True)
    assert [type(m) for m in synced if isinstance(m, nn.modules.batchnorm._BatchNorm)] == [SyncBatchNorm] * 2
    for model in (plain, synced):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            optimizer.zero_grad()
            model(batch(seed=step)).square().mean().backward()
            optimizer.step()
    assert list(synced.state_dict()) == list(plain.state_dict())
    assert max_diff(synced.state_dict(), plain.state_dict()) < 1e-12
    if batchnorm.get("track_running_stats", True):
        assert synced[1].num_batches_tracked.item() == 3
        assert not torch.equal(synced[1].running_var, torch.ones(4, dtype=torch.float64))


def test_the_conversion_keeps_the_parameters_buffers_settings_and_training_flag():
    plain = nn.Sequential(nn.BatchNorm3d(2, eps=1e-3, momentum=0.3), nn.BatchNorm1d(3, momentum=None).eval())
    plain.half()  # a model's dtype is kept (and its device: the tensors are the same objects)
    tensors = [*plain.named_parameters(), *plain.named_buffers()]
    synced = synchronize_batchnorm(plain, alone, every_batchnorm=True)
    kept = [*synced.named_parameters(), *synced.named_buffers()]
    assert [name for name, _ in kept] == [name for name, _ in tensors]
    assert all(now is before for (_, now), (_, before) in zip(kept, tensors))
    first, second = synced
    assert (first.eps, first.momentum, first.affine, first.track_running_stats, first.training) == (
        1e-3, 0.3, True, True, True)
    assert (second.momentum, second.training, second.weight.dtype) == (None, False, torch.float16)


def test_in_eval_mode_the_layer_uses_its_running_statistics_and_waits_for_no_rank():
    plain = nn.BatchNorm2d(4).double()
    with torch.no_grad():
        plain.running_mean.uniform_(-1, 1)
        plain.running_var.uniform_(0.5, 2)
    plain.eval()
    synced = synchronize_batchnorm(copy.deepcopy(plain), refuse, every_batchnorm=True)
    x = torch.randn(2, 4, 3, 3, dtype=torch.float64)
    assert torch.equal(synced(x), plain(x))


def test_without_the_option_only_the_layers_meant_to_sync_are_converted():
    model = nn.Sequential(nn.BatchNorm1d(3), nn.SyncBatchNorm(3), hvd.SyncBatchNorm(3))
    synced = synchronize_batchnorm(model, alone, every_batchnorm=False)
    assert [type(m) for m in synced] == [nn.BatchNorm1d, SyncBatchNorm, SyncBatchNorm]
    assert synced[2].sum_over_ranks.sum_over_ranks is alone  # hvd's layer now sums over the job's ranks


def test_a_root_batchnorm_and_a_layer_used_twice_become_one_synchronized_layer():
    assert isinstance(synchronize_batchnorm(nn.BatchNorm1d(3), alone, every_batchnorm=True), SyncBatchNorm)
    shared = nn.BatchNorm1d(3)
    synced = synchronize_batchnorm(nn.Sequential(shared, nn.Tanh(), shared), alone, every_batchnorm=True)
    assert synced[0] is synced[2] and isinstance(synced[0], SyncBatchNorm)


def test_a_copy_of_the_model_shares_the_sum_over_the_ranks():
    synced = synchronize_batchnorm(nn.Sequential(nn.BatchNorm1d(3)), alone, every_batchnorm=True)
    copied = copy.deepcopy(synced)
    assert copied[0].sum_over_ranks is synced[0].sum_over_ranks
    assert copied[0].weight is not synced[0].weight


def test_a_lazy_batchnorm_that_has_seen_no_input_is_one_line():
    with pytest.raises(UserError, match=r"LazyBatchNorm1d layer has not seen its input yet.*run one forward pass"):
        synchronize_batchnorm(nn.Sequential(nn.LazyBatchNorm1d()), alone, every_batchnorm=True)


class ThreadRanks:
    """``size`` threads as ranks, summing tensors through a barrier, in rank order."""

    def __init__(self, size):
        self.size, self.barrier, self.shares, self.me = size, threading.Barrier(size), [None] * size, threading.local()

    def sum_over_ranks(self, tensor):
        self.shares[self.me.rank] = tensor.detach()
        self.barrier.wait()
        total = sum(self.shares[1:], self.shares[0].clone())
        self.barrier.wait()  # every rank has read the shares before the next sum writes them
        return total

    def run(self, work):
        """``work(rank)`` in each rank's thread; the results in rank order."""
        results, errors = [None] * self.size, []

        def one(rank):
            self.me.rank = rank
            try:
                results[rank] = work(rank)
            except BaseException as exc:  # noqa: BLE001 - shown by the assertion below
                errors.append(exc)
                self.barrier.abort()

        threads = [threading.Thread(target=one, args=(rank,)) for rank in range(self.size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not errors, errors
        return results


@pytest.mark.parametrize("shares", [[4, 4, 4], [5, 1], [6, 0, 6]], ids=["even", "one-sample", "empty-rank"])
def test_ranks_holding_slices_of_the_batch_match_one_process_on_the_whole_batch(shares):
    plain = net()
    x = batch(sum(shares))
    target = torch.randn(sum(shares), 5, dtype=torch.float64)
    x_whole = x.clone().requires_grad_()
    # The loss of the global batch: each rank's share of it is its samples' squared error over the global count.
    (plain(x_whole) - target).square().sum().div(sum(shares)).backward()
    ranks = ThreadRanks(len(shares))
    starts = [sum(shares[:r]) for r in range(len(shares))]
    models = [synchronize_batchnorm(net(), ranks.sum_over_ranks, every_batchnorm=True) for _ in shares]

    def train(rank):
        model = models[rank]
        mine = x[starts[rank]:starts[rank] + shares[rank]].clone().requires_grad_()
        (model(mine) - target[starts[rank]:starts[rank] + shares[rank]]).square().sum().div(sum(shares)).backward()
        return model, mine.grad

    results = ranks.run(train)
    for model, _ in results:
        # Every rank holds the global batch's running statistics; the ranks' gradients add up to one process's.
        assert max_diff(model.state_dict(), plain.state_dict()) < 1e-12
        for name, param in plain.named_parameters():
            total = sum(dict(m.named_parameters())[name].grad for m, _ in results)
            assert (total - param.grad).abs().max().item() < 1e-12, name
    assert (torch.cat([g for _, g in results]) - x_whole.grad).abs().max().item() < 1e-12


def test_one_value_per_channel_over_all_ranks_is_refused_as_by_batchnorm():
    ranks = ThreadRanks(2)

    def forward(rank):
        layer = SyncBatchNorm(3, sum_over_ranks=ranks.sum_over_ranks)
        with pytest.raises(ValueError, match=r"Expected more than 1 value per channel when training.*1 value"):
            layer(torch.randn(rank, 3))  # rank 0 holds no sample, rank 1 one
        return True

    assert ranks.run(forward) == [True, True]


def test_hvd_syncbatchnorm_is_the_same_layer_with_horovods_signature():
    layer = hvd.SyncBatchNorm(4, eps=1e-3, momentum=0.2)
    assert isinstance(layer, SyncBatchNorm) and (layer.eps, layer.momentum) == (1e-3, 0.2)


@pytest.fixture(scope="module")
def job():
    with one_rank_job() as job:
        yield job


def test_prepare_with_sync_batchnorm_converts_before_ddp_wraps_the_model(job):
    plain = net()
    model = copy.deepcopy(plain)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    prepared, optimizer = job.prepare(model, optimizer, sync_batchnorm=True)
    assert isinstance(prepared, PreparedDDP) and isinstance(job.unwrap(prepared)[1], SyncBatchNorm)
    assert list(prepared.state_dict()) == list(plain.state_dict())
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    for step in range(2):
        optimizer.zero_grad()
        job.backward(prepared(batch(seed=step)).square().mean())
        optimizer.step()  # the optimizer built before prepare steps the converted layers' parameters
        plain_optimizer.zero_grad()
        plain(batch(seed=step)).square().mean().backward()
        plain_optimizer.step()
    assert max_diff(prepared.state_dict(), plain.state_dict()) < 1e-12


def test_a_users_torch_syncbatchnorm_trains_on_the_cpu_under_ddp(job):
    model = nn.Sequential(nn.Linear(3, 4), nn.SyncBatchNorm(4)).double()
    prepared, optimizer = job.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert isinstance(job.unwrap(prepared)[1], SyncBatchNorm)
    job.backward(prepared(torch.randn(5, 3, dtype=torch.float64)).sum())
    optimizer.step()
    assert job.unwrap(prepared)[1].num_batches_tracked.item() == 1


def test_the_torch_backend_sums_over_its_ranks_into_a_new_tensor(job):
    assert isinstance(job.backend, TorchBackend)
    x = torch.randn(3, dtype=torch.float64)
    total = job.backend.sum_over_ranks(x)
    assert type(total) is torch.Tensor and torch.equal(total, x) and total.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_input_is_normalised_in_float32_as_batchnorm_does(dtype):
    plain = nn.BatchNorm2d(4)  # float32 weights, as under autocast
    synced = synchronize_batchnorm(copy.deepcopy(plain), alone, every_batchnorm=True)
    x = (torch.randn(8, 4, 5, 5) * 3 + 50).to(dtype)  # a mean far from 0, where half-precision sums round
    outputs, grads = [], []
    for model in (plain, synced):
        leaf = x.clone().requires_grad_()
        out = model(leaf)
        out.float().square().mean().backward()
        outputs.append(out)
        grads.append((leaf.grad, model.weight.grad))
    assert outputs[1].dtype == outputs[0].dtype == dtype and grads[1][0].dtype == dtype
    assert grads[1][1].dtype == torch.float32
    assert (outputs[1].float() - outputs[0].float()).abs().max() < 2e-2
    assert (grads[1][0].float() - grads[0][0].float()).abs().max() < 2e-3
    assert (grads[1][1] - grads[0][1]).abs().max() < 2e-2
    assert (synced.running_mean - plain.running_mean).abs().max() < 1e-3
    assert (synced.running_var - plain.running_var).abs().max() < 1e-3
