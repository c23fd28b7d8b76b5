"""trainbridge.api.signature: whether every rank passed the same small value, in one fixed-size allreduce."""
import torch

from trainbridge.api.signature import digest, same_on_every_rank


class TwoRanks:
    """A backend's max-allreduce over this rank and a peer whose value the test gives (the collective's arithmetic)."""

    def __init__(self, peer_value):
        self.peer = torch.tensor([float(digest(peer_value)), -float(digest(peer_value))], dtype=torch.float64)
        self.calls = []

    def allreduce_async(self, tensor, op, name):
        self.calls.append((tuple(tensor.shape), tensor.dtype, op, name))
        result = torch.maximum(tensor, self.peer)
        return lambda: result


def test_the_digest_is_stable_and_exact_in_a_float64():
    value = {"dtype": "torch.float32", "shape": (3,)}
    assert digest(value) == digest(dict(value)) < 2 ** 52 and float(digest(value)) == digest(value)
    assert digest(value) != digest({"dtype": "torch.float32", "shape": (4,)})


def test_equal_values_agree_and_any_difference_is_seen_in_one_small_allreduce():
    mine = {"dtype": "torch.float32", "shape": (3,)}
    peers = [(dict(mine), True), ({**mine, "shape": (4,)}, False), ({**mine, "dtype": "torch.int32"}, False)]
    for peer, agreed in peers:
        backend = TwoRanks(peer)
        assert same_on_every_rank(backend, mine, "job.allreduce.signature") is agreed
        # and the peer, with the values swapped, answers the same
        assert same_on_every_rank(TwoRanks(mine), peer, "job.allreduce.signature") is agreed
        assert backend.calls == [((2,), torch.float64, "max", "job.allreduce.signature")]
