"""trainbridge.api.same_model and api.trainable: the fingerprints the ranks compare, unfrozen parameters, set_seed.

The comparison across ranks and the averaging over ranks are the launches' to test
(tests/test_misuse.py, tests/test_same_model.py); here, what one process decides.
"""
import pytest
import torch
from one_rank_job import one_rank_job
from torch import nn

from trainbridge.api.same_model import SameModelCheck, fingerprint, kept_identical
from trainbridge.api.trainable import average_gradients
from trainbridge.errors import UserError


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                   torch.int8, torch.complex64])
def test_a_fingerprint_changes_when_any_one_element_changes(dtype):
    base = (torch.randn(7, 5, generator=torch.Generator().manual_seed(0)) * 10).to(dtype)
    assert fingerprint(base) == fingerprint(base.clone())
    for i in range(base.numel()):
        changed = base.clone().reshape(-1)
        # The next representable value up (a float's last bit), or one more (an integer).
        changed[i] = torch.nextafter(changed[i], changed[i] + 1) if dtype.is_floating_point else changed[i] + 1
        if dtype.is_complex:
            changed[i] = changed[i] + 1e-3
        assert fingerprint(changed.reshape(base.shape)) != fingerprint(base), (dtype, i)


def test_a_fingerprint_reads_non_contiguous_and_boolean_tensors():
    t = torch.randn(4, 6, dtype=torch.float64)
    assert fingerprint(t.t()) == fingerprint(t.t().contiguous())
    flags = torch.tensor([True, False, True])
    assert fingerprint(flags) != fingerprint(torch.tensor([True, False, False]))


def test_plain_batch_norm_statistics_are_per_rank_and_not_compared():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    model.register_buffer("scale", torch.ones(2))
    names = [name for name, _ in kept_identical(model)]
    assert names == ["0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias", "scale"]
    model[1].synchronized = True  # a BatchNorm whose statistics span the ranks keeps them alike
    assert "1.running_mean" in [name for name, _ in kept_identical(model)]


@pytest.mark.parametrize("every", [-1, 2.5, True, "100"])
def test_check_every_must_be_a_whole_number(every):
    with pytest.raises(UserError, match=r"check_every must be a whole number of steps, or 0"):
        SameModelCheck.check_every_valid(every)


def test_unfrozen_gradients_are_averaged_with_zeros_from_ranks_without_one_and_none_stays_none():
    used, unused, some = (nn.Parameter(torch.ones(3)) for _ in range(3))
    used.grad, some.grad = torch.full((3,), 4.0), torch.full((3,), 2.0)
    sent = []

    def mean_over_two_ranks(flat):  # the other rank had gradients only for `used`, all 2.0
        sent.append(flat.clone())
        other = torch.cat([torch.full((3,), 2.0), torch.zeros(6), torch.tensor([1.0, 0.0, 0.0])])
        return (flat + other) / 2

    average_gradients([used, unused, some], mean_over_two_ranks)
    assert len(sent) == 1  # one allreduce for all of them, flags included
    assert torch.equal(used.grad, torch.full((3,), 3.0))
    assert unused.grad is None  # no rank had one
    assert torch.equal(some.grad, torch.full((3,), 1.0))  # averaged with the other rank's zeros


@pytest.fixture(scope="module")
def job():
    with one_rank_job() as job:
        yield job


def test_set_seed_before_prepare_seeds_alike_and_prepare_seeds_per_rank(job):
    job.set_seed(5)
    torch.rand(3)  # building the model draws from the stream
    model = nn.Linear(2, 2)
    job.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    after_prepare = torch.rand(3)
    torch.manual_seed(5 + job.rank)
    assert torch.equal(after_prepare, torch.rand(3))  # prepare started the per-rank stream afresh
    job.set_seed(7)  # after a prepare: per rank at once, and no second reseed at the next prepare
    drawn = torch.rand(2)
    torch.manual_seed(7 + job.rank)
    assert torch.equal(drawn, torch.rand(2))


def test_a_layer_frozen_after_prepare_is_named_at_the_next_backward(job):
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    prepared, optimizer = job.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model[0].requires_grad_(False)
    with pytest.raises(UserError, match=r"job\.backward: 0\.weight, 0\.bias of the prepared model stopped requiring "
                                        r"gradients after job\.prepare"):
        job.backward(prepared(torch.ones(2, 3)).sum())
    model[0].requires_grad_(True)


def test_a_layer_unfrozen_after_prepare_trains(job):
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    model[0].requires_grad_(False)
    prepared, optimizer = job.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model[0].requires_grad_(True)
    before = model[0].weight.detach().clone()
    job.backward(prepared(torch.ones(2, 3)).sum())
    expected = model[0].weight.grad.clone()
    job.step(optimizer)
    assert torch.allclose(model[0].weight, before - 0.1 * expected)


def test_a_global_batch_is_dealt_among_the_ranks(job):
    data = torch.utils.data.TensorDataset(torch.arange(40.0))
    loader = job.train_loader(data, global_batch_size=8, seed=1)
    assert (loader.batch_size, loader.global_batch_size) == (8 // job.world_size, 8)
    assert [b[0].tolist() for b in loader] == [b[0].tolist() for b in job.train_loader(data, batch_size=8, seed=1)]


@pytest.mark.parametrize("given,said", [({}, "neither"), ({"batch_size": 4, "global_batch_size": 4}, "both"),
                                        ({"global_batch_size": 0}, "at least 1"),
                                        ({"global_batch_size": 2.5}, "at least 1")])
def test_train_loader_takes_one_batch_size(job, given, said):
    with pytest.raises(UserError, match=f"train_loader: .*{said}"):
        job.train_loader(torch.utils.data.TensorDataset(torch.arange(8.0)), **given)
