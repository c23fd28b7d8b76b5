"""A small SYNTHETIC stand-in for the DesignSafe Hurricane Harvey damage photos.

``trainbridge data make-sample designsafe --out DIR`` writes an ImageFolder with
the real set's layout and class names, so the same command line trains on
either. The pictures are drawn, not photographed: a house on a sky and ground,
with damage that grows with the class --

* ``C0`` (low): an intact house, clean lines;
* ``C2`` (medium): blue tarps and holes on the roof, debris below the roof line;
* ``C4`` (high): the roof torn open and dense debris everywhere.

Colours, sizes (64-96 px, not square) and positions vary per image, so the
classes differ by structure and clutter, which survives AutoAugment's colour
and geometry changes; a ResNet learns them in a few epochs at 64 px.
The folder's README.md says SYNTHETIC, and training on it says so in the log.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, List

import numpy as np

from ..errors import UserError

if TYPE_CHECKING:
    import PIL.Image


CLASSES = ("C0", "C2", "C4")
IMAGES_PER_CLASS = {"Train": 40, "Validation": 12, "Test": 6}
SIZE_RANGE = (64, 96)
SYNTHETIC_MARKER = "SYNTHETIC"  # first word of the README: how trainbridge recognises the sample

README = f"""{SYNTHETIC_MARKER} DesignSafe-style sample -- not real photos

Written by `trainbridge data make-sample designsafe`. Every image here was drawn
by a program: a house with no damage (C0), medium damage (C2: tarps, holes,
some debris) or high damage (C4: roof torn open, dense debris). It has the layout
and class names of the DesignSafe Hurricane Harvey set (Train/, Validation/,
Test/, one folder per class) so that tests and demos run the real code path.
Accuracy on it says nothing about accuracy on real photos.
"""


def is_synthetic_sample(root: str) -> bool:
    """True when ``root`` was written by :func:`make_sample` (its README starts with SYNTHETIC)."""
    try:
        with open(os.path.join(root, "README.md")) as f:
            return f.readline().startswith(SYNTHETIC_MARKER)
    except OSError:
        return False


def random_colour(rng: np.random.Generator, low: int = 0, high: int = 256) -> tuple:
    return tuple(int(c) for c in rng.integers(low, high, size=3))


def draw_house(rng: np.random.Generator, damage: int) -> "PIL.Image.Image":
    """One picture; ``damage`` is 0 (C0), 1 (C2) or 2 (C4)."""
    from PIL import Image, ImageDraw  # here: training on a folder (is_synthetic_sample) never draws

    width, height = (int(v) for v in rng.integers(SIZE_RANGE[0], SIZE_RANGE[1] + 1, size=2))
    image = Image.new("RGB", (width, height), random_colour(rng, 90, 200))  # sky
    draw = ImageDraw.Draw(image)
    horizon = int(height * rng.uniform(0.6, 0.75))
    draw.rectangle([0, horizon, width, height], fill=random_colour(rng, 40, 140))  # ground

    # House body and roof, placed at random.
    house_w = int(width * rng.uniform(0.45, 0.65))
    left = int(rng.integers(2, width - house_w - 2))
    right = left + house_w
    wall_top = int(horizon - height * rng.uniform(0.25, 0.35))
    roof_top = int(wall_top - height * rng.uniform(0.15, 0.25))
    draw.rectangle([left, wall_top, right, horizon], fill=random_colour(rng, 120, 240))
    roof_colour = random_colour(rng, 20, 120)
    roof = [(left - 3, wall_top), ((left + right) // 2, roof_top), (right + 3, wall_top)]
    draw.polygon(roof, fill=roof_colour)

    if damage == 0:
        # Intact: a clean roof edge and a door; nothing else.
        door_x = (left + right) // 2
        draw.rectangle([door_x - 3, horizon - 10, door_x + 3, horizon], fill=random_colour(rng, 0, 90))
        draw.polygon(roof, outline=tuple(max(0, c - 30) for c in roof_colour))
        return image

    if damage == 1:
        # Medium: a few blue tarps and dark holes on the roof, some debris on the ground.
        for _ in range(int(rng.integers(2, 4))):
            x = int(rng.integers(left + 2, right - 8))
            y = int(rng.integers(roof_top + (wall_top - roof_top) // 3, wall_top - 3))
            draw.rectangle(
                [x, y, x + int(rng.integers(8, 14)), y + int(rng.integers(5, 9))],
                outline=(0, 0, 0),
                fill=(int(rng.integers(0, 60)), int(rng.integers(80, 160)), int(rng.integers(200, 256))),
            )
        for _ in range(int(rng.integers(1, 3))):
            x = int(rng.integers(left + 2, right - 4))
            y = int(rng.integers(roof_top + (wall_top - roof_top) // 2, wall_top - 2))
            draw.ellipse([x, y, x + 4, y + 3], fill=(10, 10, 10))
        debris, debris_top = 100, roof_top
    else:
        # High: the roof torn open (sky shows through), walls broken, debris everywhere.
        for _ in range(int(rng.integers(3, 6))):
            x = int(rng.integers(left, right - 6))
            y = int(rng.integers(roof_top, wall_top))
            draw.polygon(
                [
                    (x, y),
                    (x + int(rng.integers(4, 12)), y + int(rng.integers(-4, 5))),
                    (x + int(rng.integers(0, 8)), y + int(rng.integers(3, 10))),
                ],
                fill=random_colour(rng),
            )
        debris, debris_top = 350, 0
    for _ in range(debris):  # short dark or bright strokes: planks, shingles, branches
        x = int(rng.integers(0, width))
        y = int(rng.integers(debris_top, height))
        dx, dy = (int(v) for v in rng.integers(-5, 6, size=2))
        draw.line(
            [(x, y), (x + dx, y + dy)],
            fill=random_colour(rng, 0, 60) if rng.random() < 0.5 else random_colour(rng, 200, 256),
            width=2,
        )
    return image


def sample_image_name(name: str, i: int) -> str:
    return f"{name.lower()}_{i:03d}.png"


def remove_sample_images(out_dir: str) -> None:
    """Remove the images an earlier make_sample wrote (by their names), and nothing else."""
    for split in IMAGES_PER_CLASS:
        for name in CLASSES:
            folder = os.path.join(out_dir, split, name)
            if not os.path.isdir(folder):
                continue
            pattern = re.compile(re.escape(name.lower()) + r"_\d{3}\.png$")
            for file in os.listdir(folder):
                if pattern.match(file):
                    os.remove(os.path.join(folder, file))


def make_sample(out_dir: str, seed: int = 0, train_per_class: int = IMAGES_PER_CLASS["Train"]) -> List[str]:
    """Write the synthetic ImageFolder to ``out_dir``; returns the split folders written.

    Deterministic for a given ``seed`` and ``train_per_class`` (Train/ images per
    class). An existing synthetic sample is replaced file by file: only the images
    and README this function writes are removed, never a file the user added. Any
    other non-empty folder is refused, so that real data is never overwritten.
    """
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"{out_dir} is a file; give a folder to write the sample into")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        if not is_synthetic_sample(out_dir):
            raise UserError(f"{out_dir} exists and is not a trainbridge sample; choose an empty or new folder")
        remove_sample_images(out_dir)
    rng = np.random.default_rng(seed)
    written = []
    for split, count in {**IMAGES_PER_CLASS, "Train": train_per_class}.items():
        for damage, name in enumerate(CLASSES):
            folder = os.path.join(out_dir, split, name)
            os.makedirs(folder, exist_ok=True)
            for i in range(count):
                draw_house(rng, damage).save(os.path.join(folder, sample_image_name(name, i)))
        written.append(os.path.join(out_dir, split))
    with open(os.path.join(out_dir, "README.md"), "w") as f:
        f.write(README)
    return written
