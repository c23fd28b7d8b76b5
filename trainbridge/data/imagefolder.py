"""Image-folder data: layout checks, transforms and the dataset (hidden files and folders left out).

Layout (any class names; the folder names are fixed)::

    ROOT/Train/<class>/*.jpg|png|...
    ROOT/Validation/<class>/*
    ROOT/Test/<class>/*          (optional)

:func:`check_layout` rejects every input that would otherwise fail late or
silently (a missing split, classes that differ between splits, an empty class,
a file that is not a readable image) with one :class:`UserError` line naming
the problem and the fix. Sharding is not decided here: the public API's loaders
shard and batch the dataset.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Dict, List

from ..errors import UserError, first_line
from ..launch.environment import available_cores

if TYPE_CHECKING:
    from torchvision.datasets import ImageFolder

SPLIT_FOLDERS = {"train": "Train", "val": "Validation", "test": "Test"}  # split name -> folder under ROOT
REQUIRED_SPLITS = ("train", "val")
# The extensions torchvision's ImageFolder loads; other files (README, .DS_Store) are ignored.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
MIN_IMAGE_SIZE = 32  # ResNet downsamples 32x: smaller inputs leave no spatial extent at the last stage
LAYOUT_HINT = "expected ROOT/Train/<class>/*, ROOT/Validation/<class>/* and optionally ROOT/Test/<class>/*"


def visible(name: str) -> bool:
    """Not hidden: Jupyter's .ipynb_checkpoints/, macOS's ._ files and .DS_Store are no data."""
    return not name.startswith(".")


def image_files(folder: str) -> List[str]:
    """Image files in ``folder`` and its sub-folders (by extension, as the loader reads them), sorted;
    hidden files and folders are left out."""
    found = []
    for parent, dirs, files in os.walk(folder, followlinks=True):
        dirs[:] = [d for d in dirs if visible(d)]
        found += [os.path.join(parent, n) for n in files if visible(n) and n.lower().endswith(IMAGE_EXTENSIONS)]
    return sorted(found)


def class_folders(split_dir: str) -> List[str]:
    return sorted(
        name for name in os.listdir(split_dir) if os.path.isdir(os.path.join(split_dir, name)) and visible(name)
    )


def check_image(path: str) -> None:
    """Decode ``path`` (JPEGs at reduced scale, which is fast) or raise UserError naming it."""
    from PIL import Image  # pillow is an optional package, checked by the task (trainbridge.optional)

    try:
        with Image.open(path) as image:
            image.draft("RGB", (64, 64))  # JPEG only: decode at 1/8 scale; still reads the whole stream
            image.load()
    except Exception as exc:  # noqa: BLE001 - PIL raises OSError, SyntaxError, ValueError, ...
        raise UserError(f"unreadable image file {path} ({first_line(exc)}); replace or delete it") from None


def check_layout(root: str, decode_images: bool = True) -> Dict[str, str]:
    """Check the ImageFolder layout under ``root``; returns {split: folder} for the splits present.

    Every image is decoded once (``decode_images``) so that a corrupt file is
    named before training starts rather than crashing a DataLoader worker mid-epoch.
    """
    if not os.path.isdir(root):
        raise UserError(f"--data-root {root} does not exist; {LAYOUT_HINT}")
    present = {
        split: os.path.join(root, folder)
        for split, folder in SPLIT_FOLDERS.items()
        if os.path.isdir(os.path.join(root, folder))
    }
    for split in REQUIRED_SPLITS:
        if split not in present:
            found = ", ".join(sorted(n for n in os.listdir(root) if os.path.isdir(os.path.join(root, n)))) or "nothing"
            raise UserError(f"--data-root {root} has no {SPLIT_FOLDERS[split]}/ folder (found: {found}); {LAYOUT_HINT}")
    classes = class_folders(present["train"])
    if not classes:
        raise UserError(f"{present['train']} has no class folders; {LAYOUT_HINT}")
    for split, split_dir in present.items():
        theirs = class_folders(split_dir)
        if theirs != classes:
            only_train = sorted(set(classes) - set(theirs))
            only_here = sorted(set(theirs) - set(classes))
            raise UserError(
                f"class folders differ between {SPLIT_FOLDERS['train']}/ and {SPLIT_FOLDERS[split]}/ "
                f"in {root}: only in Train: {only_train or 'none'}, only in {SPLIT_FOLDERS[split]}: "
                f"{only_here or 'none'}; every split needs the same class folders"
            )
        for name in classes:
            files = image_files(os.path.join(split_dir, name))
            if not files:
                raise UserError(
                    f"class folder {os.path.join(split_dir, name)} has no images "
                    f"({', '.join(IMAGE_EXTENSIONS)}); add images or remove the class from every split"
                )
            if decode_images:
                for path in files:
                    check_image(path)
    return present


def build_transforms(image_size: int, train: bool, imagenet_normalise: bool):
    """Training: AutoAugment -> Resize -> ToTensor (-> ImageNet normalisation); evaluation: without AutoAugment.

    Resize to a square (size, size), so that photos of any aspect ratio batch together.
    ImageNet normalisation only matters with ImageNet weights (pretrained or from a file).
    """
    from torchvision import transforms as T

    steps = [T.AutoAugment(T.AutoAugmentPolicy.IMAGENET)] if train else []
    steps += [T.Resize((image_size, image_size)), T.ToTensor()]
    if imagenet_normalise:
        steps.append(T.Normalize(IMAGENET_MEAN, IMAGENET_STD))
    return T.Compose(steps)


def load_split(folder: str, transform) -> "ImageFolder":
    """torchvision's ImageFolder (labels = sorted class folder names, images converted to RGB),
    reading the classes and files :func:`check_layout` checked: hidden ones are left out.

    ImageFolder alone counts a hidden folder (e.g. ``.ipynb_checkpoints/``) as a class,
    which shifts every label by one.
    """
    from torchvision.datasets import ImageFolder

    class VisibleImageFolder(ImageFolder):
        def find_classes(self, directory: str):
            classes = class_folders(directory)
            return classes, {name: i for i, name in enumerate(classes)}

    def is_valid_file(path: str) -> bool:
        relative = os.path.relpath(path, folder)
        return path.lower().endswith(IMAGE_EXTENSIONS) and all(visible(part) for part in relative.split(os.sep))

    return VisibleImageFolder(folder, transform=transform, is_valid_file=is_valid_file)


def auto_workers(local_size: int) -> int:
    """DataLoader workers per rank: the available cores shared among this node's processes."""
    return max(0, available_cores() // max(1, local_size))
