"""``hvd.DistributedOptimizer``: gradients averaged across ranks by hooks that overlap backward.

As in Horovod, the returned object is an instance of a subclass of the wrapped
optimizer's class (``isinstance(opt, torch.optim.SGD)`` stays true) built on the
same param_groups. For each parameter that requires grad, a
``register_post_accumulate_grad_hook`` starts an async, in-place allreduce named
after the parameter as soon as its gradient is complete, while backward goes on
computing earlier layers. ``step()`` (or ``synchronize()``) waits for them.

A parameter whose gradient was not computed on this rank (unused in this
forward) gets a zero gradient and is still reduced in ``synchronize()``, so all
ranks submit the same names and none waits for a peer. With
``backward_passes_per_step=k`` gradients accumulate locally for k backward
passes and are reduced on the k-th.

``process_set=``: gradients are averaged over that set's ranks only; on a rank
outside it the optimizer steps on its local gradients (as Horovod's does).
Sparse gradients (``nn.Embedding(sparse=True)``) are reduced as Horovod does:
by ``sparse_allreduce_async`` (an allgather of indices and values), or, with
``sparse_as_dense=True``, densified, allreduced and made sparse again; either
way the parameter's gradient stays sparse for the optimizer.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

import torch

from .collectives import allreduce_async_, sparse_allreduce_async, synchronize
from .compression import Compression
from .process import rank, size
from .process_sets import global_process_set, set_ranks
from .reduce_ops import Average, resolve_op


class _DistributedOptimizer(torch.optim.Optimizer):
    _is_trainbridge_distributed = True

    def __init__(
        self,
        params,
        named_parameters,
        compression,
        backward_passes_per_step=1,
        op=Average,
        gradient_predivide_factor=1.0,
        sparse_as_dense=False,
        process_set=global_process_set,
    ):
        super(self.__class__, self).__init__(params)
        self._compression = compression
        if named_parameters is not None:
            named_parameters = list(named_parameters)
        else:
            named_parameters = [
                (f"allreduce.noname.{i}.{j}", v)
                for i, group in enumerate(self.param_groups)
                for j, v in enumerate(group["params"])
            ]
        if any(not isinstance(p, tuple) for p in named_parameters):
            raise ValueError(
                "named_parameters should be a sequence of tuples (name, parameter), "
                "usually produced by model.named_parameters()."
            )
        names = [name for name, _ in named_parameters]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(
                f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(duplicates)}"
            )
        all_ids = {id(v) for group in self.param_groups for v in group["params"]}
        unnamed = all_ids - {id(v) for _, v in named_parameters}
        if unnamed:
            raise ValueError(
                "named_parameters was specified, but one or more model parameters were not named. "
                f"Python object ids: {', '.join(str(i) for i in unnamed)}"
            )

        self._parameter_names = {v: k for k, v in sorted(named_parameters, key=lambda kv: kv[0])}
        self.backward_passes_per_step = backward_passes_per_step
        self._allreduce_delay = {v: backward_passes_per_step for _, v in named_parameters}
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._handles = {}
        self._hook_handles = []
        self._requires_update = set()
        self._synchronized = False
        self._should_synchronize = True
        if process_set.included() and size() > 1:
            self._register_hooks()

    def load_state_dict(self, *args, **kwargs):
        self._handles = {}
        self._synchronized = False
        self._should_synchronize = True
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        super(self.__class__, self).load_state_dict(*args, **kwargs)

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    def _register_hooks(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self._requires_update.add(p)
                    self._hook_handles.append(p.register_post_accumulate_grad_hook(self._make_hook(p)))

    def _make_hook(self, p):
        def hook(_param):
            if p in self._handles and self._handles[p][0] is not None and self._allreduce_delay[p] <= 0:
                raise AssertionError(
                    "Gradients were computed more than backward_passes_per_step times before "
                    "call to step(). Increase backward_passes_per_step to accumulate gradients "
                    "locally."
                )
            self._allreduce_delay[p] -= 1
            handle, ctx = None, None
            if self._allreduce_delay[p] == 0:
                handle, ctx = self._allreduce_grad_async(p)
            self._handles[p] = (handle, ctx)

        return hook

    def _allreduce_grad_async(self, p):
        if p.grad is None:
            # Not computed on this rank (unused in this forward), but a peer may have it: reduce zeros.
            p.grad = p.data.new(p.size()).zero_()
        name = self._parameter_names.get(p)
        tensor = p.grad
        if tensor.is_sparse:
            if not self.sparse_as_dense:
                # A callable handle: it waits for the allgathers and returns the aggregated sparse tensor.
                return sparse_allreduce_async(tensor, name=name, op=self.op, process_set=self.process_set), None
            tensor = tensor.to_dense()
        compressed, ctx = self._compression.compress(tensor)
        prescale, postscale = 1.0, 1.0
        if self.op == Average:
            # Split the average around the sum; the engine adds the 1/size.
            prescale, postscale = 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        handle = allreduce_async_(
            compressed,
            name=name,
            op=self.op,
            prescale_factor=prescale,
            postscale_factor=postscale,
            process_set=self.process_set,
        )
        return handle, ctx

    def synchronize(self) -> None:
        """Wait for every gradient allreduce; gradients not yet submitted are submitted now."""
        if not self.process_set.included():
            self._synchronized = True
            return
        for p in self._requires_update - set(self._handles):
            self._handles[p] = self._allreduce_grad_async(p)
        for p, (handle, _) in list(self._handles.items()):
            if handle is None:
                self._handles[p] = self._allreduce_grad_async(p)
        for p, (handle, ctx) in self._handles.items():
            output = handle() if callable(handle) else synchronize(handle)
            self._allreduce_delay[p] = self.backward_passes_per_step
            if p.grad.is_sparse:
                aggregated = output if ctx is None else self._compression.decompress(output, ctx)
                if not aggregated.is_sparse:
                    aggregated = aggregated.to_sparse()  # sparse_as_dense: back to the layout the optimizer expects
                p.grad.zero_().add_(aggregated)  # sparse tensors have no set_()
            else:
                p.grad.set_(self._compression.decompress(output, ctx))
        self._handles.clear()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Make ``step()`` skip synchronization, after an explicit ``synchronize()`` (e.g. to clip gradients)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                    "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in "
                    "your code.",
                    stacklevel=1,
                )  # attributed here, as in horovod.torch
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True):
        if self._handles:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(). This is prohibited as it can cause "
                "a race condition."
            )
        return super(self.__class__, self).zero_grad(set_to_none)


def DistributedOptimizer(
    optimizer,
    named_parameters=None,
    compression=Compression.none,
    backward_passes_per_step=1,
    op=Average,
    gradient_predivide_factor=1.0,
    num_groups=0,
    groups=None,
    sparse_as_dense=False,
    process_set=global_process_set,
):
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged (``op``) over ``process_set``'s ranks.

    ``num_groups``/``groups`` are accepted for compatibility; the engine fuses
    ready gradients on its own (HOROVOD_FUSION_THRESHOLD).
    """
    if process_set.included():
        set_ranks(process_set, rank())  # ValueError now for a set that is not registered
    op = resolve_op(op, None)  # rejects Adasum with the alternative named
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if num_groups != 0:
        warnings.warn(
            "Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
            DeprecationWarning,
            stacklevel=1,
        )  # attributed here, as in horovod.torch
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    return cls(
        optimizer.param_groups,
        named_parameters,
        compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        sparse_as_dense,
        process_set,
    )
