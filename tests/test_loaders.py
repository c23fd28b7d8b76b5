"""The train loader behaves like a DataLoader over an epoch, trains whole global batches, and resumes bitwise.

In-process tests build :class:`TrainLoader` directly (pure: no process group). Others
launch tests/api_scripts/dataset_sizes.py under real launchers: at dataset sizes that
are not a multiple of the global batch every world size must train the same samples and
end with one process's weights. The last checks, under torchrun, that gloo's threads
leave a forked worker nothing to deadlock on.
"""
import multiprocessing
import random
import re
import signal
import sys
import time
from pathlib import Path

import numpy
import pytest
import torch
from conftest import HOROVODRUN, PYTHON, TORCHRUN, check, in_matrix, run
from torch import nn
from torch.utils.data import Dataset

import trainbridge as tb
from trainbridge.api.loaders import EvalLoader, TrainLoader
from trainbridge.runtime.gloo_threads import AFFECTED as GLOO_THREAD_STATES_KEPT

CPU = torch.device("cpu")
SCRIPT = str(Path(__file__).resolve().parent / "api_scripts" / "dataset_sizes.py")


def train_loader(dataset, batch_size, rank=0, world=1, seed=0, **options) -> TrainLoader:
    return TrainLoader(dataset, batch_size, rank=rank, world_size=world, device=CPU, seed=seed, **options)


def items(size, batch_size, **kwargs) -> TrainLoader:
    """A loader over the integers 0..size-1 (each batch a tensor of indices)."""
    return train_loader(list(range(size)), batch_size, **kwargs)


def lists(batches):
    return [b.tolist() for b in batches]


def reference_passes(size, batch_size, passes, **kwargs):
    """Every batch of the first ``passes`` epochs, from a loader iterated to the end of each."""
    loader = items(size, batch_size, **kwargs)
    return [lists(loader) for _ in range(passes)]


# ----- len(): the batches of a pass, fixed while it runs ------------------------------------------
@pytest.mark.parametrize("world,batch,steps", [(1, 7, 14), (3, 4, 8)])  # 100 samples: 98 and 96 trained
def test_len_is_the_pass_and_does_not_change_while_iterating(world, batch, steps):
    for rank in range(world):
        loader = items(100, batch, rank=rank, world=world)
        for _ in range(2):
            assert len(loader) == steps
            seen = 0
            for i, b in enumerate(loader):
                assert len(loader) == steps, f"len changed to {len(loader)} at batch {i}"
                assert len(b) == batch
                seen += 1
            assert seen == steps and len(loader) == steps


def test_len_after_a_mid_epoch_resume_is_the_rest_of_the_epoch_then_a_whole_one():
    interrupted = items(100, 7, seed=4)
    for i, _ in enumerate(interrupted):
        if i == 4:  # 5 batches handed out
            state = interrupted.state_dict()
            break
    resumed = items(100, 7, seed=4)
    resumed.load_state_dict(state)
    assert len(resumed) == 14 - 5 and resumed.epoch == 0
    first_pass = 0
    for _ in resumed:
        assert len(resumed) == 9
        first_pass += 1
    assert first_pass == 9 and resumed.epoch == 1
    assert len(resumed) == 14
    second_pass = 0
    for _ in resumed:
        assert len(resumed) == 14
        second_pass += 1
    assert second_pass == 14


def test_gradient_accumulation_check_fires_on_the_last_batch_of_every_epoch():
    k = 4
    loader = items(100, 7)  # 14 batches: fires after 4, 8, 12 and 14
    for _ in range(2):
        fired = [i for i, _ in enumerate(loader) if (i + 1) % k == 0 or i + 1 == len(loader)]
        assert fired == [3, 7, 11, 13]
    # A resumed first pass of 9 batches ends with a step too.
    state = loader.state_dict()
    state["position"] = 5 * 7
    resumed = items(100, 7)
    resumed.load_state_dict(state)
    fired = [i for i, _ in enumerate(resumed) if (i + 1) % k == 0 or i + 1 == len(resumed)]
    assert fired == [3, 7, 8]


# ----- every iter() is a new pass ----------------------------------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
def test_a_break_ends_the_pass_and_the_next_for_starts_the_next_epoch(workers):
    reference = reference_passes(100, 10, 3, seed=9)
    assert reference[0] != reference[1] != reference[2]
    loader = items(100, 10, seed=9, num_workers=workers)
    first = []
    for b in loader:
        first.append(b.tolist())
        if len(first) == 3:
            break
    assert first == reference[0][:3]
    assert loader.epoch == 1 and loader.position == 0 and len(loader) == 10
    assert lists(loader) == reference[1]  # from the beginning of epoch 1's order, all 10 batches
    assert loader.epoch == 2
    for b in loader:
        assert b.tolist() == reference[2][0]
        break
    assert loader.epoch == 3


@pytest.mark.parametrize("workers", [0, 2])
def test_next_of_a_fresh_iter_is_a_pass_of_its_own(workers):
    reference = reference_passes(100, 10, 4, seed=9)
    loader = items(100, 10, seed=9, num_workers=workers)
    assert next(iter(loader)).tolist() == reference[0][0]
    assert loader.epoch == 1
    assert next(iter(loader)).tolist() == reference[1][0]
    assert loader.epoch == 2
    assert lists(loader) == reference[2]
    assert next(iter(loader)).tolist() == reference[3][0]


@pytest.mark.parametrize("workers", [0, 2])
def test_an_abandoned_iterator_yields_nothing_once_a_new_pass_started(workers):
    reference = reference_passes(100, 10, 3, seed=9)
    loader = items(100, 10, seed=9, num_workers=workers)
    old = iter(loader)
    assert next(old).tolist() == reference[0][0]
    assert lists(loader) == reference[1]  # the new pass is the next epoch, whole
    assert list(old) == []
    assert loader.epoch == 2  # and the abandoned one, exhausted, ended nothing
    older = iter(loader)
    assert next(older).tolist() == reference[2][0]
    newer = iter(loader)  # epoch 3
    with pytest.raises(StopIteration):
        next(older)
    assert loader.epoch == 3
    assert len(lists(newer)) == 10 and loader.epoch == 4


# ----- state_dict: where the next run starts ----------------------------------------------------
@pytest.mark.parametrize("k", [1, 4, 9])
def test_state_dict_inside_the_body_after_k_batches_resumes_at_batch_k_plus_1(k):
    reference = reference_passes(100, 10, 2, seed=3)
    loader = items(100, 10, seed=3)
    for i, _ in enumerate(loader):
        if i + 1 == k:
            state = loader.state_dict()
    assert (state["epoch"], state["position"]) == (0, 10 * k)
    resumed = items(100, 10, seed=3)
    resumed.load_state_dict(state)
    assert lists(resumed) == reference[0][k:]
    assert lists(resumed) == reference[1]


@pytest.mark.parametrize("size", [100, 107])
def test_state_dict_inside_the_body_after_the_last_batch_resumes_at_the_next_epoch(size):
    reference = reference_passes(size, 10, 3, seed=3)
    loader = items(size, 10, seed=3)
    for _ in range(2):
        for i, _ in enumerate(loader):
            if i + 1 == len(loader):
                state = loader.state_dict()
    assert (state["epoch"], state["position"]) == (2, 0)
    resumed = items(size, 10, seed=3)
    resumed.load_state_dict(state)
    assert resumed.epoch == 2 and len(resumed) == 10
    assert lists(resumed) == reference[2]


def test_state_dict_after_a_break_resumes_at_the_next_epoch():
    reference = reference_passes(100, 10, 2, seed=3)
    loader = items(100, 10, seed=3)
    for i, _ in enumerate(loader):
        if i == 2:
            break
    state = loader.state_dict()
    assert (state["epoch"], state["position"]) == (1, 0)
    resumed = items(100, 10, seed=3)
    resumed.load_state_dict(state)
    assert lists(resumed) == reference[1]


def test_an_iterator_that_handed_out_nothing_uses_up_no_epoch():
    # zip() calls iter() but stops before next(): the checkpoint and the next pass must agree.
    reference = reference_passes(100, 10, 1, seed=9)
    loader = items(100, 10, seed=9)
    for _ in zip(range(0), loader):
        pass
    state = loader.state_dict()
    assert (state["epoch"], state["position"], loader.epoch) == (0, 0, 0)
    assert lists(loader) == reference[0]
    resumed = items(100, 10, seed=9)
    resumed.load_state_dict(state)
    assert lists(resumed) == reference[0]


def test_explicit_none_and_harmless_values_are_accepted():
    assert len(items(100, 30, sampler=None, batch_sampler=None, generator=None)) == 3
    assert len(EvalLoader(list(range(100)), 30, rank=0, world_size=1, device=CPU, shuffle=False, sampler=None)) == 4


# ----- whole global batches at any dataset size --------------------------------------------------
@pytest.mark.parametrize("size", [1000, 1001, 1003])
def test_only_whole_global_batches_and_the_same_steps_on_every_world_size(size):
    global_batch, steps = 30, size // 30
    single = items(size, global_batch, seed=1)
    single_epochs = [lists(single) for _ in range(2)]
    for epoch in single_epochs:
        trained = [i for b in epoch for i in b]
        assert len(epoch) == steps and len(trained) == len(set(trained)) == steps * global_batch
    if size % global_batch:  # what is left out changes with the epoch's order
        left_out = [set(range(size)) - {i for b in epoch for i in b} for epoch in single_epochs]
        assert len(left_out[0]) == size % global_batch and left_out[0] != left_out[1]
    for world in (2, 3):
        ranks = [items(size, global_batch // world, rank=r, world=world, seed=1) for r in range(world)]
        for epoch in range(2):
            per_rank = [lists(loader) for loader in ranks]
            assert [len(batches) for batches in per_rank] == [steps] * world
            assert all(loader.epoch == epoch + 1 and len(loader) == steps for loader in ranks)
            for k in range(steps):
                union = [i for batches in per_rank for i in batches[k]]
                assert len(union) == global_batch and set(union) == set(single_epochs[epoch][k])
            assert sum(len(b) for batches in per_rank for b in batches) == steps * global_batch


# ----- options that cannot apply are refused in one line ----------------------------------------
TRAIN_OPTIONS = {"shuffle": lambda: True, "sampler": lambda: [0, 1], "batch_sampler": lambda: [[0, 1]],
                 "generator": torch.Generator, "drop_last": lambda: False}
EVAL_OPTIONS = {"shuffle": True, "sampler": [0, 1], "batch_sampler": [[0, 1]], "drop_last": True}


def one_line_naming(error: pytest.ExceptionInfo, *words: str) -> None:
    message = str(error.value)
    assert message and "\n" not in message.strip(), message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


@pytest.mark.parametrize("option", list(TRAIN_OPTIONS))
def test_train_loader_refuses_options_that_cannot_apply(option):
    with pytest.raises(tb.UserError) as error:
        items(100, 10, **{option: TRAIN_OPTIONS[option]()})
    one_line_naming(error, "train_loader", option)


@pytest.mark.parametrize("option", list(EVAL_OPTIONS))
def test_eval_loader_refuses_options_that_cannot_apply(option):
    with pytest.raises(tb.UserError) as error:
        EvalLoader(list(range(100)), 10, rank=0, world_size=1, device=CPU, **{option: EVAL_OPTIONS[option]})
    one_line_naming(error, "eval_loader", option)


def test_the_default_drop_last_is_accepted_by_both_loaders():
    # The refusals are about values: each loader's own drop_last is fine when spelled out.
    assert len(items(100, 30, drop_last=True)) == 3
    assert len(EvalLoader(list(range(100)), 30, rank=0, world_size=1, device=CPU, drop_last=False)) == 4


def test_a_dataset_smaller_than_one_global_batch_is_refused_in_one_line():
    with pytest.raises(tb.UserError) as error:
        items(29, 10, rank=0, world=3)
    one_line_naming(error, "29", "30", "batch_size")
    assert len(items(30, 10, rank=2, world=3)) == 1  # one global batch is enough


# ----- random augmentation: per batch, not per worker or per run ----------------------------------
class Noisy(Dataset):
    """Each sample with noise from torch's, Python's and numpy's global generators (a random transform)."""

    def __len__(self):
        return 64

    def __getitem__(self, index):
        return torch.tensor([index + torch.rand(()).item(), random.random(), numpy.random.rand()],
                            dtype=torch.float64)


def global_streams():
    return torch.get_rng_state(), random.getstate(), numpy.random.get_state()


def assert_streams_equal(before, after):
    assert torch.equal(before[0], after[0]), "the global torch generator moved"
    assert before[1] == after[1], "Python's random moved"
    assert before[2][0] == after[2][0] and numpy.array_equal(before[2][1], after[2][1]) and \
        before[2][2:] == after[2][2:], "numpy's global generator moved"


def noisy_passes(loader, passes=2):
    return [[b.clone() for b in loader] for _ in range(passes)]


def assert_bitwise(a, b):
    assert len(a) == len(b)
    assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def test_random_augmentation_is_the_same_with_and_without_workers():
    inline = noisy_passes(train_loader(Noisy(), 8, seed=2))
    workers = noisy_passes(train_loader(Noisy(), 8, seed=2, num_workers=2))
    for a, b in zip(inline, workers):
        assert_bitwise(a, b)
    # The noise is real: it differs between samples, and between epochs for the same sample.
    noise = {}
    for _epoch, batches in enumerate(inline):
        for b in batches:
            for row in b:
                noise.setdefault(int(row[0]), []).append(row.tolist())
    first = [row[0] for row in inline[0][0]]
    assert len({float(x - int(x)) for x in first}) == len(first)
    assert all(values[0] != values[1] for values in noise.values() if len(values) == 2)
    assert sum(len(values) == 2 for values in noise.values()) > 0


@pytest.mark.parametrize("workers", [0, 2])
def test_iterating_leaves_the_main_process_random_streams_alone(workers):
    torch.manual_seed(123)
    random.seed(123)
    numpy.random.seed(123)
    loader = train_loader(Noisy(), 8, seed=2, num_workers=workers)
    before = global_streams()
    noisy_passes(loader, 2)
    for _ in loader:  # and a pass ended by a break
        break
    next(iter(loader))
    assert_streams_equal(before, global_streams())


def test_a_mid_epoch_resume_with_workers_gives_bitwise_the_same_augmented_batches():
    reference = noisy_passes(train_loader(Noisy(), 8, seed=2, num_workers=2))
    interrupted = train_loader(Noisy(), 8, seed=2, num_workers=2)
    for i, _ in enumerate(interrupted):
        if i == 2:  # 3 batches trained
            state = interrupted.state_dict()
            break
    torch.manual_seed(999)  # a new run's global streams are not the interrupted run's
    random.seed(999)
    numpy.random.seed(999)
    resumed = train_loader(Noisy(), 8, seed=2, num_workers=2)
    resumed.load_state_dict(state)
    rest = noisy_passes(resumed)
    assert_bitwise(rest[0], reference[0][3:])
    assert_bitwise(rest[1], reference[1])


def by_sample(batches_of_ranks):
    """{sample index: its augmented row} over the batches of every rank (Noisy's rows start with the index)."""
    return {int(row[0]): row for batches in batches_of_ranks for b in batches for row in b}


@pytest.mark.parametrize("world", [2, 3])
def test_each_sample_is_augmented_alike_at_any_world_size_and_worker_count(world):
    # The global batch of 12 dealt among the ranks: each sample gets the same draws as in one process.
    one = noisy_passes(train_loader(Noisy(), 12, seed=2), passes=2)
    ranks = [noisy_passes(train_loader(Noisy(), 12 // world, rank=r, world=world, seed=2, num_workers=r % 2 * 2),
                          passes=2) for r in range(world)]
    for epoch in range(2):
        alone, dealt = by_sample([one[epoch]]), by_sample([r[epoch] for r in ranks])
        assert alone.keys() == dealt.keys() and len(alone) == 60
        assert all(torch.equal(alone[i], dealt[i]) for i in alone), epoch


@pytest.mark.parametrize("world", [1, 3])
def test_a_resume_at_another_world_size_continues_each_samples_augmentation_exactly(world):
    reference = noisy_passes(train_loader(Noisy(), 12, seed=2), passes=2)
    interrupted = [train_loader(Noisy(), 6, rank=r, world=2, seed=2, num_workers=2) for r in range(2)]
    for loader in interrupted:
        for i, _ in enumerate(loader):
            if i == 1:  # 2 steps trained
                state = loader.state_dict()
                break
    resumed = [train_loader(Noisy(), 12 // world, rank=r, world=world, seed=2) for r in range(world)]
    for loader in resumed:
        loader.load_state_dict(state)
    rest = [noisy_passes(loader, passes=2) for loader in resumed]
    assert by_sample([r[0] for r in rest]).keys() == by_sample([reference[0][2:]]).keys()
    for epoch, expected in ((0, reference[0][2:]), (1, reference[1])):
        got, want = by_sample([r[epoch] for r in rest]), by_sample([expected])
        assert got.keys() == want.keys() and all(torch.equal(got[i], want[i]) for i in want)


# ----- launched: the same training at sizes that are not a multiple of the global batch ----------
SIZES = (1000, 1001, 1003)
EPOCHS = 3


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("dataset_sizes_python")
    check(run([PYTHON, SCRIPT, str(out)], timeout=180))
    return torch.load(out / "result.pt", weights_only=True)


def initial_weights(size):
    """dataset_sizes.py's model for ``size`` before training."""
    torch.manual_seed(size)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(torch.float64).state_dict()


LAUNCHES = {
    "torchrun-2": (2, lambda out: [TORCHRUN, "--standalone", "--nproc-per-node=2", SCRIPT, out]),
    "torchrun-3": (3, lambda out: [TORCHRUN, "--standalone", "--nproc-per-node=3", SCRIPT, out]),
    "horovodrun-3-gloo": (3, lambda out: [HOROVODRUN, "-np", "3", "--gloo", PYTHON, SCRIPT, out]),
}


def check_result(result, world_size):
    assert result["world_size"] == world_size
    for size in SIZES:
        steps = size // 30
        assert result["steps_per_epoch"][size] == steps
        assert result["samples"][size] == EPOCHS * steps * 30, f"size {size}: {result['samples'][size]} samples"


@pytest.mark.launch
def test_one_process_trains_whole_global_batches_and_moves_the_weights(one_process):
    check_result(one_process, 1)
    for size in SIZES:
        weights = one_process["weights"][size]
        assert all(v.dtype == torch.float64 for v in weights.values())
        initial = initial_weights(size)
        assert weights.keys() == initial.keys()
        assert max((weights[k] - initial[k]).abs().max().item() for k in weights) > 1e-2


@pytest.mark.launch
# The loaders take only the rank and world size from the backend: 3 ranks under torchrun (sizes that do not
# divide) in make test; 2 ranks and Horovod's 3 are the launcher matrix (make test-e2e).
@pytest.mark.parametrize("name", in_matrix(list(LAUNCHES), {"torchrun-2", "horovodrun-3-gloo"}))
def test_every_world_size_trains_the_samples_and_weights_of_one_process(name, one_process, tmp_path):
    world_size, command = LAUNCHES[name]
    check(run(command(str(tmp_path)), timeout=180))
    result = torch.load(tmp_path / "result.pt", weights_only=True)
    check_result(result, world_size)
    for size in SIZES:
        ours, reference = result["weights"][size], one_process["weights"][size]
        assert ours.keys() == reference.keys()
        diff = max((ours[k] - reference[k]).abs().max().item() for k in ours)
        assert diff <= 1e-9, f"{name}, {size} samples: max abs weight difference {diff:.3g} vs one process"


def test_killing_the_workers_on_the_way_out_is_not_read_as_a_failed_worker():
    # A rank that exits kills its loaders' workers (kill_workers). The live loader's SIGCHLD handler
    # used to read that as a worker that failed and raise "DataLoader worker (pid N) is killed by
    # signal: Killed" over a rank that had finished (1 torchrun run in 60 exited 1 this way).
    from trainbridge.api.loader_workers import kill_workers

    previous = signal.getsignal(signal.SIGCHLD)
    loader = items(100, 10, num_workers=2, persistent_workers=True)
    batches = iter(loader)
    next(batches)  # the workers run, the loader's SIGCHLD handler is installed
    try:
        kill_workers()
        time.sleep(1.0)  # the SIGCHLDs arrive; a handler that raises does so here
        assert not multiprocessing.active_children()
    finally:
        signal.signal(signal.SIGCHLD, previous)


GLOO_THREADS = str(Path(__file__).resolve().parent / "api_scripts" / "gloo_thread_states.py")


@pytest.mark.skipif(not GLOO_THREAD_STATES_KEPT, reason=f"Python {sys.version.split()[0]} resets its thread-list lock "
                    "in a forked child first (CPython gh-112275 fixed): no thread needs a state of its own")
@pytest.mark.launch
@pytest.mark.parametrize("api", ["torchrun-tb", "torchrun-tb-late", "torchrun-hvd", "horovodrun-job",
                                 "horovodrun-job-late"])
def test_collective_threads_make_no_thread_state_that_a_forked_loader_worker_could_inherit_locked(api):
    # CI once had an evaluation loader's worker stuck for good inside os.fork: a gloo thread was making
    # a Python thread state (to release a finished collective's tensors) at that instant. Before the fix,
    # 128-283 thread states were made per rank during these 200 collectives on gloo's threads, 600 per
    # 300 on the real Horovod's background thread (its Gloo and MPI controllers alike); each one a chance.
    # tb-late: rank 1's main thread loses the CPU after queueing each collective, as on a loaded machine, so
    # its collectives finish before it can attach anything to them (CI: 72 thread states made on one rank,
    # 129 here, before the ranks took turns at coming last); job-late: the same for Horovod's thread (302).
    launcher, mode = api.split("-", 1)
    command = ([TORCHRUN, "--standalone", "--nproc-per-node=2"] if launcher == "torchrun"
               else [HOROVODRUN, "-np", "2", "--gloo", PYTHON])
    out = check(run([*command, GLOO_THREADS, mode], timeout=120)).stdout
    made = re.findall(r"rank \d: (\d+) thread states made during \d+ collectives", out)
    assert made == ["0", "0"], out[-2000:]
