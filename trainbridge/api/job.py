"""The public API: one :class:`Job` per process, whatever started it.

::

    import trainbridge as tb

    job = tb.init()                                   # torchrun, horovodrun, mpirun, srun or python
    model, optimizer = job.prepare(model, optimizer)  # on job.device; gradients averaged over ranks
    loader = job.train_loader(dataset, batch_size=64, seed=0)
    for epoch in range(epochs):
        for x, y in loader:                           # this rank's shard, reshuffled every pass
            optimizer.zero_grad()
            with job.autocast():
                loss = loss_fn(model(x), y)
            job.backward(loss)
            job.step(optimizer)
    job.save({"model": model, "optimizer": optimizer, "loader": loader}, "ckpt.pt")
    job.exit(0)

Every difference between DDP and Horovod lives in the backend
(:mod:`trainbridge.backends`); this module only adds what a loop needs on top:
loaders, checkpoints, the stop agreement and one-line errors.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Callable, Dict, Iterator, List, Mapping, NoReturn, Optional, Sequence, Tuple, TypeVar

import torch

from ..backends import Backend, GradientExchange, create_backend
from ..backends.fsdp import (
    gather_for_evaluation,
    is_sharded,
    load_whole_state,
    shard_again,
    shard_blocks,
    whole,
    whole_state_dict,
)
from ..backends.sync_batchnorm import synchronize_batchnorm
from ..errors import UserError
from ..launch import detect_launch, report_error
from ..launch.env_vars import RankOutsideWorld
from ..launch.malloc_tuning import tune_malloc
from ..launch.rendezvous import tell_the_job
from ..random_state import rng_state, seed_everything, set_rng_state
from ..runtime.timeout import check_timeout
from .compiled import keys_as_in, uncompiled, without_compiled_keys
from .files import BackgroundWriter, host_copy, read_file, save_all, state_mismatch, unloadable_value
from .loaders import EvalLoader, TrainLoader, dataset_size, per_rank_batch_size
from .model_checks import check_freezing_spelled_right, check_optimizers, check_something_to_train, parameters_of
from .process_end import current, excepthook, exit_process
from .process_setup import keep_output_printable, set_threads, use_deterministic_kernels
from .same_model import CHECK_EVERY, SameModelCheck
from .sharded_checkpoint import (
    SHARDED,
    Part,
    holds_dtensors,
    is_sharded_checkpoint,
    load_sharded,
    model_stepped_by,
    read_rest,
    save_sharded,
)
from .signature import same_on_every_rank
from .stop import FOR_WORKERS, StopSignal, Watchdog
from .trainable import TrainableSincePrepare, average_gradients

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
T = TypeVar("T")
RNG_KEY = "rng"  # every rank's RNG state, in rank order, in each file job.save writes


def init(
    backend: str = "auto",
    *,
    timeout: float = 300.0,
    dist_backend: str = "auto",
    threads: int = 0,
    malloc_tuning: str = "auto",
    deterministic: bool = False,
    check_every: int = CHECK_EVERY,
) -> "Job":
    """Join the job this process was launched into and return its :class:`Job`.

    ``backend``: auto (by launcher), torch, horovod or local. ``timeout``: seconds a
    rank waits for the others (rendezvous, collectives, the watchdog) before the
    job fails with one line instead of hanging. ``dist_backend``: auto, nccl or
    gloo (torch backend). ``threads``: intra-op threads per rank (0: the cores
    shared among local ranks). ``malloc_tuning``: auto or off (glibc heap settings).
    ``deterministic``: on GPUs, only kernels that give the same bits every run, so that
    two runs, or a run and its resume, agree bitwise (CPU kernels already do); some
    GPU kernels are slower so. ``check_every``: every this many :meth:`Job.step` calls
    the ranks check that they hold bitwise the same prepared models, as they also do at
    each :meth:`Job.save` and each pass of an :meth:`Job.eval_loader` (0: only there);
    a difference is one line naming the tensor, the ranks and the step.
    """
    sys.excepthook = excepthook  # from here on, bad input is one line
    keep_output_printable()  # and a path that is not UTF-8 is printed, not a UnicodeEncodeError
    if current.job is not None:
        raise UserError(
            "tb.init() was already called in this process; use the job it returned "
            "(or call job.shutdown() before joining again)"
        )
    try:
        env = detect_launch()
    except RankOutsideWorld as exc:
        tell_the_job(str(exc))  # the job's ranks wait for a process that will never join: they stop now too
        raise
    timeout = check_timeout(timeout)  # a string, NaN or infinity too: one line, not a wait that never ends
    SameModelCheck.check_every_valid(check_every)
    threads = set_threads(threads, env)
    if deterministic:
        use_deterministic_kernels()
    # Before the data and the model exist, so that every buffer comes from the tuned heap.
    tuned, why = tune_malloc(malloc_tuning, os.environ)
    chosen = create_backend(backend, env, dist_backend=dist_backend, timeout=timeout)
    # Joining waits on other processes and on the network: bounded like every other wait.
    watchdog = Watchdog(timeout, env.rank)
    watchdog.expect(
        f"start of the job under {env.launcher} (world size {env.world_size}; check that every rank "
        f"was started and that MASTER_PORT is not held by another program)",
        timeout + 5.0,
    )
    chosen.init()
    watchdog.disarm()  # joined; from here on the job's calls arm it, each for its own wait
    # Again: torch's init_process_group wraps the hook with one that captures stderr.
    sys.excepthook = excepthook
    job = current.job = Job(chosen, watchdog, check_every)
    job.print(f"[trainbridge] threads per rank: {threads}; malloc {'tuned' if tuned else 'left as is'}: {why}")
    return job


class Job:
    """This process's place in the job, and the operations a training loop needs.

    ``job.scaler``: the ``torch.amp.GradScaler`` of ``prepare(amp="fp16")``, else
    None (:meth:`save` and :meth:`load` keep its loss scale for you).
    """

    def __init__(self, backend: Backend, watchdog: Optional[Watchdog] = None, check_every: int = CHECK_EVERY) -> None:
        self.backend = backend
        self.amp = "off"
        self.scaler: Optional[torch.amp.GradScaler] = None
        self.watchdog = watchdog or Watchdog(backend.timeout, backend.rank)
        self._stop = StopSignal(backend.allreduce_async)  # installs the SIGTERM (SIGINT, SIGHUP) handler now
        self._writer = BackgroundWriter()
        # Each prepared model, as prepare returned it, with the optimizers prepared with it.
        self._prepared: List[Tuple[torch.nn.Module, Tuple[torch.optim.Optimizer, ...]]] = []
        self._steps = 0  # job.step calls in this process, for the watchdog's line
        self._same_model = SameModelCheck(backend, check_every)
        self._trainable: List[TrainableSincePrepare] = []  # per prepared model, what prepare averaged
        self._sharded: List[torch.nn.Module] = []  # the user's modules prepared with shard
        self._accumulating: List[torch.nn.Module] = []  # models inside job.no_sync now
        self._seed_per_rank_at_prepare: Optional[int] = None  # set_seed's seed, until the next prepare
        self._ended = False  # shutdown() has left the job

    def _waiting(self, call: str):
        """Bound a wait for the other ranks by the timeout; the watchdog's line names ``call`` and the step."""
        self._check_in_job(call)
        return self.watchdog.waiting(f"{call} at this process's step {self._steps}")

    def _check_in_job(self, call: str) -> None:
        # Every call that needs the other ranks comes here first: after shutdown() there are none.
        if self._ended:
            raise UserError(
                f"{call} after job.shutdown() (or job.exit()): this process has left the job; make that the "
                f"last call, or call tb.init() again to join a new job"
            )

    # ----- where this process is ------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank in the job, 0 to ``world_size - 1``."""
        return self.backend.rank

    @property
    def world_size(self) -> int:
        """Number of ranks (processes) in the job."""
        return self.backend.world_size

    @property
    def local_rank(self) -> int:
        """This process's rank among the ranks on its host (its GPU index when there are GPUs)."""
        return self.backend.local_rank

    @property
    def device(self) -> torch.device:
        """Where this rank computes: ``cuda:<local_rank>`` when CUDA is available, else the CPU."""
        return self.backend.device

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that writes checkpoints and prints."""
        return self.backend.is_main

    @property
    def backend_name(self) -> str:
        """The collective library averaging gradients: torch (DDP), horovod or local (one process)."""
        return self.backend.name

    @property
    def launcher(self) -> str:
        """What started this process: torchrun, spawn (``tb.spawn``), horovodrun, mpirun, srun, env or python."""
        return self.backend.env.launcher

    def print(self, *args: Any, **kwargs: Any) -> None:
        """print() on the main rank only."""
        self.backend.print(*args, **kwargs)

    # ----- model and optimizer --------------------------------------------------
    def prepare(
        self,
        model: torch.nn.Module,
        *optimizers: Optional[torch.optim.Optimizer],
        amp: str = "off",
        compression: str = "none",
        shm_allreduce: str = "auto",
        find_unused_parameters: bool = False,
        sync_batchnorm: bool = False,
        shard: Any = False,
        cpu_offload: bool = False,
    ):
        """``(model, optimizer)`` on this rank's device, its gradients averaged over the ranks; ``(model, None)``
        without an optimizer, ``(model, opt1, opt2, ...)`` with several.

        Every rank leaves with rank 0's weights. After each backward pass that
        reaches the model (outside :meth:`no_sync`), its gradients are the average
        over the ranks on every backend, so clipping or inspecting them before
        :meth:`step` sees what the step applies. Call it once per model (a GAN's
        generator and discriminator each with its optimizer); the returned model
        keeps the module's attributes, methods and state_dict keys. Build a
        scheduler after this call (schedulers patch ``optimizer.step``).

        Several optimizers of one model (``SparseAdam`` for ``nn.Embedding(sparse=True)``
        tables beside ``Adam`` for the rest) go to one call, each checked to be the same
        on every rank and given rank 0's state; each parameter belongs to one of them.
        Sparse gradients are averaged as sparse tensors on every backend, so they stay sparse.

        ``amp``: off, bf16 or fp16 (fp16 adds a GradScaler, used by :meth:`backward`,
        :meth:`clip_grad_norm_` and :meth:`step`), the same for every model.
        ``compression``: none, fp16 or bf16, the dtype gradients are averaged in.
        ``shm_allreduce``: auto, on or off: ranks on one CPU host average through
        shared memory instead of gloo (torch backend). ``find_unused_parameters``:
        allow backward passes that reach only some of the model's parameters (a
        branch some ranks take); those no rank used keep their gradient.

        ``sync_batchnorm``: every BatchNorm layer normalises a training batch with the
        statistics of the whole global batch, the same at any world size (two small
        allreduces per layer per forward and per backward). Without it, BatchNorm takes
        each rank's own share of the batch (the model depends on the world size) and each
        rank keeps its own running statistics (rank 0's are saved). A ``SyncBatchNorm``
        already in the model (torch's, Horovod's) is synchronized on every backend either way.

        ``shard=True``: each rank keeps 1/N of the parameters, gradients and optimizer state
        (FSDP2, torch backend only), gathering one block at a time for the forward and backward
        passes: the model's repeated blocks (a transformer's layers, a ResNet's blocks), or the
        module classes given as ``shard=[MyBlock]``. The loop stays the same; :meth:`save` then
        writes a folder of shards that loads at any world size (see :meth:`export` for one
        file). ``cpu_offload`` (with ``shard``): the shards live in host memory between uses.
        """
        exchange = GradientExchange(
            compression=compression,
            shm_allreduce=shm_allreduce,
            find_unused_parameters=find_unused_parameters,
            waiting=self._waiting,
        )
        if any(self.unwrap(model) is self.unwrap(prepared) for prepared, _ in self._prepared):
            raise UserError(
                "job.prepare: this model was already prepared; prepare each model once and keep using "
                "the model it returned",
                quiet=not self.is_main,
            )
        check_freezing_spelled_right(uncompiled(model))
        check_something_to_train(uncompiled(model), quiet=not self.is_main)  # the same model on every rank
        given = check_optimizers(uncompiled(model), optimizers, [o for _, held in self._prepared for o in held])
        with self._waiting("job.prepare"):
            model = self._prepare(model, optimizers, amp, exchange, sync_batchnorm, shard, cpu_offload)
        # A sharded model's gradients are all averaged by FSDP, whichever require them now: none are left out.
        sharded = shard_blocks(shard) is not None
        self._trainable.append(TrainableSincePrepare(self.unwrap(model), find_unused_parameters or sharded))
        if sharded:
            self._sharded.append(self.unwrap(model))
        if self._seed_per_rank_at_prepare is not None:  # see set_seed
            seed_everything(self._seed_per_rank_at_prepare + self.rank)
            self._seed_per_rank_at_prepare = None
        self._prepared.append((model, tuple(given)))
        return (model, *optimizers) if len(optimizers) > 1 else (model, optimizers[0] if optimizers else None)

    def _prepare(
        self,
        model: torch.nn.Module,
        optimizers: Sequence[Optional[torch.optim.Optimizer]],
        amp: str,
        exchange: GradientExchange,
        sync_batchnorm: bool = False,
        shard: Any = False,
        cpu_offload: bool = False,
    ):
        self.backend.check_same_on_every_rank(
            "the model's parameters",
            {n: tuple(p.shape) for n, p in uncompiled(model).named_parameters()},
            "build the same model on every rank",
        )
        for n, optimizer in enumerate(optimizers, start=1):
            if optimizer is None:
                continue
            self.backend.check_same_on_every_rank(
                "the optimizer" if len(optimizers) == 1 else f"optimizer {n}",
                {
                    "type": type(optimizer).__name__,
                    "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
                },
                "give every rank the same optimizer and learning rate (scale it by the world size on every rank, "
                "not by the rank)",
            )
        self.backend.check_same_on_every_rank(
            "job.prepare's options",
            {
                "amp": amp,
                "compression": exchange.compression,
                "shm_allreduce": exchange.shm_allreduce,
                "find_unused_parameters": exchange.find_unused_parameters,
                "sync_batchnorm": sync_batchnorm,
                "shard": repr(shard),
                "cpu_offload": cpu_offload,
            },
            "pass the same amp, compression, shm_allreduce, find_unused_parameters, sync_batchnorm, shard and "
            "cpu_offload to job.prepare on every rank",
        )
        if amp not in ("off", *AMP_DTYPES):
            raise UserError(f"amp {amp!r} is not supported; use off, bf16 or fp16")
        if amp == "bf16" and self.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise UserError("amp bf16 needs a GPU with bfloat16 support (Ampere or newer); use fp16 here")
        if self._prepared and amp != self.amp:
            raise UserError(
                f"job.prepare: amp {amp!r} differs from the {self.amp!r} of the model prepared before; "
                f"one job trains in one precision, so pass amp={self.amp!r} to every prepare"
            )
        self.amp = amp
        # fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none.
        if amp == "fp16" and self.scaler is None:
            self.scaler = torch.amp.GradScaler(self.device.type)
        # Before the backend wraps the model (DDP registers the modules it is given): BatchNorm layers that
        # sum their statistics over the ranks, all of them with sync_batchnorm, else those meant to.
        model = synchronize_batchnorm(model, self.backend.sum_over_ranks, every_batchnorm=sync_batchnorm)
        given = [o for o in optimizers if o is not None]
        blocks = shard_blocks(shard)
        if blocks is None:
            if cpu_offload:
                raise UserError("job.prepare: cpu_offload=True offloads shards; pass it with shard=True")
            return self.backend.wrap(model.to(self.device), given, exchange)
        if amp == "fp16":
            raise UserError(
                "job.prepare: amp='fp16' with shard is not supported (its loss scaling needs whole gradients); "
                "use amp='bf16', which needs no loss scaling"
            )
        return self.backend.shard(model.to(self.device), given, blocks, exchange, AMP_DTYPES.get(amp), cpu_offload)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The user's module, without the DDP wrapper and ``torch.compile``'s, before or after :meth:`prepare`.

        Its state_dict keys have neither "module." nor "_orig_mod.".
        """
        return uncompiled(self.backend.unwrap(uncompiled(model)))

    def _as_prepared(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model :meth:`prepare` returned for ``model`` (compiled after it, or not), else ``model``."""
        user_module = self.unwrap(model)
        return next((prepared for prepared, _ in self._prepared if self.unwrap(prepared) is user_module), model)

    def autocast(self):
        """Mixed precision per ``prepare(amp=...)``; a no-op when amp is off."""
        if self.amp == "off":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=AMP_DTYPES[self.amp])

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module, enabled: bool = True) -> Iterator[None]:
        """Forward and backward passes in this block only accumulate gradients locally (gradient accumulation).

        The first K-1 micro-batches of a step go here, forward and backward; the
        last one, outside, averages the sum over ranks: one allreduce per step.
        """
        if not enabled:
            yield
            return
        user_module = self.unwrap(model)
        self._accumulating.append(user_module)
        try:
            # The backend knows the model as prepare returned it, not a torch.compile wrapper around it.
            with self.backend.no_sync(self._as_prepared(model)):
                yield
        finally:
            self._accumulating.remove(user_module)

    def backward(self, loss: torch.Tensor, **backward_options: Any) -> None:
        """``loss.backward()``, scaled first when amp is fp16; prepared models' gradients are averaged on return.

        ``backward_options`` go to ``Tensor.backward`` (``retain_graph=True``, ...).
        """
        for trainable in self._trainable:
            trainable.refuse_frozen_since()
        with self._waiting("job.backward (the gradient average)"):
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward(**backward_options)
            # Parameters unfrozen after prepare are outside the backend's averaging (see api/trainable.py).
            unfrozen = [
                p
                for trainable in self._trainable
                if not any(trainable.model is m for m in [*self._accumulating, *self._sharded])
                for p in trainable.unfrozen_since()
            ]
            if unfrozen:
                average_gradients(unfrozen, lambda flat: self.backend.allreduce(flat, "mean"))

    def clip_grad_norm_(self, model_or_parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the (averaged) gradients to ``max_norm``; the total norm before clipping, the same on every rank.

        ``torch.nn.utils.clip_grad_norm_`` after :meth:`backward`, with fp16 amp's
        loss scale taken out first (``GradScaler.unscale_`` of the optimizers
        that hold these parameters).
        """
        params = list(
            model_or_parameters.parameters()
            if isinstance(model_or_parameters, torch.nn.Module)
            else model_or_parameters
        )
        if any(p.grad is not None and p.grad.is_sparse for p in params):
            raise UserError(
                "job.clip_grad_norm_: some of these parameters have sparse gradients (nn.Embedding(sparse=True)), "
                "which torch's clip_grad_norm_ cannot measure; clip the other parameters only "
                "(job.clip_grad_norm_(model.head.parameters(), max_norm))",
                quiet=not self.is_main,
            )
        if self.scaler is not None:
            ids = {id(p) for p in params}
            holding = {id(o): o for _, held in self._prepared for o in held}  # once each, also if in two prepares
            for optimizer in holding.values():
                if any(id(p) in ids for p in parameters_of(optimizer)):
                    self.scaler.unscale_(optimizer)
        # Over a sharded model's gradients torch gives the norm as a DTensor: the full value is the global norm.
        return whole(torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type))

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()`` (with fp16 amp: unscaled, skipped on inf/NaN)."""
        with self._waiting("job.step"):
            self.backend.step(optimizer, self.scaler)
        self._steps += 1
        if self._same_model.due(self._steps):
            self._check_same_model(f"after step {self._steps}", call="job.step")

    def _check_same_model(self, when: str, call: str, saved: Optional[Mapping[str, Any]] = None) -> None:
        """The ranks' prepared models (and the modules in ``saved``) are bitwise alike, or one line (same_model.py)."""
        modules: Dict[str, torch.nn.Module] = {}
        named = {id(self.unwrap(v)): k for k, v in (saved or {}).items() if isinstance(v, torch.nn.Module)}
        for n, trainable in enumerate(self._trainable):
            kind = type(trainable.model).__name__
            label = f"prepared model {n + 1} ({kind})" if len(self._trainable) > 1 else f"the prepared {kind}"
            modules[f"job.save's {named[id(trainable.model)]!r}" if id(trainable.model) in named else label] = (
                trainable.model
            )
        prepared = {id(t.model) for t in self._trainable}
        for key, value in (saved or {}).items():
            if isinstance(value, torch.nn.Module) and id(self.unwrap(value)) not in prepared:
                modules[f"job.save's {key!r}"] = self.unwrap(value)
        with self._waiting(f"{call} (the check that the ranks hold the same model)"):
            self._same_model.check(modules, when)

    def set_seed(self, seed: int, per_rank: bool = True) -> None:
        """Seed torch (CPU and CUDA), Python's ``random`` and numpy from ``seed``: ``seed + rank`` when ``per_rank``.

        Called before :meth:`prepare`, every rank draws from ``seed`` until the next
        :meth:`prepare`, which then seeds each rank with ``seed + rank``: the model, its
        copies (an EMA model) and anything else built before it are the same on every
        rank, as in one process, while dropout masks and noise drawn in training differ
        between ranks, as they must (the ranks train different samples). Called after a
        :meth:`prepare`, it seeds ``seed + rank`` at once. ``per_rank=False`` gives every
        rank the same streams throughout. :meth:`save` carries these streams and
        :meth:`load` puts them back, so a resumed run draws the same numbers.
        """
        if per_rank and self._trainable:
            seed_everything(seed + self.rank)
            return
        # Until the next prepare, every rank draws the same numbers: the models, copies (an EMA)
        # and data built before it are the same as in one process. From prepare on, per rank.
        seed_everything(seed)
        self._seed_per_rank_at_prepare = seed if per_rank else None

    # ----- data -----------------------------------------------------------------
    def train_loader(
        self,
        dataset,
        batch_size: Optional[int] = None,
        seed: int = 0,
        *,
        global_batch_size: Optional[int] = None,
        **dataloader_options: Any,
    ) -> TrainLoader:
        """This rank's shuffled shard of a map-style ``dataset``, in batches on ``job.device``.

        Give exactly one of ``global_batch_size``, the samples of one step over all
        ranks (each rank takes ``global_batch_size / world_size``: a script that names
        its global batch trains the same model at any world size), and ``batch_size``,
        this rank's (the global batch is then ``batch_size * world_size``, so it grows
        with the world size). Each sample's random transforms in ``__getitem__`` draw
        from its own seed, from (``seed``, epoch, sample index): the same at any world
        size and worker count. ``dataloader_options`` go to
        ``torch.utils.data.DataLoader`` (num_workers, collate_fn, ...).
        """
        # Before any rank checks the arguments: a rank whose own check failed would leave the others waiting.
        with self._waiting("job.train_loader"):
            self.backend.check_same_on_every_rank(
                "train_loader",
                {
                    "dataset size": dataset_size(dataset, "train_loader"),
                    "seed": seed,
                    "batch_size": batch_size,
                    "global_batch_size": global_batch_size,
                },
                "every rank must hold the same dataset (seed a random_split with generator=torch.Generator()."
                "manual_seed(...)) and pass the same seed and batch size",
            )
        try:
            return TrainLoader(
                dataset,
                per_rank_batch_size(batch_size, global_batch_size, self.world_size),
                rank=self.rank,
                world_size=self.world_size,
                device=self.device,
                seed=seed,
                before_fork=self._before_fork,
                worker_wait=self._waiting_for_workers,
                **dataloader_options,
            )
        except UserError as error:  # every rank checked the same arguments: rank 0 alone says what is wrong
            raise UserError(str(error), quiet=not self.is_main) from None

    def eval_loader(self, dataset, batch_size: int, **dataloader_options: Any) -> EvalLoader:
        """This rank's unpadded evaluation shard: sum metrics, :meth:`allreduce` the sums, divide."""
        with self._waiting("job.eval_loader"):
            self.backend.check_same_on_every_rank(
                "eval_loader",
                {"dataset size": dataset_size(dataset, "eval_loader")},
                "every rank must hold the same evaluation set (seed a random_split with generator=...)",
            )
        return EvalLoader(
            dataset,
            batch_size,
            rank=self.rank,
            world_size=self.world_size,
            device=self.device,
            before_fork=self._before_fork,
            worker_wait=self._waiting_for_workers,
            before_pass=self._before_evaluation,
            **dataloader_options,
        )

    def _before_evaluation(self) -> None:
        """At the start of an exact evaluation pass (collective): the same-model check, and the sharded
        models gathered whole on every rank, whose uneven shares of the set run uneven forward passes."""
        self._check_same_model(f"at an evaluation, step {self._steps}", call="the eval_loader's pass")
        with self._waiting("the eval_loader's pass (gathering the sharded models)"):
            for model in self._sharded:
                gather_for_evaluation(model)

    def _waiting_for_workers(self, what: str):
        # A worker stuck in a read, or in a lock it inherited at fork, would hold this rank for ever.
        return self.watchdog.waiting(f"{what} at this process's step {self._steps}", FOR_WORKERS)

    def _before_fork(self) -> None:
        # A process forked while the checkpoint writer thread runs can inherit a lock that
        # thread held and wait on it for ever (seen: a DataLoader worker blocked in a futex
        # right after fork, keeping the job's output open). So loaders fork only between writes.
        self._writer.wait()

    # ----- collectives ----------------------------------------------------------
    def allreduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """``tensor`` reduced over ranks with op "sum", "mean" or "max"; a new tensor."""
        if op not in ("sum", "mean", "max"):
            raise UserError(f"allreduce op {op!r} is not supported; use sum, mean or max")
        with self._waiting("job.allreduce"):
            # A dtype or shape that differs between ranks gives garbage or aborts inside gloo: say so first.
            # One small allreduce of a digest; only a mismatch gathers the values to name them.
            signature = {"dtype": str(tensor.dtype), "shape": tuple(tensor.shape)}
            if self.world_size > 1 and not same_on_every_rank(self.backend, signature, "job.allreduce.signature"):
                self.backend.check_same_on_every_rank(
                    "job.allreduce's tensor", signature, "reduce a tensor of the same dtype and shape on every rank"
                )
            return self.backend.allreduce(tensor, op)

    def allgather(self, tensor: torch.Tensor) -> List[torch.Tensor]:
        """Every rank's tensor (shapes may differ), in rank order, on this rank's device."""
        with self._waiting("job.allgather"):
            return [t.to(tensor.device) for t in self.backend.allgather_object(tensor.detach().cpu())]

    def allgather_object(self, obj: Any) -> List[Any]:
        """Every rank's picklable ``obj``, in rank order."""
        with self._waiting("job.allgather_object"):
            return self.backend.allgather_object(obj)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s picklable ``obj`` on every rank."""
        with self._waiting("job.broadcast"):
            return self.backend.broadcast_object(obj, src)

    def barrier(self) -> None:
        """Wait until every rank has reached this call."""
        with self._waiting("job.barrier"):
            self.backend.barrier()

    def sync_buffers(self, model: torch.nn.Module) -> None:
        """Give every rank rank 0's buffers (BatchNorm running statistics) before evaluating or saving.

        Each rank updates its buffers from its own batches, so after training they differ.
        """
        with self._waiting("job.sync_buffers"):
            self.backend.sync_buffers(self.unwrap(model))

    @contextlib.contextmanager
    def main_first(self) -> Iterator[None]:
        """Run the block on the main rank first (e.g. a download), then on the others."""
        with self.backend.main_first():
            yield

    # ----- stopping together ----------------------------------------------------
    def should_stop(self) -> bool:
        """Call once per step on every rank: True on all of them at the same step once any got SIGTERM
        (or SIGINT or SIGHUP, where those have their default action: Ctrl-C, a closed terminal).

        The answer is one step late (the agreement runs in the background), so a
        preempted loop saves a checkpoint and leaves at most one step after the signal.
        """
        with self._waiting("job.should_stop (the stop agreement)"):
            return self._stop.agreed()

    @property
    def stop_signal(self) -> str:
        """The signal this rank received first ("SIGTERM", "SIGINT" or "SIGHUP"), for the stop line; "SIGTERM"
        on a rank that got none (a peer's signal stopped it)."""
        return self._stop.name

    def drain_stop(self) -> bool:
        """Finish the agreement in flight (before a collective of another kind, e.g. evaluation)."""
        with self._waiting("job.drain_stop (the stop agreement)"):
            return self._stop.drain()

    def heartbeat(self) -> None:
        """Nothing to do: the watchdog bounds waits for the other ranks, never this rank's own work.

        Kept so that loops written for trainbridge 0.x, which had to call it during
        long phases, still run.
        """

    # ----- in-job recovery (Horovod elastic) -------------------------------------
    def run_resilient(self, train_fn: Callable[[], T], state: Any) -> T:
        """Run ``train_fn()``; under ``horovodrun --min-np/--max-np`` re-run it after a worker failure.

        ``state`` has ``snapshot()`` and ``restore(snapshot)``; ``train_fn`` must
        continue from ``state`` and read rank and world size afresh on every call.
        """

        def attempt() -> T:
            self._stop.abandon()  # an agreement started in a world that has since changed
            return train_fn()

        return self.backend.run_resilient(attempt, state)

    def commit(self, state: Any) -> None:
        """Mark ``state`` as the point to roll back to after a failure (elastic only; else a no-op)."""
        with self._waiting("job.commit"):
            self.backend.commit(state)

    def decide_on_main(self, decide: Callable[[], T]) -> T:
        """Run ``decide()`` on the main rank and give its result to every rank."""
        with self._waiting("job.decide_on_main"):
            return self.backend.decide_on_main(decide)

    # ----- checkpoints ----------------------------------------------------------
    def save(
        self,
        obj: Mapping[str, Any],
        path: str,
        keep_previous: Optional[str] = None,
        background: bool = False,
        copies: Sequence[str] = (),
    ) -> None:
        """Write ``obj`` to ``path``: every rank calls it, the main rank writes atomically.

        Values with a ``state_dict()`` (models, wrapped or not, optimizers,
        schedulers, GradScalers, train loaders) are saved as their state; others
        as they are. Every rank's RNG state is added, so :meth:`load` continues
        dropout and augmentation exactly. Tensors are written in host memory, so
        the file loads on a machine without a GPU; :meth:`load` puts them back on
        the job's device. ``keep_previous``: first move the file being replaced
        there. ``copies``: also write the same state to these paths.

        ``background=True``: the main rank copies the state to host memory and
        writes it on a thread while training goes on. The next save, :meth:`load`,
        :meth:`wait_for_saves` and :meth:`shutdown` wait for it; a failed
        background write raises there, as one line.
        """
        self._check_in_job(f"job.save({path!r})")
        if not isinstance(obj, Mapping):
            raise UserError(
                f"job.save takes a dict of what to save, got a {type(obj).__name__}; "
                f"write job.save({{'model': model, ...}}, path)",
                quiet=not self.is_main,
            )
        if RNG_KEY in obj:
            raise UserError(
                f"job.save: the key {RNG_KEY!r} is where every rank's random streams are saved; "
                f"store yours under another name",
                quiet=not self.is_main,
            )
        # Before anything is written; a wait here is the save's (a rank-0-only save reads as such).
        self._check_same_model(f"at job.save({path!r}), step {self._steps}", call=f"job.save({path!r})", saved=obj)
        parts = self._sharded_parts(obj)  # a sharded model and its optimizers: each rank writes its shards
        state = {key: self._state_of(value) for key, value in obj.items() if key not in parts}
        if holds_dtensors(state):
            raise UserError(
                f"job.save: {next(k for k in state if holds_dtensors(state[k]))!r} holds sharded tensors (DTensor), of "
                f"which this rank has only its own part; save the model itself ({{'model': model}}) and its "
                f"optimizer, which job.save writes as a folder of every rank's shards",
                quiet=not self.is_main,
            )
        problem = unloadable_value(state)
        if problem is not None:
            raise UserError(
                f"job.save: {problem}, which torch.load(weights_only=True) cannot read back, so {path} "
                f"could never be loaded; save a plain value instead (float(x), str(path), vars(args), "
                f"tuple(named_tuple), a dict) or allow the type with torch.serialization.add_safe_globals",
                quiet=not self.is_main,
            )
        if self.scaler is not None and "scaler" not in state:
            state["scaler"] = self.scaler.state_dict()
        with self._waiting(f"job.save({path!r})"):
            rngs = self.backend.allgather_object(rng_state())  # collective: before the main-rank-only write
        state[RNG_KEY] = {"world_size": self.world_size, **{kind: [r[kind] for r in rngs] for kind in rngs[0]}}
        if parts:  # written before the call returns (background or not), each rank its own shards
            if self.is_main:
                self._writer.wait()  # writes land in order
            with self._waiting(f"job.save({path!r})"):
                save_sharded(
                    parts,
                    host_copy(state, copy=False),
                    path,
                    self.is_main,
                    self.backend.broadcast_object,
                    self.backend.barrier,
                    keep_previous=keep_previous,
                    copies=copies,
                )
            return
        paths = [path, *copies]
        if self.is_main and background:
            self._writer.submit(state, paths, keep_previous=keep_previous)
            return
        if self.is_main:
            self._writer.wait()  # writes land in order
            # GPU tensors are written as host tensors, as a background save writes them: the file is the
            # same either way, and a machine without a GPU reads it without map_location.
            save_all(host_copy(state, copy=False), paths, keep_previous=keep_previous)
        if not background:
            with self._waiting(f"job.save({path!r})"):
                self.backend.barrier()  # the file is complete before any rank may read it

    def wait_for_saves(self) -> None:
        """Every rank calls it: the main rank's background write is on disk before anyone goes on."""
        if self.is_main:
            self._writer.wait()
        with self._waiting("job.wait_for_saves"):
            self.backend.barrier()

    def _sharded_parts(self, obj: Mapping[str, Any]) -> Dict[str, Part]:
        """The entries of ``obj`` that a sharded save writes as shards: sharded models, and their optimizers."""
        models = {
            key: self.unwrap(value)
            for key, value in obj.items()
            if isinstance(value, torch.nn.Module)
            and (any(self.unwrap(value) is m for m in self._sharded) or is_sharded(self.unwrap(value)))
        }
        for model in models.values():
            shard_again(model)  # an evaluation may have left it gathered
        parts: Dict[str, Part] = {key: (model, None) for key, model in models.items()}
        for key, value in obj.items():
            if not isinstance(value, torch.optim.Optimizer):
                continue
            owner = model_stepped_by(parameters_of(value), models.values())
            if owner is None and holds_dtensors(parameters_of(value)):
                raise UserError(
                    f"job.save: the optimizer {key!r} steps a sharded model that is not in the state; save the model "
                    f"with it (job.save({{'model': model, {key!r}: ...}}, path))",
                    quiet=not self.is_main,
                )
            if owner is not None:
                parts[key] = (owner, value)
        return parts

    def state_dict(self, model: torch.nn.Module) -> Dict[str, torch.Tensor]:
        """The whole ``model.state_dict()``, with the user's keys, on every rank.

        A sharded model's parameters are gathered from every rank (collective: every rank
        calls it, and each then holds the whole model); any other model's state_dict as it is.
        """
        module = self.unwrap(model)
        shard_again(module)  # an evaluation may have left it gathered
        if not is_sharded(module):
            return dict(without_compiled_keys(module.state_dict()))
        with self._waiting("job.state_dict (gathering the shards)"):
            return whole_state_dict(module)

    def export(self, model: torch.nn.Module, path: str) -> None:
        """Write the whole model's ``state_dict`` to ``path`` as one plain file, for inference:
        ``model.load_state_dict(torch.load(path))`` into the unsharded model. Every rank calls it;
        a sharded model is gathered on the main rank alone, which writes the file atomically.

        A sharded checkpoint already on disk exports without a job: ``trainbridge export CHECKPOINT OUTPUT``.
        """
        self._check_in_job(f"job.export({path!r})")
        module = self.unwrap(model)
        shard_again(module)  # an evaluation may have left it gathered
        with self._waiting(f"job.export({path!r})"):
            state = whole_state_dict(module, main_rank_only=True) if is_sharded(module) else module.state_dict()
            if self.is_main:
                self._writer.wait()
                save_all(host_copy(dict(without_compiled_keys(state))), [path])
            self.backend.barrier()  # the file is complete before any rank may read it

    def _state_of(self, value: Any) -> Any:
        if isinstance(value, torch.nn.Module):
            return without_compiled_keys(self.unwrap(value).state_dict())
        return value.state_dict() if hasattr(value, "state_dict") else value

    def load(self, path: str, into: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """Read ``path`` on every rank (``torch.load(weights_only=True)``); with ``into``, :meth:`restore` it.

        Without ``into``: the saved dict. A folder written by a sharded :meth:`save` loads
        only ``into`` a state (each rank reads the parts its own shards cover, at any world
        size, sharded or not).
        """
        self.wait_for_saves()  # a background write of this file may be in flight
        if is_sharded_checkpoint(path):
            return self._load_sharded(path, into)
        state = read_file(path, self.device)
        return state if into is None else self.restore(state, into, path)

    def _load_sharded(self, path: str, into: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        if into is None:
            raise UserError(
                f"job.load({path!r}): a sharded checkpoint (a folder of every rank's shards) loads into the state it "
                f"was saved from: job.load(path, into={{'model': model, ...}}); for one plain file of the model, "
                f"run trainbridge export {path} model.pt",
                quiet=not self.is_main,
            )
        rest = read_rest(path, self.device)
        kinds = rest.get(SHARDED, {})
        models = {
            key: self.unwrap(value)
            for key, value in into.items()
            if isinstance(value, torch.nn.Module) and kinds.get(key) == "model"
        }
        for model in models.values():
            shard_again(model)  # an evaluation may have left it gathered
        parts: Dict[str, Part] = {key: (model, None) for key, model in models.items()}
        for key, value in into.items():
            if isinstance(value, torch.optim.Optimizer) and key in kinds and kinds[key] != "model":
                owner = model_stepped_by(parameters_of(value), models.values())
                if owner is None:
                    raise UserError(
                        f"job.load({path!r}): the optimizer {key!r} is loaded with the model it steps; put that model "
                        f"in into= too, under the key it was saved with",
                        quiet=not self.is_main,
                    )
                parts[key] = (owner, value)
        with self._waiting(f"job.load({path!r})"):
            load_sharded(path, rest, parts, self.is_main)
        remaining = {key: value for key, value in into.items() if key not in parts}
        self.restore(rest, remaining, path)  # plain values, loaders, schedulers, random streams
        into.update(remaining)
        return into

    def restore(self, saved: Mapping[str, Any], into: Dict[str, Any], source: str = "the checkpoint") -> Dict[str, Any]:
        """Put what :meth:`save` wrote (``saved``, already read) back into ``into``, the dict given to :meth:`save`.

        Objects are restored in place with ``load_state_dict``, plain values
        replaced, the fp16 loss scale and this rank's random streams (torch, CUDA,
        Python, numpy) put back; returns ``into``.
        """
        for key, value in into.items():
            if key not in saved:
                raise UserError(
                    f"{source} has no {key!r}; it holds {', '.join(k for k in saved if k != RNG_KEY)}; "
                    f"load it into the same keys it was saved with"
                )
            if isinstance(value, torch.nn.Module):
                state = keys_as_in(saved[key], self.unwrap(value))  # saved from a compiled model or not
                mismatch = state_mismatch(self.unwrap(value), state)
                if mismatch:
                    raise UserError(
                        f"{source}'s {key!r} is for another model: {mismatch}; load it into the model "
                        f"it was saved from",
                        quiet=not self.is_main,
                    )
                load_whole_state(self.unwrap(value), state)  # a sharded model takes its own shards of it
            elif hasattr(value, "load_state_dict"):
                value.load_state_dict(saved[key])
            else:
                into[key] = saved[key]
        if self.scaler is not None and saved.get("scaler") and "scaler" not in into:
            self.scaler.load_state_dict(saved["scaler"])
        rng = saved.get(RNG_KEY)
        if rng and len(rng["torch"]) == self.world_size:
            set_rng_state({kind: rng[kind][self.rank] for kind in rng if kind != "world_size"})
        elif rng:
            self.print(
                f"[trainbridge] {source} was written by {len(rng['torch'])} ranks, this job has "
                f"{self.world_size}: the random streams start afresh (seeded per rank)"
            )
            seed_everything(torch.initial_seed() + self.rank)
        else:  # written by hand, or by torch.save: resuming works, but not bitwise
            self.print(
                f"[trainbridge] {source} holds no random streams ({RNG_KEY!r}, which job.save adds): they go on "
                f"from this process's seeds, so dropout and augmentation draw other numbers than the run that "
                f"wrote it would have"
            )
        return into

    # ----- the end --------------------------------------------------------------
    def shutdown(self, clean: bool = True) -> None:
        """Leave the job. ``clean=False`` after a failure, before this process exits: wait for no other rank.
        Calling it again does nothing; any other call that needs the ranks is then one line."""
        if self._ended:
            return
        self.watchdog.disarm()
        try:
            self._writer.wait()  # never leave with a checkpoint half-written
        except UserError as exc:
            if clean:
                raise
            report_error(str(exc))  # on the way out of another failure: said, not raised over it
        finally:
            if clean:
                with self._waiting("job.shutdown"):
                    self.drain_stop()
                    self.backend.shutdown(clean=clean)
            else:
                self.backend.shutdown(clean=clean)
            self._ended = True
        current.job = None

    def exit(self, code: int = 0) -> NoReturn:
        """:meth:`shutdown`, then end this process with ``code`` at once (see :func:`exit_process`)."""
        self.shutdown()
        exit_process(code)

    def __repr__(self) -> str:
        return (
            f"Job(backend={self.backend.name}, rank={self.rank}, world_size={self.world_size}, "
            f"local_rank={self.local_rank}, device={self.device}, launcher={self.launcher})"
        )
