"""A task is a workload: its data, its model, its loss and its training defaults.

The training loop is written against this interface only, so a new workload is
one module plus one line in ``trainbridge.tasks.TASKS``. Tasks never see the
backend's name: sharding comes in as a sampler (training) or an index list
(evaluation) that the backend produced.
"""
from __future__ import annotations

import abc
from typing import Iterable, List, Sequence, Tuple

import torch

from ..errors import UserError

Batch = Tuple[torch.Tensor, torch.Tensor]


class Task(abc.ABC):
    name: str = "base"
    # Training defaults, used when the matching option is not given.
    default_model: str = ""
    default_optimizer: str = "adadelta"
    default_lr: float = 1.0
    default_scheduler: str = "step"  # "step" (StepLR, gamma per epoch) or "plateau" (ReduceLROnPlateau on val loss)
    accepts_transfer_options: bool = False  # --no-pretrained, --pretrained-weights, --freeze-backbone

    def validate_config(self, cfg) -> None:
        """Raise UserError for options or data this task cannot use.

        Runs on every rank before any process group starts, so a bad input ends
        every rank at once with the same one line (rank 0 prints it).
        """
        used = [flag for flag, value in (("--no-pretrained", cfg.no_pretrained),
                                         ("--pretrained-weights", cfg.pretrained_weights),
                                         ("--freeze-backbone", cfg.freeze_backbone)) if value]
        if used and not self.accepts_transfer_options:
            raise UserError(f"{', '.join(used)}: not used by --task {self.name}; these options are for "
                            f"transfer-learning tasks (designsafe)")

    @abc.abstractmethod
    def prepare(self, cfg, note) -> str:
        """Load or check the data (called on the main rank first, then the others); returns one line to log.

        ``note(message)`` prints a one-line notice on the main rank.
        """

    @property
    @abc.abstractmethod
    def class_names(self) -> List[str]:
        """Names of the classes, in label order."""

    @property
    @abc.abstractmethod
    def train_size(self) -> int:
        """Number of training samples (the sampler's dataset size)."""

    @abc.abstractmethod
    def eval_size(self, split: str) -> int:
        """Number of samples in ``split`` ("val" or "test"); 0 when the split does not exist."""

    @abc.abstractmethod
    def train_loader(self, sampler: Iterable[int], batch_size: int, device: torch.device) -> Iterable[Batch]:
        """Re-iterable batches on ``device``, following ``sampler``'s current order on every pass."""

    @abc.abstractmethod
    def eval_loader(self, split: str, indices: Sequence[int], batch_size: int, device: torch.device) -> Iterable[Batch]:
        """Batches of exactly ``indices`` of ``split``, in order, on ``device``."""

    @abc.abstractmethod
    def build_model(self, cfg) -> torch.nn.Module:
        """A freshly initialised model (the loop seeds the RNG first)."""

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits, labels, reduction=reduction)

    def trainable_parameters(self, model: torch.nn.Module) -> List[torch.nn.Parameter]:
        """Parameters the optimizer updates (all by default; fewer when a backbone is frozen)."""
        return [p for p in model.parameters() if p.requires_grad]
