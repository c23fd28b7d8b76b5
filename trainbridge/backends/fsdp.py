"""Sharded data parallelism: torch's FSDP2 (``torch.distributed.fsdp.fully_shard``), on nccl or gloo.

``job.prepare(model, optimizer, shard=True)`` comes here on the torch backend. Each rank keeps
1/N of every parameter, of its gradient and of the optimizer's state (parameters become
``DTensor``s sharded on dim 0). A forward pass gathers one unit of parameters at a time
(all-gather), uses it and frees it again; the backward pass gathers it once more and
reduce-scatters the gradients, so each rank ends with the average over the ranks of its
own shard's gradient: what DDP's allreduce gives, 1/N of it per rank.

The units: each of the model's repeated blocks (by default the classes that repeat among the
children of one container, such as the layers of an ``nn.ModuleList`` or the ``BasicBlock``s of
a ResNet stage; or the classes the user names), then the root for what is left. Peak memory
is then the shards plus one block gathered.

Every rank starts from rank 0's weights (broadcast before sharding, as DDP does), and the
optimizers the user built over the unsharded parameters are pointed at the sharded ones.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Type

import torch

from ..errors import UserError

ShardBlocks = Tuple[Type[torch.nn.Module], ...]


def shard_blocks(shard: object) -> Optional[ShardBlocks]:
    """``prepare``'s ``shard``: None (not sharded), () (the repeated blocks) or the module classes given."""
    if shard is False or shard is None:
        return None
    if shard is True:
        return ()
    if isinstance(shard, type):
        shard = [shard]
    if (
        isinstance(shard, (list, tuple))
        and shard
        and all(isinstance(c, type) and issubclass(c, torch.nn.Module) for c in shard)
    ):
        return tuple(shard)
    raise UserError(
        f"job.prepare: shard={shard!r} is not understood; pass shard=True (each repeated block of the model is "
        f"sharded as one unit) or a list of the module classes to shard as units (shard=[MyBlock])"
    )


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether any of ``module``'s parameters is a ``DTensor`` (FSDP2's or the user's own sharding)."""
    tensor_module = sys.modules.get("torch.distributed.tensor")  # no DTensor exists before it is imported
    if tensor_module is None:
        return False
    return any(isinstance(p, tensor_module.DTensor) for p in module.parameters())


def replicated_part(tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """The part of ``tensor`` every rank holds alike: the tensor itself, a replicated ``DTensor``'s local
    tensor, or None for one sharded over the ranks (each element lives on one rank only)."""
    tensor_module = sys.modules.get("torch.distributed.tensor")
    if tensor_module is None or not isinstance(tensor, tensor_module.DTensor):
        return tensor
    if all(placement.is_replicate() for placement in tensor.placements):
        return tensor.to_local()
    return None


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or the full value of a ``DTensor`` (clip_grad_norm_'s total norm over sharded gradients)."""
    full = getattr(tensor, "full_tensor", None)
    return full() if full is not None else tensor


def repeated_blocks(model: torch.nn.Module, classes: ShardBlocks = ()) -> List[torch.nn.Module]:
    """The modules sharded as units, outermost first, none inside another.

    With ``classes``: every module of those classes. Without: in each ``nn.ModuleList`` and
    ``nn.Sequential``, the children whose class (with parameters) occurs there at least twice:
    the layers of a transformer, the blocks of a ResNet stage.
    """
    chosen: List[torch.nn.Module] = []
    inside: set = set()  # ids of modules within a chosen block

    def take(module: torch.nn.Module) -> None:
        chosen.append(module)
        inside.update(id(m) for m in module.modules())

    for module in model.modules():
        if id(module) in inside:
            continue
        if classes:
            if module is not model and isinstance(module, classes):
                take(module)
            continue
        if not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        children = [c for c in module.children() if any(True for _ in c.parameters())]
        counts: Dict[type, int] = {}
        for child in children:
            counts[type(child)] = counts.get(type(child), 0) + 1
        for child in children:
            if counts[type(child)] > 1 and id(child) not in inside:
                take(child)
    return chosen


def shard_model(
    model: torch.nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    blocks: ShardBlocks,
    device: torch.device,
    world_size: int,
    param_dtype: Optional[torch.dtype],
    reduce_dtype: Optional[torch.dtype],
    cpu_offload: bool,
) -> torch.nn.Module:
    """``fully_shard`` each block of ``model``, then the model itself; ``optimizers`` moved onto the shards.

    The ranks already hold rank 0's weights. ``param_dtype``: the dtype parameters are gathered and
    computed in (the job's amp), ``reduce_dtype``: the dtype gradients are averaged in (the job's
    compression, else the parameters' own). ``cpu_offload``: shards, gradients and optimizer state
    in host memory between uses. Returns the same module object (its class becomes a subclass).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    for optimizer in optimizers:
        if optimizer.state:
            raise UserError(
                f"job.prepare(shard=...): the {type(optimizer).__name__} already holds state (it has stepped, or a "
                f"checkpoint was loaded into it), which cannot be split over the ranks here; build the optimizer "
                f"fresh, and load a checkpoint after job.prepare with job.load(path, into={{...}})"
            )
    names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    mesh = init_device_mesh(device.type, (world_size,))
    precision = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy()
    for block in repeated_blocks(model, blocks):
        fully_shard(block, mesh=mesh, mp_policy=precision, offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=precision, offload_policy=offload)
    # fully_shard registers new (DTensor) parameters: the user's optimizers still hold the old ones.
    sharded = dict(model.named_parameters(remove_duplicate=False))
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [sharded[names[id(p)]] for p in group["params"]]
    return model


def fsdp_units(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The modules of ``model`` that ``fully_shard`` made units (the root last)."""
    from torch.distributed.fsdp import FSDPModule

    units: List[torch.nn.Module] = [m for m in model.modules() if isinstance(m, FSDPModule)]
    return units[1:] + units[:1]


@contextlib.contextmanager
def gradient_sync_off(model: torch.nn.Module) -> Iterator[None]:
    """Backward passes only accumulate each rank's unsharded gradients (no reduce-scatter): ``job.no_sync``."""
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]


def gather_for_evaluation(model: torch.nn.Module) -> None:
    """Gather the whole model on every rank until its next training forward; collective.

    An exact evaluation gives the ranks uneven shares of the set, so they run different
    numbers of forward passes, which must then wait for no other rank: the parameters stay
    gathered through the pass. :func:`shard_again` undoes it (the next training forward calls it,
    and so do the job's saves, loads and gathers, which need the sharded parameters in place).
    """
    if not hasattr(model, "unshard"):  # one process: the model was never sharded
        return
    model.set_reshard_after_forward(False)  # type: ignore[operator]
    for unit in fsdp_units(model):
        unit.unshard()  # type: ignore[operator]
    model._trainbridge_gathered = True  # type: ignore[assignment]


def shard_again(model: torch.nn.Module) -> None:
    """Free what :func:`gather_for_evaluation` gathered: the module holds its shards again (local, no collective).

    While gathered, a module's registered parameters are the whole ones, not the shards the
    optimizer steps."""
    if not getattr(model, "_trainbridge_gathered", False):
        return
    model._trainbridge_gathered = False  # type: ignore[assignment]
    for unit in fsdp_units(model):
        unit.reshard()  # type: ignore[operator]
    # The blocks free their parameters after each forward again; the root keeps its own, as fully_shard sets it.
    model.set_reshard_after_forward(True)  # type: ignore[operator]
    model.set_reshard_after_forward(False, recurse=False)  # type: ignore[operator]


def shard_again_when_training(model: torch.nn.Module) -> None:
    """Register the hook that calls :func:`shard_again` before the next training forward (FSDP then gathers
    each block afresh, with the weights of the steps taken since)."""

    def before_forward(module: torch.nn.Module, args: object) -> None:
        if module.training:
            shard_again(module)

    model.register_forward_pre_hook(before_forward, prepend=True)


def whole_state_dict(model: torch.nn.Module, main_rank_only: bool = False) -> Dict[str, Any]:
    """``model``'s state_dict with every sharded parameter gathered whole; collective. ``main_rank_only``:
    in host memory on rank 0 only (the others get an empty dict), never the whole model on the others."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=main_rank_only))


def load_whole_state(model: torch.nn.Module, state: Mapping[str, Any]) -> None:
    """``model.load_state_dict(state)`` for a whole (unsharded) ``state``: a sharded model takes its own shards."""
    if not is_sharded(model):
        model.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, dict(state), options=StateDictOptions(full_state_dict=True))
