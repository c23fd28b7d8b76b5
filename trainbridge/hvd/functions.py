"""Helpers built on the collectives: broadcast model and optimizer state, and Python objects.

Same behaviour as ``horovod.torch.functions`` 0.28.1, including its quirk that
a fresh optimizer's state is created by one zero-gradient ``step()`` before it is
broadcast (this advances Adam's step count and applies weight decay once), with
one difference: when the root's optimizer already had state (a resumed job, an
elastic restart), a rank whose fresh optimizer took that step gets its parameters
back as they were, so they stay the root's (Horovod leaves them decayed, apart).
Objects are pickled with cloudpickle when it is installed (Horovod's choice, so
lambdas work), else with the standard pickle. Every function takes
``process_set=`` (``broadcast_parameters``, ``broadcast_optimizer_state`` and
``allgather_object`` in addition to Horovod 0.28.1, whose versions span all ranks).
"""

from __future__ import annotations

import collections
import io
from typing import Any, Dict, List, Optional, Set, cast

import torch

from .collectives import allgather, broadcast_, broadcast_async_, synchronize
from .process import rank
from .process_sets import global_process_set

try:
    import cloudpickle as _pickle
except ImportError:  # pragma: no cover - cloudpickle comes with Horovod, not with trainbridge
    import pickle as _pickle


def broadcast_parameters(params, root_rank: int, process_set=global_process_set) -> None:
    """Overwrite, in place, every rank's tensors with ``root_rank``'s.

    ``params``: ``model.state_dict()``, ``model.named_parameters()`` (as a list)
    or ``model.parameters()`` (as a list).
    """
    if isinstance(params, dict):
        params = sorted(params.items())
    elif isinstance(params, list):
        params = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    # Start every broadcast first, then wait: the engine fuses nothing here but
    # negotiates them all in a few cycles instead of one cycle per tensor.
    handles = [broadcast_async_(p, root_rank, name, process_set=process_set) for name, p in params]
    for handle in handles:
        synchronize(handle)


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer, root_rank: int, model=None, process_set=global_process_set
) -> None:
    """Make every rank's optimizer state (tensors, step counts, hyper-parameters) equal to ``root_rank``'s."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    state_dict = optimizer.state_dict()

    sparse_params: Set[int] = set()
    if model is not None:
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding) and module.sparse:
                sparse_params.update(id(p) for p in module.parameters())

    # A new optimizer has no state yet: create it with one zero-gradient step, as Horovod does. That step
    # moves the parameters (weight decay). Where the root's optimizer had state, the root takes no such step:
    # a rank that takes it then keeps its parameters aside and puts them back at the end, so that weights
    # broadcast before this call stay the root's.
    had_state = len(state_dict["state"]) > 0
    root_had_state = broadcast_object(had_state, root_rank, "broadcast_optimizer_state.root", process_set)
    before_step: List[torch.Tensor] = []
    if not had_state:
        if root_had_state:
            before_step = [p.detach().clone() for group in optimizer.param_groups for p in group["params"]]
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and id(p) not in state_dict["state"]:
                    p.grad = p.data.new(p.size()).zero_()
                    if isinstance(optimizer, torch.optim.SparseAdam) or (
                        isinstance(optimizer, torch.optim.SGD) and id(p) in sparse_params
                    ):
                        p.grad = p.grad.to_sparse()
        # DistributedOptimizer.step() would allreduce, which deadlocks unless every
        # rank calls it; the wrapped optimizer's own step is enough here.
        if getattr(optimizer, "_is_trainbridge_distributed", False):
            # The class is built at run time (DistributedOptimizer): its base is the user's optimizer class.
            cast(torch.optim.Optimizer, super(optimizer.__class__, optimizer)).step()
        else:
            optimizer.step()
        state_dict = optimizer.state_dict()
    if len(state_dict["state"]) == 0:
        return  # a stateless optimizer (e.g. SGD without momentum)

    params, scalars, callbacks = [], {}, {}
    occurrences: Dict[str, int] = collections.defaultdict(int)

    def assign_state(pid, key):
        def assign(value):
            state_dict["state"][pid][key] = value

        return assign

    def assign_option(index, key):
        def assign(value):
            optimizer.param_groups[index][key] = value

        return assign

    for index, group in enumerate(state_dict["param_groups"]):
        # Hyper-parameters (lr, betas, ...) are Python scalars: one pickled broadcast for all.
        for key, value in group.items():
            if key != "params":
                scalars[f"{key}.{index}"] = value
                callbacks[f"{key}.{index}"] = assign_option(index, key)
        for pid in group["params"]:
            if pid not in state_dict["state"]:
                continue  # a parameter that does not require grad has no state
            for key, value in state_dict["state"][pid].items():
                occurrences[key] += 1
                unique = f"{key}.{occurrences[key]}"
                if torch.is_tensor(value):
                    params.append((unique, value))
                else:
                    scalars[unique] = value
                    callbacks[unique] = assign_state(pid, key)

    broadcast_parameters(params, root_rank, process_set=process_set)
    for key, value in broadcast_object(scalars, root_rank, process_set=process_set).items():
        callbacks[key](value)
    with torch.no_grad():
        for p, saved in zip((p for group in optimizer.param_groups for p in group["params"]), before_step):
            p.copy_(saved)


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None, process_set=global_process_set) -> Any:
    """``root_rank``'s ``obj`` (pickled), on every rank."""
    name = type(obj).__name__ if name is None else name
    if rank() == root_rank:
        buffer = io.BytesIO()
        _pickle.dump(obj, buffer)
        payload = torch.ByteTensor(bytearray(buffer.getvalue()))
        length = torch.IntTensor([payload.shape[0]])
        broadcast_(length, root_rank, name + ".sz", process_set)
    else:
        length = torch.IntTensor([0])
        broadcast_(length, root_rank, name + ".sz", process_set)
        payload = torch.ByteTensor(int(length[0]))
    broadcast_(payload, root_rank, name + ".t", process_set)
    if rank() != root_rank:
        obj = _pickle.loads(payload.numpy().tobytes())
    return obj


def allgather_object(obj: Any, name: Optional[str] = None, process_set=global_process_set) -> List[Any]:
    """Every member's ``obj`` (pickled), in rank order."""
    name = type(obj).__name__ if name is None else name
    buffer = io.BytesIO()
    _pickle.dump(obj, buffer)
    payload = torch.ByteTensor(bytearray(buffer.getvalue()))
    sizes = allgather(torch.IntTensor([payload.shape[0]]), name=name + ".sz", process_set=process_set).tolist()
    gathered = allgather(payload, name=name + ".t", process_set=process_set).numpy()
    offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    return [_pickle.loads(gathered[offsets[i] : offsets[i + 1]].tobytes()) for i in range(len(sizes))]
