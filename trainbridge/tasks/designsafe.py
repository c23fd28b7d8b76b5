"""DesignSafe hurricane damage: ResNet34 transfer learning on an image folder.

Photos of homes after Hurricane Harvey, labelled by damage (C0 low, C2 medium,
C4 high; any class names work), in the ImageFolder layout of
:mod:`trainbridge.data.imagefolder`. ``--data-root`` is required;
``trainbridge data make-sample designsafe --out DIR`` writes a synthetic one.

Defaults (the tutorial's): resnet34 with a Linear(512, 512) -> ReLU ->
Linear(512, classes) head, CrossEntropy with label smoothing 0.1, Adam at 1e-4,
ReduceLROnPlateau on the (globally reduced) validation loss.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch
from torch.utils.data import Dataset

from ..data.designsafe_sample import is_synthetic_sample
from ..data.imagefolder import MIN_IMAGE_SIZE, auto_workers, build_transforms, check_layout, load_split
from ..errors import UserError
from ..models import CLASSIFIERS, build_classifier
from ..models.resnet import ensure_imagenet_weights, freeze_backbone
from ..optional import check_installed
from .base import Task
from .options import at_least, option

if TYPE_CHECKING:
    from torchvision.datasets import ImageFolder

LABEL_SMOOTHING = 0.1


@dataclasses.dataclass
class ImageFolderOptions:
    """The options of a ResNet on an image folder (transfer learning), ``--task designsafe``'s own."""

    image_size: int = option(
        224,
        same_on_resume=True,
        help=f"images are resized to SIZE x SIZE pixels (default: {{default}}; at least {MIN_IMAGE_SIZE})",
        check=at_least(MIN_IMAGE_SIZE, why=": ResNet downsamples by 32, smaller images leave nothing to classify"),
    )
    no_pretrained: bool = option(
        False, same_on_resume=True, help="random initial weights instead of ImageNet's (no download, no normalisation)"
    )
    pretrained_weights: Optional[str] = option(
        None,
        metavar="PATH",
        same_on_resume=True,
        help="backbone weights from a resnet34 state_dict file (default: "
        "torchvision's ImageNet weights, from its cache or downloaded)",
    )
    freeze_backbone: bool = option(
        False,
        same_on_resume=True,
        help="train only the new head; the backbone (BatchNorm statistics included) stays fixed",
    )
    workers: Optional[int] = option(
        None,
        check=at_least(0),
        help="DataLoader worker processes per rank (default: available cores / local processes)",
    )


class DesignSafeTask(Task):
    name = "designsafe"
    default_model = "resnet34"
    default_optimizer = "adam"
    default_lr = 1e-4
    default_scheduler = "plateau"
    Options = ImageFolderOptions
    options: ImageFolderOptions

    def __init__(self) -> None:
        self.datasets: Dict[str, ImageFolder] = {}
        self.classes: List[str] = []
        self.weights_path: Optional[str] = None
        self.workers = 0

    def validate_config(self, cfg) -> None:
        """Options and data layout, checked on every rank before any process group starts."""
        if self.options.no_pretrained and self.options.pretrained_weights:
            raise UserError("--no-pretrained and --pretrained-weights contradict each other; give one")
        if cfg.data_root is None:
            raise UserError(
                "--task designsafe needs --data-root DIR, a folder with Train/<class>/ and "
                "Validation/<class>/ (and optionally Test/<class>/); for a synthetic one run "
                "`trainbridge data make-sample designsafe --out DIR`"
            )
        if cfg.dataset != "auto":
            raise UserError(
                f"--dataset {cfg.dataset} is for --task mnist; --task designsafe reads the image "
                f"folder at --data-root (leave --dataset at auto)"
            )
        if cfg.model is not None and cfg.model not in CLASSIFIERS:
            raise UserError(
                f"--task designsafe trains an image classifier ({', '.join(CLASSIFIERS)}), not --model {cfg.model}"
            )
        check_installed(["torchvision", "PIL"], "--task designsafe (ResNet34 on an image folder)")
        check_layout(cfg.data_root)

    def fetch(self, cfg, note) -> None:
        if not self.options.no_pretrained and not self.options.pretrained_weights:
            ensure_imagenet_weights()  # main rank first: one download per node

    def load_data(self, cfg, note) -> str:
        splits = check_layout(cfg.data_root, decode_images=False)  # images were decoded in validate_config
        options = self.options
        pretrained = not options.no_pretrained
        if options.pretrained_weights:
            self.weights_path, weights = options.pretrained_weights, f"backbone from {options.pretrained_weights}"
        elif pretrained:
            self.weights_path = ensure_imagenet_weights()  # in place: fetch downloaded it
            weights = f"ImageNet backbone from {self.weights_path}"
        else:
            weights = "random initialisation (--no-pretrained)"
        self.datasets = {
            split: load_split(
                folder, build_transforms(options.image_size, train=split == "train", imagenet_normalise=pretrained)
            )
            for split, folder in splits.items()
        }
        self.classes = list(self.datasets["train"].classes)
        # Cores per rank, as for the intra-op threads: this host's processes share them.
        self.workers = options.workers if options.workers is not None else auto_workers(self.processes_on_host)
        sizes = " / ".join(f"{len(d)} {split}" for split, d in self.datasets.items())
        synthetic = is_synthetic_sample(cfg.data_root)
        if synthetic:
            note(
                f"[trainbridge] {cfg.data_root} is a SYNTHETIC sample (drawn pictures, not DesignSafe photos): "
                f"its accuracy says nothing about real data"
            )
        return (
            f"{'SYNTHETIC ' if synthetic else ''}image folder {cfg.data_root}: {sizes} images, classes "
            f"{', '.join(self.classes)}; {cfg.model} at {options.image_size}px, {weights}"
            f"{', backbone frozen' if options.freeze_backbone else ''}; {self.workers} loader workers per rank"
        )

    @property
    def class_names(self) -> List[str]:
        return self.classes

    @property
    def train_dataset(self) -> Dataset:
        return self.datasets["train"]

    def eval_dataset(self, split: str) -> Optional[Dataset]:
        return self.datasets.get(split)

    def loader_options(self, split: str) -> Dict[str, Any]:
        return {"num_workers": self.workers}

    def build_model(self, cfg) -> torch.nn.Module:
        model = build_classifier(cfg.model or self.default_model, len(self.classes), self.weights_path)
        return freeze_backbone(model) if self.options.freeze_backbone else model

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits, labels, reduction=reduction, label_smoothing=LABEL_SMOOTHING)

    # trainable_parameters: the base class's (requires_grad only) is what --freeze-backbone needs.
