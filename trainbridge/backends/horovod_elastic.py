"""Horovod elastic state for the training loop's :class:`~trainbridge.training.state.TrainState`.

Horovod calls ``save`` on every ``commit()``, ``restore`` after a worker failed
(undoing the steps since the last commit), and ``sync`` after the ring re-formed
(rank 0's state to every worker, including newly started ones).
"""

from __future__ import annotations

from typing import Any

from horovod.common.elastic import State


class ElasticTrainState(State):
    def __init__(self, hvd: Any, train_state: Any) -> None:
        self.hvd, self.train_state = hvd, train_state
        self.saved = train_state.snapshot()
        super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank)

    def save(self) -> None:
        self.saved = self.train_state.snapshot()

    def restore(self) -> None:
        self.train_state.restore(self.saved)

    def sync(self) -> None:
        self.saved = self.hvd.broadcast_object(
            self.train_state.snapshot(), root_rank=0, name="trainbridge.elastic_sync"
        )
        self.train_state.restore(self.saved)
