"""``trainbridge data make-sample designsafe --out DIR [--seed N]``: write a sample data set."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from ..data.designsafe_sample import CLASSES, IMAGES_PER_CLASS, make_sample
from ..errors import UserError
from ..optional import require


def main(argv: Optional[List[str]] = None) -> int:
    """``trainbridge data make-sample designsafe --out DIR [--seed N]``."""
    parser = argparse.ArgumentParser(prog="trainbridge data", description="Write sample data sets.")
    parser.add_argument("action", choices=["make-sample"])
    parser.add_argument("dataset", choices=["designsafe"])
    parser.add_argument("--out", required=True, help="folder to write (created; an older sample there is replaced)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        require("PIL", "trainbridge data make-sample")
        make_sample(args.out, seed=args.seed)
    except OSError as exc:  # a parent that is a file, no permission, a full disk
        print(
            f"trainbridge: error: cannot write the sample to {args.out}: {exc.strerror or exc}; "
            f"choose a writable folder for --out",
            file=sys.stderr,
        )
        return 2
    except UserError as exc:  # the library names the folder; here it is the --out given
        message = str(exc)
        if message.startswith(args.out):
            message = f"--out {message}"
        print(f"trainbridge: error: {message}", file=sys.stderr)
        return 2
    counts = ", ".join(f"{n} {split}" for split, n in IMAGES_PER_CLASS.items())
    print(
        f"wrote a SYNTHETIC DesignSafe-style sample to {args.out}: classes {', '.join(CLASSES)}, "
        f"per class {counts} images"
    )
    return 0
