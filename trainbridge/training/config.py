"""Command-line options of ``python -m trainbridge.train`` / ``trainbridge train``.

Tests and scripts depend on these names; change them only with the README.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
from typing import Any, Dict, List, Optional

from ..api.files import unloadable_value
from ..backends import BACKENDS
from ..backends.base import COMPRESSIONS
from ..data.imagefolder import MIN_IMAGE_SIZE
from ..errors import UserError
from ..models import CLASSIFIERS, MODELS
from ..optional import check_installed
from ..tasks import TASKS, create_task
from .metrics import PROGRESS_BAR

MIN_TIMEOUT, MAX_TIMEOUT = 1.0, 7 * 24 * 3600.0
DEFAULT_LR = {"adadelta": 1.0, "sgd": 0.01, "adam": 1e-3}
DEFAULT_DATA_ROOT = os.path.join(os.path.expanduser("~"), ".cache", "trainbridge", "data")


@dataclasses.dataclass
class TrainConfig:
    task: str = "mnist"
    backend: str = "auto"
    dist_backend: str = "auto"
    model: Optional[str] = None
    dataset: str = "auto"
    data_root: Optional[str] = None
    epochs: int = 3
    max_steps: Optional[int] = None
    batch_size: int = 128
    lr: Optional[float] = None
    optimizer: Optional[str] = None
    scheduler: Optional[str] = None
    momentum: float = 0.0
    gamma: float = 0.7
    plateau_patience: int = 2
    scale_lr: bool = False
    seed: int = 1
    output_dir: str = "runs/latest"
    no_progress: bool = False
    log_every: int = 20
    warmup_steps: int = 5
    threads: int = 0
    timeout: float = 300.0
    nproc: int = 1
    checkpoint_every: int = 0
    resume: str = "auto"
    fail_at_step: Optional[int] = None
    fail_rank: int = 1
    allow_option_changes: bool = False
    deterministic: bool = False
    # Speed (see README "Performance"):
    amp: str = "off"
    compression: str = "none"
    accumulate: int = 1
    compile: bool = False
    channels_last: str = "auto"
    shm_allreduce: str = "auto"
    malloc_tuning: str = "auto"
    # Image-folder tasks (designsafe):
    image_size: int = 224
    no_pretrained: bool = False
    pretrained_weights: Optional[str] = None
    freeze_backbone: bool = False
    workers: Optional[int] = None  # DataLoader workers per rank; None: available cores / local processes
    # A user task's own options (Task.add_arguments), also set as attributes of the config.
    task_options: Dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, value in self.task_options.items():
            setattr(self, name, value)

    def saved(self) -> Dict[str, Any]:
        """The config as checkpoints store it: a task option that ``torch.load(weights_only=True)`` could not
        read back (a ``pathlib.Path``, say) is stored as its string."""
        config = dataclasses.asdict(self)
        config["task_options"] = {k: str(v) if unloadable_value(v) else v for k, v in self.task_options.items()}
        return config

    def apply_task_defaults(self, task) -> None:
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
        task = create_task(self.task)
        checks = [
            (self.batch_size >= 1, f"--batch-size must be at least 1 (got {self.batch_size})"),
            (self.epochs >= 1, f"--epochs must be at least 1 (got {self.epochs})"),
            (self.max_steps is None or self.max_steps >= 1, f"--max-steps must be at least 1 (got {self.max_steps})"),
            (self.lr is None or (self.lr > 0 and math.isfinite(self.lr)),
             f"--lr must be a positive finite number (got {self.lr})"),
            (math.isfinite(self.momentum) and 0 <= self.momentum < 1, f"--momentum must be in [0, 1) (got {self.momentum})"),
            (self.momentum == 0 or (self.optimizer or task.default_optimizer) == "sgd",
             f"--momentum is an SGD option; --optimizer {self.optimizer or task.default_optimizer} has no momentum "
             f"(drop --momentum, or add --optimizer sgd)"),
            (math.isfinite(self.gamma) and self.gamma > 0, f"--gamma must be a positive finite number (got {self.gamma})"),
            (self.nproc >= 1, f"--nproc must be at least 1 (got {self.nproc})"),
            (self.threads >= 0, f"--threads must be at least 0 (got {self.threads}; 0 = the cores shared among "
                                f"local processes)"),
            (MIN_TIMEOUT <= self.timeout <= MAX_TIMEOUT,
             f"--timeout must be between {MIN_TIMEOUT:.0f} and {MAX_TIMEOUT:.0f} seconds (got {self.timeout}): it bounds "
             f"every wait for another rank"),
            (self.fail_rank >= 0, f"--fail-rank must be at least 0 (got {self.fail_rank})"),
            (self.warmup_steps >= 0, f"--warmup-steps must be at least 0 (got {self.warmup_steps})"),
            (self.checkpoint_every >= 0, f"--checkpoint-every must be at least 0 (got {self.checkpoint_every})"),
            (self.fail_at_step is None or self.fail_at_step >= 1,
             f"--fail-at-step must be at least 1 (got {self.fail_at_step})"),
            (self.log_every >= 1, f"--log-every must be at least 1 (got {self.log_every})"),
            (self.plateau_patience >= 0, f"--plateau-patience must be at least 0 (got {self.plateau_patience})"),
            (self.image_size >= MIN_IMAGE_SIZE,
             f"--image-size must be at least {MIN_IMAGE_SIZE} (got {self.image_size}): "
             f"ResNet downsamples by 32, smaller images leave nothing to classify"),
            (self.accumulate >= 1, f"--accumulate must be at least 1 (got {self.accumulate})"),
            (self.workers is None or self.workers >= 0, f"--workers must be at least 0 (got {self.workers})"),
            (not (self.no_pretrained and self.pretrained_weights),
             "--no-pretrained and --pretrained-weights contradict each other; give one"),
        ]
        for ok, message in checks:
            if not ok:
                raise UserError(message)
        task.validate_config(self)  # the task's own options, libraries and data layout
        if not self.no_progress:
            check_installed(["tqdm"], PROGRESS_BAR, instead="or pass --no-progress")
        check_output_dir(self.output_dir)
        if self.data_root is not None and not os.path.isdir(self.data_root):
            raise UserError(f"--data-root {self.data_root} does not exist; create it or point to the "
                            f"folder that holds MNIST/ (omit it to use {DEFAULT_DATA_ROOT})")

    @property
    def resolved_data_root(self) -> str:
        return self.data_root or DEFAULT_DATA_ROOT


# Options that change what training computes: a resume with other values would silently
# continue another run (--epochs and --max-steps may grow, the world size may change).
# The batch counts as the global one (--batch-size x --accumulate x ranks): the same global
# batch at another world size covers the same samples per step.
TRAINING_OPTIONS = ("task", "model", "dataset", "lr", "optimizer", "scheduler", "momentum", "gamma", "plateau_patience",
                    "scale_lr", "seed", "amp", "compression", "image_size", "no_pretrained", "pretrained_weights",
                    "freeze_backbone", "task_options")


def changed_options(saved: Dict[str, Any], saved_world_size: int, current: "TrainConfig", world_size: int) -> List[str]:
    """``--name saved -> current`` for each training option that differs from the checkpoint's."""
    now_saved = current.saved()
    changes = [f"--{name.replace('_', '-')} {saved[name]} -> {now_saved[name]}" for name in TRAINING_OPTIONS
               if name in saved and saved[name] != now_saved[name]]
    before = saved["batch_size"] * saved.get("accumulate", 1) * saved_world_size
    now = current.batch_size * current.accumulate * world_size
    if before != now:
        changes.append(f"global batch (--batch-size x --accumulate x ranks) {before} -> {now}")
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
        probe = os.path.join(path, f".write-test-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as exc:
        raise UserError(f"--output-dir {path} is not writable ({exc.strerror or exc}); pass a folder you can "
                        f"write to") from None


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = argparse.ArgumentParser(
        prog="trainbridge train",
        description="Train one model under any launcher: torchrun, horovodrun, mpirun, srun or plain python.",
    )
    p.add_argument("--task", default=d.task, metavar="TASK",
                   help=f"workload: {', '.join(TASKS)} (default: mnist), or your own Task as "
                        f"package.module:Class or ./file.py:Class")
    p.add_argument("--backend", default=d.backend, choices=["auto", *BACKENDS],
                   help="collective library; auto picks by launcher (default: auto)")
    p.add_argument("--dist-backend", default=d.dist_backend, choices=["auto", "nccl", "gloo"],
                   help="torch.distributed backend: nccl needs CUDA (default: auto = nccl on GPU, gloo on CPU)")
    p.add_argument("--model", default=None, choices=[*MODELS, *CLASSIFIERS],
                   help="default: the task's (mnist: convnet-dropout, designsafe: resnet34)")
    p.add_argument("--dataset", default=d.dataset, choices=["auto", "mnist", "mnist-sample"],
                   help="mnist: auto = MNIST from --data-root (downloaded if possible), else the embedded sample; "
                        "designsafe: auto only (the image folder at --data-root)")
    p.add_argument("--data-root", default=None,
                   help=f"mnist: folder holding MNIST/ (default: {DEFAULT_DATA_ROOT}); designsafe (required): "
                        f"folder with Train/<class>/, Validation/<class>/ and optionally Test/<class>/")
    p.add_argument("--epochs", type=int, default=d.epochs,
                   help=f"passes over the training set (default: {d.epochs}); --max-steps may stop earlier")
    p.add_argument("--max-steps", type=int, default=None, help="stop after N optimizer steps in all")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="per process")
    p.add_argument("--lr", type=float, default=None,
                   help="default: the task's, else 1.0 adadelta, 0.01 sgd, 1e-3 adam")
    p.add_argument("--optimizer", default=None, choices=list(DEFAULT_LR), help="default: the task's (mnist: adadelta)")
    p.add_argument("--scheduler", default=None, choices=["step", "plateau"],
                   help="step: StepLR by --gamma each epoch; plateau: ReduceLROnPlateau on the global val loss")
    p.add_argument("--momentum", type=float, default=d.momentum, help="SGD momentum")
    p.add_argument("--gamma", type=float, default=d.gamma, help="learning-rate decay per epoch (StepLR)")
    p.add_argument("--plateau-patience", type=int, default=d.plateau_patience,
                   help="plateau: epochs without a lower val loss before the learning rate drops 10x (default: 2)")
    p.add_argument("--scale-lr", action="store_true", help="multiply the learning rate by the world size")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--deterministic", action="store_true",
                   help="on GPUs, only kernels that give the same bits every run: reruns and resumes then agree "
                        "bitwise, as on CPUs, at some cost in speed (default: off)")
    p.add_argument("--output-dir", default=d.output_dir, metavar="DIR",
                   help=f"where checkpoints, metrics.jsonl and reports are written; a later run in the same folder "
                        f"resumes from its last.pt (see --resume), so give each run its own (default: {d.output_dir})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (also off when not a TTY); the bar needs tqdm, this does not")
    p.add_argument("--log-every", type=int, default=d.log_every, help="read the loss back every N steps")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps,
                   help="steps left out of the throughput and step-time figures")
    p.add_argument("--threads", type=int, default=d.threads,
                   help="intra-op threads per process (default 0: available cores / local processes)")
    p.add_argument("--timeout", type=float, default=d.timeout,
                   help="seconds a rank may wait for the others (collectives, rendezvous) before the job "
                        "fails with an error (default 300)")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every,
                   help="also write DIR/last.pt every N steps (default 0: at every epoch end only)")
    p.add_argument("--resume", default=d.resume,
                   help="auto (default): continue from DIR/last.pt when it exists; never; or a checkpoint PATH")
    p.add_argument("--allow-option-changes", action="store_true",
                   help="resume even though training options (--lr, --batch-size, ...) differ from the checkpoint's")
    p.add_argument("--fail-at-step", type=int, default=None,
                   help="fault injection: one rank exits abruptly before step N, once (a marker file in DIR)")
    p.add_argument("--fail-rank", type=int, default=d.fail_rank, help="the rank --fail-at-step kills (default 1)")
    p.add_argument("--nproc", type=int, default=d.nproc,
                   help="without a launcher: spawn N local worker processes (torch backend)")
    speed = p.add_argument_group("speed")
    speed.add_argument("--amp", default=d.amp, choices=["off", "bf16", "fp16"],
                       help="mixed precision: bf16 autocast (CPU and GPU), or fp16 autocast with a GradScaler "
                            "(meant for GPUs; runs on CPUs, slowly) (default: off)")
    speed.add_argument("--compression", default=d.compression, choices=list(COMPRESSIONS),
                       help="average gradients in fp16 or bf16: half the bytes per allreduce (default: none)")
    speed.add_argument("--accumulate", type=int, default=d.accumulate, metavar="K",
                       help="K micro-batches of --batch-size per optimizer step, one allreduce per step (default 1)")
    speed.add_argument("--compile", action="store_true", help="torch.compile the model (compiled once per process)")
    speed.add_argument("--channels-last", default=d.channels_last, choices=["auto", "on", "off"],
                       help="channels_last memory format for conv models and their inputs "
                            "(default auto: on with a GPU)")
    speed.add_argument("--shm-allreduce", default=d.shm_allreduce, choices=["auto", "on", "off"],
                       help="torch backend on CPUs: ranks on one host average gradients through shared memory "
                            "instead of gloo's loopback TCP (default auto: when every rank is on this host)")
    speed.add_argument("--malloc-tuning", default=d.malloc_tuning, choices=["auto", "off"],
                       help="glibc malloc: large blocks from the heap, which is never trimmed (default auto: "
                            "unless MALLOC_*_ variables, GLIBC_TUNABLES or a preloaded allocator say otherwise)")
    images = p.add_argument_group("image-folder tasks (designsafe)")
    images.add_argument("--image-size", type=int, default=d.image_size,
                        help=f"images are resized to SIZE x SIZE pixels (default: 224; at least {MIN_IMAGE_SIZE})")
    images.add_argument("--no-pretrained", action="store_true",
                        help="random initial weights instead of ImageNet's (no download, no normalisation)")
    images.add_argument("--pretrained-weights", metavar="PATH", default=None,
                        help="backbone weights from a resnet34 state_dict file (default: torchvision's "
                             "ImageNet weights, from its cache or downloaded)")
    images.add_argument("--freeze-backbone", action="store_true",
                        help="train only the new head; the backbone (BatchNorm statistics included) stays fixed")
    images.add_argument("--workers", type=int, default=None,
                        help="DataLoader worker processes per rank (default: available cores / local processes)")
    return p


def parse_config(argv: Optional[List[str]] = None) -> TrainConfig:
    """The command line as a config. A --task that cannot be loaded is left for :meth:`TrainConfig.validate`
    to report, on every rank, where only rank 0 speaks; its own options are then unknown and left unparsed."""
    # Two passes: --task names the task, whose own options join the parser before the full parse.
    parser = build_parser()
    known, _ = parser.parse_known_args(argv)
    try:
        task_class = type(create_task(known.task))
    except UserError:
        return TrainConfig(**vars(known))
    group = parser.add_argument_group(f"options of --task {known.task}")
    before = {a.dest for a in parser._actions}
    task_class.add_arguments(group)
    own = {a.dest for a in parser._actions} - before
    args = vars(parser.parse_args(argv))
    return TrainConfig(**{k: v for k, v in args.items() if k not in own},
                       task_options={k: v for k, v in args.items() if k in own})
