"""Gradient averaging with DDP's contract, for collective libraries that have no DDP (Horovod).

DDP averages a model's gradients *during* each backward pass that reaches it and
finishes before ``backward()`` returns. Horovod's ``DistributedOptimizer`` instead
finishes inside ``optimizer.step()``, so code between the two (gradient clipping,
``scaler.unscale_``, gradient inspection) saw local, unaveraged gradients, and a
second backward pass before the step (a GAN's discriminator on real, then on
fake images) tripped its ``backward_passes_per_step`` count. Here, as in DDP:

* each parameter's gradient is sent as soon as it is accumulated (a hook), so
  communication overlaps the rest of the backward pass;
* the end of the backward pass (an autograd engine callback) waits for all of them,
  so gradients are averaged when ``backward()`` returns, on every backend;
* ``no_sync`` is read when the forward pass runs, as DDP reads it;
* a backward pass that reaches some but not all of a model's parameters is an
  error, unless ``find_unused_parameters``: then the ranks agree on which
  parameters any of them used; those get the average (zeros from the ranks that
  did not use them) and the rest keep their gradient untouched (None stays None);
* a backward pass that raises (under Horovod elastic: a peer died, so the next
  hook's allreduce fails) never reaches its end: the autograd engine drops the
  queued callback. Its averages must be forgotten with ``abandon()`` before the
  next backward pass, which otherwise would queue no callback of its own, wait
  for none of its averages and send their names again while they are in flight.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterator, List, Tuple

import torch
from torch.autograd import Variable

from ..errors import UserError

# Starts averaging ``tensor`` over the ranks under a name every rank uses for it;
# the returned function waits and gives the average.
StartAverage = Callable[[torch.Tensor, str], Callable[[], torch.Tensor]]
AgreeUsed = Callable[[torch.Tensor], torch.Tensor]  # elementwise max over ranks


class HookedAverage:
    """Average ``model``'s gradients over the ranks at the end of every backward pass that reaches it."""

    def __init__(
        self,
        model: torch.nn.Module,
        prefix: str,
        start_average: StartAverage,
        agree_used: AgreeUsed,
        find_unused_parameters: bool = False,
    ) -> None:
        self.params: List[Tuple[str, torch.nn.Parameter]] = [
            (n, p) for n, p in model.named_parameters() if p.requires_grad
        ]
        self.names = {p: f"{prefix}.{n}" for n, p in self.params}
        self.start_average, self.agree_used = start_average, agree_used
        self.find_unused = find_unused_parameters
        self.pending: Dict[torch.nn.Parameter, Callable[[], torch.Tensor]] = {}
        self.sync = True  # the no_sync state the last forward pass ran in
        self.in_no_sync = False  # inside no_sync() now
        self.finishing = False  # an end-of-backward callback is queued
        model.register_forward_pre_hook(self._forward_starts)
        for _, p in self.params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous, self.in_no_sync = self.in_no_sync, True
        try:
            yield
        finally:
            self.in_no_sync = previous

    def _forward_starts(self, module: torch.nn.Module, args: object) -> None:
        if torch.is_grad_enabled():
            self.sync = not self.in_no_sync

    def _grad_ready(self, p: torch.nn.Parameter) -> None:
        if not self.sync:
            return
        if not self.finishing:
            self.finishing = True
            Variable._execution_engine.queue_callback(self._finish)
        grad = p.grad
        assert grad is not None  # the hook runs once the gradient is accumulated into p.grad
        if grad.is_sparse:  # averaged dense, as Horovod's sparse_as_dense
            grad = p.grad = grad.to_dense()
        self.pending[p] = self.start_average(grad, self.names[p])

    def abandon(self) -> None:
        """Forget a backward pass that raised before its end: none of its averages is waited for.

        Its handles belong to the collective library's state before the failure (Horovod
        elastic re-initialises it), so they are dropped, not waited on. A no-op between passes.
        """
        self.pending, self.finishing = {}, False

    def _finish(self) -> None:
        """End of a backward pass that reached the model: wait for every average to land in ``p.grad``."""
        self.finishing = False
        pending, self.pending = self.pending, {}
        missing = [(n, p) for n, p in self.params if p not in pending]
        if missing and not self.find_unused:
            names = ", ".join(n for n, _ in missing[:3]) + (" ..." if len(missing) > 3 else "")
            raise UserError(
                f"{len(missing)} parameter(s) of the prepared model got no gradient in this backward "
                f"pass ({names}), so the ranks cannot average them; pass find_unused_parameters=True to "
                f"job.prepare for a model that uses only some of its parameters, or freeze them "
                f"(requires_grad_(False))"
            )
        if self.find_unused:
            used = torch.tensor([float(p in pending) for _, p in self.params])
            anywhere = self.agree_used(used)
            for (_, p), flag in zip(self.params, anywhere.tolist()):
                if flag and p not in pending:  # used on another rank: this rank contributes zeros
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    pending[p] = self.start_average(p.grad, self.names[p])
        for p, wait in pending.items():
            averaged, grad = wait(), p.grad
            assert grad is not None  # every pending average was started from p.grad
            if averaged is not grad:
                grad.copy_(averaged)
