"""Parameters whose ``requires_grad`` changed after ``job.prepare``.

The backend averages the gradients of the parameters that required them when the
model was prepared (DDP builds its buckets then; Horovod's hooks are registered
then). Gradual unfreezing (fastai, ULMFiT: ``backbone.requires_grad_(True)`` at
epoch 1) makes more parameters trainable later, and those would be trained on each
rank's own gradient, so the ranks drift apart. ``job.backward`` averages them
itself, one allreduce for all of them, outside ``job.no_sync``. A parameter frozen
after ``prepare`` gets no gradient, which the backend reads as a rank that skipped it:
it is named in one line unless the model was prepared with ``find_unused_parameters``.
"""

from __future__ import annotations

from typing import Callable, List, Tuple

import torch

from ..errors import UserError


class TrainableSincePrepare:
    """One prepared model's parameters, and which of them required gradients at ``prepare``."""

    def __init__(self, model: torch.nn.Module, find_unused_parameters: bool) -> None:
        self.model = model  # the user's module
        self.named: List[Tuple[str, torch.nn.Parameter]] = list(model.named_parameters())
        self.at_prepare = [p.requires_grad for _, p in self.named]
        self.find_unused_parameters = find_unused_parameters

    def refuse_frozen_since(self) -> None:
        """One line when a parameter trained at ``prepare`` no longer requires gradients (see the module doc)."""
        if self.find_unused_parameters:
            return
        frozen = [n for (n, p), was in zip(self.named, self.at_prepare) if was and not p.requires_grad]
        if frozen:
            shown = ", ".join(frozen[:3]) + (f" and {len(frozen) - 3} more" if len(frozen) > 3 else "")
            raise UserError(
                f"job.backward: {shown} of the prepared model stopped requiring gradients after job.prepare, so "
                f"the ranks cannot average the model's gradients; freeze them before job.prepare, or pass "
                f"find_unused_parameters=True to job.prepare"
            )

    def unfrozen_since(self) -> List[torch.nn.Parameter]:
        """Parameters frozen at ``prepare`` that require gradients now."""
        return [p for (_, p), was in zip(self.named, self.at_prepare) if not was and p.requires_grad]


def average_gradients(params: List[torch.nn.Parameter], allreduce_mean: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Average the gradients of ``params`` over the ranks, in one allreduce; collective.

    As with ``find_unused_parameters``: a parameter no rank gave a gradient keeps None, one
    that some ranks did is averaged with zeros from the others. A flag per parameter travels
    with the gradients, so the ranks agree on which is which. A sparse gradient (an embedding
    table unfrozen late) travels dense and comes back sparse.
    """
    grads = [
        torch.zeros_like(p) if p.grad is None else p.grad.to_dense() if p.grad.is_sparse else p.grad for p in params
    ]
    had = torch.tensor([float(p.grad is not None) for p in params], dtype=grads[0].dtype, device=grads[0].device)
    averaged = allreduce_mean(torch.cat([g.reshape(-1) for g in grads] + [had]))
    offset = 0
    for p, g, anywhere in zip(params, grads, averaged[-len(params) :].tolist()):
        if anywhere > 0:
            mean = averaged[offset : offset + g.numel()].view_as(g)
            if p.grad is not None and p.grad.is_sparse:
                p.grad = mean.to_sparse(p.grad.sparse_dim())
            else:
                if p.grad is None:
                    p.grad = g
                g.copy_(mean)
        offset += g.numel()
