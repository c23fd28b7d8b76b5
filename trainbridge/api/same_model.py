"""The ranks hold the same model: checked, not assumed.

Data parallelism is correct only while every rank holds bitwise the same weights:
each applies the same averaged gradients to the same parameters. Code that PyTorch
accepts can break that silently (a layer unfrozen after ``prepare`` and trained
outside the averaging, an EMA copy built from per-rank initial weights, a rank-local
scheduler decision), and nothing fails: each rank trains and evaluates a model of
its own, and rank 0's is saved.

So the job compares a fingerprint of every parameter, and of every buffer that the
job keeps the same on all ranks (the running statistics of synchronized BatchNorm),
of each prepared model and of each module given to ``job.save``, at each save, at
each exact evaluation and every N steps. A fingerprint is the sum of the tensor's
elements read as integers (their bits): a change of any one element changes it, and
it costs one pass over the weights plus one small allreduce. A difference is one line naming
the first tensor that differs, the ranks and the step.

Per-rank buffers (plain BatchNorm's running statistics, which every rank updates
from its own batches, see ``job.sync_buffers``) are not compared. Nor are the shards of
a sharded model's parameters (``prepare(shard=True)``): each element lives on one rank
only, so there is no second copy to differ; its buffers, which every rank holds whole,
are compared as any model's are.
"""

from __future__ import annotations

from typing import Iterable, List, Mapping, Tuple

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from ..backends import Backend
from ..backends.fsdp import replicated_part
from ..errors import UserError

CHECK_EVERY = 100  # job.step calls between two checks (tb.init(check_every=...)); 0: never between saves

# The integer type of each element size: the fingerprint sums a tensor's bits, read as these.
_BITS_AS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """An int64 on the tensor's device that changes whenever one element's bits change."""
    flat = tensor.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.view(_BITS_AS[flat.element_size()]).sum(dtype=torch.int64)


def kept_identical(module: torch.nn.Module) -> Iterable[Tuple[str, torch.Tensor]]:
    """(name, tensor) of what every rank must hold bitwise alike: parameters and synchronized buffers."""
    for name, param in module.named_parameters():
        held_alike = replicated_part(param)  # None for a parameter sharded over the ranks
        if held_alike is not None:
            yield name, held_alike
    for owner_name, owner in module.named_modules():
        if isinstance(owner, _BatchNorm) and not getattr(owner, "synchronized", False):
            continue  # plain BatchNorm: statistics of this rank's batches
        for name, buffer in owner.named_buffers(recurse=False):
            yield (f"{owner_name}.{name}" if owner_name else name), buffer


class SameModelCheck:
    """Compares the ranks' fingerprints of some modules; ``check`` is collective (every rank calls it)."""

    def __init__(self, backend: Backend, every: int = CHECK_EVERY) -> None:
        self.check_every_valid(every)
        self.backend, self.every = backend, every

    @staticmethod
    def check_every_valid(every: int) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise UserError(
                f"check_every must be a whole number of steps, or 0 to check only at saves and evaluations "
                f"(got {every!r})"
            )

    def due(self, step: int) -> bool:
        """Whether the check runs after this many ``job.step`` calls."""
        return self.every > 0 and step % self.every == 0

    def check(self, modules: Mapping[str, torch.nn.Module], when: str) -> None:
        """One line on every rank when any rank holds other bits in any of ``modules`` (by label)."""
        named: List[Tuple[str, torch.Tensor]] = [
            (f"{name!r} of {label}" if name else label, tensor)
            for label, module in modules.items()
            for name, tensor in kept_identical(module)
        ]
        if not named:
            return
        mine = torch.stack([fingerprint(t).to(self.backend.device) for _, t in named])
        if self.backend.same_on_every_rank(mine):
            return
        everyone = self.backend.allgather_object(mine.cpu().tolist())  # only now: which tensor, which ranks
        first = next(i for i in range(len(named)) if any(f[i] != everyone[0][i] for f in everyone))
        groups: dict = {}
        for rank, fingerprints in enumerate(everyone):
            groups.setdefault(fingerprints[first], []).append(rank)
        apart = " vs ".join(f"rank{'s' * (len(r) > 1)} {','.join(map(str, r))}" for r in groups.values())
        raise UserError(
            f"the ranks hold different models {when}: {named[first][0]} differs ({apart}); they train "
            f"apart from here on. Usual causes: a parameter trained outside job.backward's averaging, a module "
            f"copied before job.prepare from per-rank weights (copy it after prepare), a buffer or weight changed "
            f"on some ranks only",
            quiet=not self.backend.is_main,
        )
