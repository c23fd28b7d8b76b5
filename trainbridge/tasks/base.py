"""A task is a workload for ``trainbridge train``: its data, model, loss, metrics, options and defaults.

The training loop is written against this interface only. A built-in workload
is one module plus one line in ``trainbridge.tasks.TASKS``; a user's is named on
the command line, ``--task mypkg.tasks:MyTask`` or ``--task ./my_task.py:MyTask``
(see ``examples/own_task.py``). Tasks hand over map-style datasets and never see
ranks: trainbridge shards, shuffles and batches them.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar, Dict, List, Optional, Tuple

import torch
from torch.utils.data import Dataset

Batch = Tuple[torch.Tensor, torch.Tensor]


@dataclasses.dataclass
class NoOptions:
    """A task without command-line options of its own."""


class Task(abc.ABC):
    """A workload for ``trainbridge train``: data, model, loss, metrics, its own options and training defaults.

    Subclass it and name it with ``--task module:Class`` or ``--task ./file.py:Class``. The abstract
    members are required; the others have defaults. The class attributes ``default_*`` are the
    training options used when the command line does not give them. The task's own command-line
    options are the fields of its ``Options`` dataclass; trainbridge sets ``self.options`` (an
    ``Options``) before it calls any method.
    """

    Options: ClassVar[type] = NoOptions
    """The dataclass of the task's own command-line options (none by default); its fields are made with
    ``trainbridge.tasks.option(default, help=...)``, and the field ``noise`` is the option ``--noise``."""
    options: Any
    """The task's options, an instance of its ``Options``, set by trainbridge before any method runs."""
    processes_on_host: int = 1
    """How many of the job's processes share this host, set by trainbridge before :meth:`load_data`: a task
    that gives its DataLoaders worker processes divides the host's cores by it."""

    name: str = "base"
    """The task's name in logs and checkpoints."""
    # Training defaults, used when the matching option is not given.
    default_model: str = ""
    """``--model`` when not given (tasks that build their own model ignore it)."""
    default_optimizer: str = "adadelta"
    """``--optimizer`` when not given: sgd, adam or adadelta."""
    default_lr: float = 1.0
    """``--lr`` when not given."""
    default_scheduler: str = "step"  # "step" (StepLR, gamma per epoch) or "plateau" (ReduceLROnPlateau on val loss)
    """``--scheduler`` when not given: "step" (StepLR, ``--gamma`` per epoch) or "plateau" (on the validation loss)."""

    def validate_config(self, cfg) -> None:
        """Raise UserError for options or data this task cannot use (each option's declared range is checked before).

        Runs on every rank before any process group starts, so a bad input ends
        every rank at once with the same one line (rank 0 prints it).
        """

    def fetch(self, cfg, note) -> None:
        """Download what :meth:`load_data` needs and is missing (default: nothing).

        Runs on the main rank first, then on the others, which find the files in
        place: one download, never two ranks writing the same file.
        """

    @abc.abstractmethod
    def load_data(self, cfg, note) -> str:
        """Load or check the data on every rank at once, after :meth:`fetch`; returns one line to log.

        ``note(message)`` prints a one-line notice on the main rank.
        """

    # ----- data ----------------------------------------------------------------
    @property
    def class_names(self) -> Optional[List[str]]:
        """Names of the classes, in label order; None for a task that is not a classifier (no class report)."""
        return None

    @property
    @abc.abstractmethod
    def train_dataset(self) -> Dataset:
        """The map-style training set; trainbridge shards and shuffles it (``Job.train_loader``)."""

    @abc.abstractmethod
    def eval_dataset(self, split: str) -> Optional[Dataset]:
        """The map-style ``split`` ("val" or "test"), or None when it does not exist (no "val": no evaluation)."""

    def loader_options(self, split: str) -> Dict[str, Any]:
        """Extra ``DataLoader`` options for ``split`` ("train", "val", "test"): num_workers, collate_fn, ..."""
        return {}

    # ----- model, loss and metrics ---------------------------------------------
    @abc.abstractmethod
    def build_model(self, cfg) -> torch.nn.Module:
        """A freshly initialised model (the loop seeds the RNG first)."""

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """The training and validation loss; ``reduction`` is "mean" (training) or "sum" (evaluation).
        Default: cross-entropy."""
        return torch.nn.functional.cross_entropy(outputs, targets, reduction=reduction)

    def metrics(self, outputs: torch.Tensor, targets: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Per-batch *sums* of each metric, each one number (a one-element tensor or a Python number); the loop
        adds them over batches and ranks and divides by the sample count, so ``{"accuracy": correct}`` is
        reported as ``val_accuracy``. With a ``val_accuracy``, best.pt is the most accurate model; otherwise
        the lowest ``val_loss``."""
        return {"accuracy": (outputs.argmax(dim=1) == targets).sum()}

    def trainable_parameters(self, model: torch.nn.Module) -> List[torch.nn.Parameter]:
        """Parameters the optimizer updates (all by default; fewer when a backbone is frozen)."""
        return [p for p in model.parameters() if p.requires_grad]
