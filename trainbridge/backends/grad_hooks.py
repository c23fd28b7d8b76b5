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
  so gradients are averaged when ``backward()`` returns, on every backend; a backward
  pass run inside another's node (reentrant activation checkpointing) defers that
  wait to the end of the enclosing pass, which produces the model's other gradients;
* ``no_sync`` is read when the forward pass runs, as DDP reads it;
* a backward pass that reaches some but not all of a model's parameters is an
  error, unless ``find_unused_parameters``: then the ranks agree on which
  parameters any of them used; those get the average (zeros from the ranks that
  did not use them) and the rest keep their gradient untouched (None stays None);
* a sparse gradient (``nn.Embedding(sparse=True)``) is averaged as a sparse tensor
  (the backend gathers every rank's rows) that replaces ``p.grad``, so it stays
  sparse for ``SparseAdam``; a rank that did not use the table adds no rows;
* a backward pass that raises (under Horovod elastic: a peer died, so the next
  hook's allreduce fails) never reaches its end: the autograd engine drops the
  queued callback. Its averages must be forgotten with ``abandon()`` before the
  next backward pass, which otherwise would queue no callback of its own, wait
  for none of its averages and send their names again while they are in flight;
* a deep copy of the model (an EMA copy, ``AveragedModel``) is the plain module, whose
  gradients are never averaged, as under DDP.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterator, List, Tuple

import torch
from torch.autograd import Variable

from ..errors import UserError
from .base import sparse_gradient_parameters

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
        self.sparse = sparse_gradient_parameters(model)
        self.pending: Dict[torch.nn.Parameter, Callable[[], torch.Tensor]] = {}
        self.sync = True  # the no_sync state the last forward pass ran in
        self.in_no_sync = False  # inside no_sync() now
        self.finishing = False  # an end-of-backward callback is queued
        hook = model.register_forward_pre_hook(self._forward_starts)
        for _, p in self.params:
            p.register_post_accumulate_grad_hook(self._grad_ready)
        # A deepcopy of the model (an EMA copy, AveragedModel) is the plain module, none of whose gradients
        # are averaged: parameters copy without their hooks, and this copies it without the forward hook.
        model.__dict__["__deepcopy__"] = CopyWithoutHook(model, hook.id)

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
        self.pending[p] = self.start_average(grad, self.names[p])

    def _finish_after(self, node: Any) -> None:
        """Run :meth:`_finish` at the end of the pass that runs ``node`` (that pass's callback queue)."""
        queued: List[bool] = []

        def queue_finish(grad_inputs: object, grad_outputs: object) -> None:
            if not queued:  # once, also if the graph is kept (retain_graph) and run again
                queued.append(True)
                Variable._execution_engine.queue_callback(self._finish)

        node.register_hook(queue_finish)

    def abandon(self) -> None:
        """Forget a backward pass that raised before its end: none of its averages is waited for.

        Its handles belong to the collective library's state before the failure (Horovod
        elastic re-initialises it), so they are dropped, not waited on. A no-op between passes.
        """
        self.pending, self.finishing = {}, False

    def _finish(self) -> None:
        """End of a backward pass that reached the model: wait for every average to land in ``p.grad``."""
        enclosing = torch._C._current_autograd_node()
        if enclosing is not None:
            # This pass ran inside a node of another (reentrant checkpointing recomputes a segment and
            # runs its backward pass there), which may still produce the model's other gradients.
            self._finish_after(enclosing)
            return
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
                        p.grad = no_rows(p) if p in self.sparse else torch.zeros_like(p)
                    pending[p] = self.start_average(p.grad, self.names[p])
        for p, wait in pending.items():
            averaged, grad = wait(), p.grad
            assert grad is not None  # every pending average was started from p.grad
            if grad.is_sparse:
                p.grad = averaged  # a sparse average has other rows than this rank's gradient: not in place
            elif averaged is not grad:
                grad.copy_(averaged)


def no_rows(p: torch.nn.Parameter) -> torch.Tensor:
    """A sparse gradient of ``p`` (an embedding table) with no rows: what a rank that did not use ``p`` adds."""
    indices = torch.empty((1, 0), dtype=torch.long, device=p.device)
    return torch.sparse_coo_tensor(indices, p.new_empty((0, *p.shape[1:])), p.shape, check_invariants=True)


class CopyWithoutHook:
    """A hooked model's ``__deepcopy__``: a deep copy of the model without the forward hook ``hook_id``."""

    def __init__(self, model: torch.nn.Module, hook_id: int) -> None:
        self.model, self.hook_id = weakref.ref(model), hook_id

    def __call__(self, memo: Dict[int, Any]) -> torch.nn.Module:
        model = self.model()
        assert model is not None  # called as the model's own attribute
        hooks = model._forward_pre_hooks
        del model.__dict__["__deepcopy__"]  # so that the copy below is the ordinary one (or the class's own)
        model.__dict__["_forward_pre_hooks"] = OrderedDict((k, h) for k, h in hooks.items() if k != self.hook_id)
        try:
            return copy.deepcopy(model, memo)
        finally:
            model.__dict__["_forward_pre_hooks"] = hooks
            model.__dict__["__deepcopy__"] = self
