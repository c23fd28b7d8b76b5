"""Command-line options of ``python -m trainbridge.train`` / ``trainbridge train``.

Each option is declared once, as a field of :class:`TrainConfig` made with
:func:`~trainbridge.tasks.options.option`: its type, default, flag, help, choices, valid range and
whether a resume must keep it. The parser (:func:`build_parser`), the range checks
(:meth:`TrainConfig.validate`) and the options a resume compares (:data:`TRAINING_OPTIONS`) are
read from there; a task's own options are declared the same way, in its ``Options`` dataclass.
Tests and scripts depend on these names; change them only with the README.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import tempfile
from typing import Any, Dict, List, Optional, Type

from ..api.files import unloadable_value
from ..backends import BACKENDS
from ..backends.base import COMPRESSIONS
from ..errors import UserError
from ..models import CLASSIFIERS, MODELS
from ..optional import check_installed
from ..tasks import TASKS, Task, create_task, task_class
from ..tasks.options import Check, add_to_parser, at_least, check_values, flags, option, positive_finite, resume_kept
from .metrics import PROGRESS_BAR

MIN_TIMEOUT, MAX_TIMEOUT = 1.0, 7 * 24 * 3600.0
DEFAULT_LR = {"adadelta": 1.0, "sgd": 0.01, "adam": 1e-3}
DEFAULT_DATA_ROOT = os.path.join(os.path.expanduser("~"), ".cache", "trainbridge", "data")
SPEED = "speed"  # the --help section of the speed options (see README "Performance")


@dataclasses.dataclass
class TrainConfig:
    """The engine's options, in ``--help``'s order, and the task's own (``task_options``)."""

    task: str = option(
        "mnist",
        metavar="TASK",
        help=f"workload: {', '.join(TASKS)} (default: {{default}}), or your own Task as "
        f"package.module:Class or ./file.py:Class",
        same_on_resume=True,
    )
    backend: str = option(
        "auto", choices=["auto", *BACKENDS], help="collective library; auto picks by launcher (default: {default})"
    )
    dist_backend: str = option(
        "auto",
        choices=["auto", "nccl", "gloo"],
        help="torch.distributed backend: nccl needs CUDA (default: {default} = nccl on GPU, gloo on CPU)",
    )
    model: Optional[str] = option(
        None,
        choices=[*MODELS, *CLASSIFIERS],
        same_on_resume=True,
        help="default: the task's (mnist: convnet-dropout, designsafe: resnet34)",
    )
    dataset: str = option(
        "auto",
        choices=["auto", "mnist", "mnist-sample"],
        same_on_resume=True,
        help="mnist: auto = MNIST from --data-root (downloaded if possible), else the embedded "
        "sample; designsafe: auto only (the image folder at --data-root)",
    )
    data_root: Optional[str] = option(
        None,
        help=f"mnist: folder holding MNIST/ (default: {DEFAULT_DATA_ROOT}); "
        f"designsafe (required): folder with Train/<class>/, "
        f"Validation/<class>/ and optionally Test/<class>/",
    )
    epochs: int = option(
        3, check=at_least(1), help="passes over the training set (default: {default}); --max-steps may stop earlier"
    )
    max_steps: Optional[int] = option(None, check=at_least(1), help="stop after N optimizer steps in all")
    batch_size: int = option(128, check=at_least(1), help="per process")
    lr: Optional[float] = option(
        None,
        check=positive_finite(),
        same_on_resume=True,
        help="default: the task's, else 1.0 adadelta, 0.01 sgd, 1e-3 adam",
    )
    optimizer: Optional[str] = option(
        None, choices=list(DEFAULT_LR), same_on_resume=True, help="default: the task's (mnist: adadelta)"
    )
    scheduler: Optional[str] = option(
        None,
        choices=["step", "plateau"],
        same_on_resume=True,
        help="step: StepLR by --gamma each epoch; plateau: ReduceLROnPlateau on the global val loss",
    )
    momentum: float = option(
        0.0,
        help="SGD momentum",
        same_on_resume=True,
        check=Check(lambda value: math.isfinite(value) and 0 <= value < 1, "in [0, 1)"),
    )
    gamma: float = option(
        0.7, check=positive_finite(), same_on_resume=True, help="learning-rate decay per epoch (StepLR)"
    )
    plateau_patience: int = option(
        2,
        check=at_least(0),
        same_on_resume=True,
        help="plateau: epochs without a lower val loss before the learning rate drops 10x (default: {default})",
    )
    scale_lr: bool = option(False, help="multiply the learning rate by the world size", same_on_resume=True)
    sync_batchnorm: bool = option(
        False,
        same_on_resume=True,
        help="BatchNorm statistics of the whole global batch, not of each rank's share: the model does not "
        "depend on the world size (three small allreduces per BatchNorm layer per training step)",
    )
    seed: int = option(1, same_on_resume=True)
    deterministic: bool = option(
        False,
        help="on GPUs, only kernels that give the same bits every run: reruns and "
        "resumes then agree bitwise, as on CPUs, at some cost in speed "
        "(default: off)",
    )
    output_dir: str = option(
        "runs/latest",
        metavar="DIR",
        help="where checkpoints, metrics.jsonl and reports are written; a later run in the same "
        "folder resumes from its last.pt (see --resume), so give each run its own "
        "(default: {default})",
    )
    no_progress: bool = option(
        False, help="no progress bar (also off when not a TTY); the bar needs tqdm, this does not"
    )
    log_every: int = option(20, check=at_least(1), help="read the loss back every N steps")
    warmup_steps: int = option(5, check=at_least(0), help="steps left out of the throughput and step-time figures")
    threads: int = option(
        0,
        check=at_least(0, note="0 = the cores shared among local processes"),
        help="intra-op threads per process (default {default}: available cores / local processes)",
    )
    timeout: float = option(
        300.0,
        check=Check(
            lambda value: MIN_TIMEOUT <= value <= MAX_TIMEOUT,
            f"between {MIN_TIMEOUT:.0f} and {MAX_TIMEOUT:.0f} seconds",
            why=": it bounds every wait for another rank",
        ),
        help="seconds a rank may wait for the others (collectives, rendezvous) before the job "
        "fails with an error (default {default})",
    )
    checkpoint_every: int = option(
        0, check=at_least(0), help="also write DIR/last.pt every N steps (default {default}: at every epoch end only)"
    )
    resume: str = option(
        "auto", help="{default} (default): continue from DIR/last.pt when it exists; never; or a checkpoint PATH"
    )
    allow_option_changes: bool = option(
        False, help="resume even though training options (--lr, --batch-size, ...) differ from the checkpoint's"
    )
    fail_at_step: Optional[int] = option(
        None,
        check=at_least(1),
        help="fault injection: one rank exits abruptly before step N, once (a marker file in DIR)",
    )
    fail_rank: int = option(1, check=at_least(0), help="the rank --fail-at-step kills (default {default})")
    nproc: int = option(1, check=at_least(1), help="without a launcher: spawn N local worker processes (torch backend)")
    # Speed (see README "Performance"):
    amp: str = option(
        "off",
        choices=["off", "bf16", "fp16"],
        group=SPEED,
        same_on_resume=True,
        help="mixed precision: bf16 autocast (CPU and GPU), or fp16 autocast with a GradScaler "
        "(meant for GPUs; runs on CPUs, slowly) (default: {default})",
    )
    compression: str = option(
        "none",
        choices=list(COMPRESSIONS),
        group=SPEED,
        same_on_resume=True,
        help="average gradients in fp16 or bf16: half the bytes per allreduce (default: {default})",
    )
    accumulate: int = option(
        1,
        check=at_least(1),
        metavar="K",
        group=SPEED,
        help="K micro-batches of --batch-size per optimizer step, one allreduce per step (default {default})",
    )
    compile: bool = option(False, group=SPEED, help="torch.compile the model (compiled once per process)")
    channels_last: str = option(
        "auto",
        choices=["auto", "on", "off"],
        group=SPEED,
        help="channels_last memory format for conv models and their inputs (default {default}: on with a GPU)",
    )
    shm_allreduce: str = option(
        "auto",
        choices=["auto", "on", "off"],
        group=SPEED,
        help="torch backend on CPUs: ranks on one host average gradients through shared "
        "memory instead of gloo's loopback TCP (default {default}: when every rank is on "
        "this host)",
    )
    malloc_tuning: str = option(
        "auto",
        choices=["auto", "off"],
        group=SPEED,
        help="glibc malloc: large blocks from the heap, which is never trimmed (default "
        "{default}: unless MALLOC_*_ variables, GLIBC_TUNABLES or a preloaded allocator "
        "say otherwise)",
    )
    # Not options of their own. The task's options, an instance of its Options dataclass (None: its defaults);
    # and the flags given of another built-in task, by the task that has them (refused by validate).
    task_options: Any = None
    other_tasks_flags: Dict[str, str] = dataclasses.field(default_factory=dict)

    def saved(self) -> Dict[str, Any]:
        """The config as checkpoints store it: every option by name, the task's under ``task_options``; a task option
        that ``torch.load(weights_only=True)`` could not read back (a ``pathlib.Path``, say) is stored as its string."""
        config = {name: getattr(self, name) for name in flags(TrainConfig)}
        task_options = dataclasses.asdict(self.task_options) if self.task_options is not None else {}
        config["task_options"] = {k: str(v) if unloadable_value(v) else v for k, v in task_options.items()}
        return config

    def apply_task_defaults(self, task: Task) -> None:
        """Fill options left unset with the task's defaults (model, optimizer, lr, scheduler)."""
        if self.model is None:
            self.model = task.default_model
        if self.optimizer is None:
            self.optimizer, default_lr = task.default_optimizer, task.default_lr
        else:
            default_lr = DEFAULT_LR[self.optimizer]
        if self.lr is None:
            self.lr = default_lr
        if self.scheduler is None:
            self.scheduler = task.default_scheduler

    def validate(self) -> None:
        """Raise UserError for values no run could use. Runs before any process group starts."""
        task = create_task(self.task, self.task_options)
        check_values(self)  # each option's declared range
        optimizer = self.optimizer or task.default_optimizer
        if self.momentum != 0 and optimizer != "sgd":
            raise UserError(
                f"--momentum is an SGD option; --optimizer {optimizer} has no momentum "
                f"(drop --momentum, or add --optimizer sgd)"
            )
        if self.other_tasks_flags:
            given, owners = list(self.other_tasks_flags), sorted(set(self.other_tasks_flags.values()))
            raise UserError(
                f"{', '.join(given)}: not used by --task {task.name}; "
                f"{'these options are' if len(given) > 1 else 'this option is'} for "
                f"--task {' or '.join(owners)}"
            )
        check_values(task.options)
        task.validate_config(self)  # the task's own options, libraries and data layout
        if not self.no_progress:
            check_installed(["tqdm"], PROGRESS_BAR, instead="or pass --no-progress")
        check_output_dir(self.output_dir)
        if self.data_root is not None and not os.path.isdir(self.data_root):
            raise UserError(
                f"--data-root {self.data_root} does not exist; create it or point to the "
                f"folder that holds MNIST/ (omit it to use {DEFAULT_DATA_ROOT})"
            )

    @property
    def resolved_data_root(self) -> str:
        return self.data_root or DEFAULT_DATA_ROOT


# Options that change what training computes (declared same_on_resume): a resume with other values would
# silently continue another run (--epochs and --max-steps may grow, the world size may change). The batch
# counts as the global one (--batch-size x --accumulate x ranks): the same global batch at another world size
# covers the same samples per step. A task's own options are compared likewise (see changed_options).
TRAINING_OPTIONS = resume_kept(TrainConfig)


def changed_options(saved: Dict[str, Any], saved_world_size: int, current: TrainConfig, world_size: int) -> List[str]:
    """``--name saved -> current`` for each training option that differs from the checkpoint's.

    Options are compared by name; a task's sit under ``task_options`` (older checkpoints stored
    DesignSafe's image options beside the engine's, where they are found as well)."""
    task_options = task_class(current.task).Options
    names = {**flags(TrainConfig), **flags(task_options)}
    kept = [*TRAINING_OPTIONS, *resume_kept(task_options)]
    now = current.saved()
    before_values, now_values = {**saved, **saved.get("task_options", {})}, {**now, **now["task_options"]}
    changes = [
        f"{names[name]} {before_values[name]} -> {now_values[name]}"
        for name in kept
        if name in before_values and before_values[name] != now_values[name]
    ]
    before = saved["batch_size"] * saved.get("accumulate", 1) * saved_world_size
    batch_now = current.batch_size * current.accumulate * world_size
    if before != batch_now:
        changes.append(f"global batch (--batch-size x --accumulate x ranks) {before} -> {batch_now}")
    return changes


def check_output_dir(path: str) -> None:
    """``path`` is (or can become) a folder this process can write, checked before any training.

    Probed with a real file: permission bits do not stop root, a read-only mount does.
    """
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UserError(f"--output-dir {path}: {existing} is a file, not a folder; pass another --output-dir")
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=path)  # made new: never through a planted link
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        raise UserError(
            f"--output-dir {path} is not writable ({exc.strerror or exc}); pass a folder you can write to"
        ) from None


def built_in_tasks() -> Dict[str, Type[Task]]:
    """The classes of the tasks named in ``TASKS``, by name."""
    return {name: task_class(spec) for name, spec in TASKS.items()}


def build_parser(task: Optional[str] = None, add_help: bool = True) -> argparse.ArgumentParser:
    """The parser of ``trainbridge train``, read from the declarations: the engine's options, each built-in
    task's, and those of ``task`` (its --task spec; default: mnist) when it is a user's.

    Only ``task``'s own options have defaults; another task's are in the parsed namespace only when given,
    for :meth:`TrainConfig.validate` to refuse.
    """
    parser = argparse.ArgumentParser(
        prog="trainbridge train",
        add_help=add_help,
        description="Train one model under any launcher: torchrun, horovodrun, mpirun, srun or plain python.",
    )
    add_to_parser(parser, TrainConfig)
    chosen = task_class(task or TrainConfig.task)
    own = list(flags(chosen.Options).values())
    taken = sorted(set(own) & set(parser._option_string_actions))
    if taken:
        raise UserError(
            f"--task {task}: {chosen.__name__}.Options declares {', '.join(taken)}, an option of "
            f"trainbridge train; give the task's option another name"
        )
    built_in = built_in_tasks()
    for name, cls in built_in.items():
        add_to_parser(
            parser,
            cls.Options,
            f"options of --task {name}",
            suppress_defaults=cls is not chosen,
            skip=[] if cls is chosen else own,
        )
    if chosen not in built_in.values():
        add_to_parser(parser, chosen.Options, f"options of --task {task}")
    return parser


def parse_config(argv: Optional[List[str]] = None) -> TrainConfig:
    """The command line as a config. A --task that cannot be loaded is left for :meth:`TrainConfig.validate`
    to report, on every rank, where only rank 0 speaks; its own options are then unknown and left unparsed."""
    # Two passes: --task names the task, whose own options join the parser before the full parse.
    known, _ = build_parser(add_help=False).parse_known_args(argv)
    engine = list(flags(TrainConfig))
    try:
        chosen = task_class(known.task)
    except UserError:
        known, _ = build_parser().parse_known_args(argv)  # --help still shows the options
        return TrainConfig(**{name: getattr(known, name) for name in engine})
    args = vars(build_parser(known.task).parse_args(argv))
    own = [field.name for field in dataclasses.fields(chosen.Options)]
    others = {
        flag: name
        for name, cls in built_in_tasks().items()
        if cls is not chosen
        for field, flag in flags(cls.Options).items()
        if field in args and field not in own
    }
    return TrainConfig(
        **{name: args[name] for name in engine},
        other_tasks_flags=others,
        task_options=chosen.Options(**{name: args[name] for name in own}),
    )
