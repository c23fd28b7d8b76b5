"""Elastic state objects: what ``state.commit()`` saves and ``state.sync()`` shares.

``save()`` copies the tracked values in memory, ``restore()`` rolls back to
the last save, ``sync()`` broadcasts rank 0's values to every rank. ``commit()``
= ``save()`` plus, under torchrun, a write of the snapshot to the
commit file (:mod:`.commit_file`) so that a restarted job resumes from it.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch

from ..functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from ..process import rank
from . import commit_file
from .sampler import ElasticSampler


class State:
    """Base class: reset callbacks and the commit protocol."""

    def __init__(self, bcast_object: Callable = broadcast_object, get_rank: Callable = rank) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks: List[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Functions run after the job resumes (e.g. rescale the learning rate by the new hvd.size())."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp, update_res) -> None:
        """Horovod's host-discovery notification; torchrun restarts the job instead."""

    def commit(self) -> None:
        """Save the state in memory and, under torchrun, in the commit file (rank 0 writes it on a thread,
        finished before the process ends; a value the file cannot hold raises here)."""
        self.save()
        path = commit_file.commit_path()
        if path is not None and self._rank() == 0:
            commit_file.writer.save(self.snapshot(), path, commit_file.job_identity())
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """No-op: membership changes arrive as torchrun restarts, not as in-process interrupts."""

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        pass

    def snapshot(self) -> Dict[str, Any]:
        """The last saved state, as one picklable dict."""
        raise NotImplementedError

    def load_snapshot(self, snapshot: Dict[str, Any]) -> None:
        """Make ``snapshot`` the saved state and restore it."""
        raise NotImplementedError


class ObjectState(State):
    """Plain Python values given as keyword arguments, exposed as attributes."""

    def __init__(
        self, bcast_object: Optional[Callable] = None, get_rank: Optional[Callable] = None, **kwargs: Any
    ) -> None:
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object or broadcast_object, get_rank or rank)

    def save(self) -> None:
        self._saved_state = {attr: getattr(self, attr) for attr in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def snapshot(self) -> Dict[str, Any]:
        return {"objects": copy.deepcopy(self._saved_state)}

    def load_snapshot(self, snapshot: Dict[str, Any]) -> None:
        self._saved_state = snapshot["objects"]
        self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, value)


class StateHandler:
    """Save/restore/sync of one model, optimizer or sampler through its state_dict."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.save()

    def save(self) -> None:
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self.saved)

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()

    def sync(self) -> None:
        raise NotImplementedError


class ModelStateHandler(StateHandler):
    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(StateHandler):
    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class SamplerStateHandler(StateHandler):
    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict()))


HANDLERS = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


class TorchState(ObjectState):
    """Models, optimizers and ElasticSamplers (through their state_dicts) plus plain values."""

    def __init__(
        self, model: Optional[torch.nn.Module] = None, optimizer: Optional[torch.optim.Optimizer] = None, **kwargs: Any
    ) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        self._handlers: Dict[str, StateHandler] = {}
        plain = {}
        for key, value in kwargs.items():
            handler = next((h(value) for kind, h in HANDLERS if isinstance(value, kind)), None)
            if handler is None:
                plain[key] = value
            else:
                self._handlers[key] = handler
        for key, handler in self._handlers.items():
            setattr(self, key, handler.value)
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **plain)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def snapshot(self) -> Dict[str, Any]:
        return {"handlers": {key: h.saved for key, h in self._handlers.items()}, **super().snapshot()}

    def load_snapshot(self, snapshot: Dict[str, Any]) -> None:
        for key, saved in snapshot["handlers"].items():
            self._handlers[key].saved = saved
            self._handlers[key].restore()
        super().load_snapshot(snapshot)

    def __setattr__(self, name: str, value: Any) -> None:
        if name != "_handlers" and name in getattr(self, "_handlers", {}):
            self._handlers[name].set_value(value)
        super().__setattr__(name, value)
