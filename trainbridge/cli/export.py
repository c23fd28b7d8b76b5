"""``trainbridge export CHECKPOINT OUTPUT [--key model]``: a sharded checkpoint's model as one plain file.

A checkpoint of a sharded model (``job.prepare(..., shard=True)``, then ``job.save``) is a folder
of every rank's shards. This writes one of its models whole, as the ``state_dict`` file that
``model.load_state_dict(torch.load(OUTPUT))`` takes for inference: one process, no launcher,
the model (not its optimizer) in memory once.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from ..errors import UserError


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="trainbridge export", description="Write a sharded checkpoint's model as one plain state_dict file."
    )
    parser.add_argument("checkpoint", help="the folder job.save wrote for a sharded model")
    parser.add_argument("output", help="the file to write (torch.save of the model's state_dict)")
    parser.add_argument("--key", default="model", help="the key the model was saved under (default: %(default)s)")
    args = parser.parse_args(argv)
    from ..api.sharded_checkpoint import export_folder, is_sharded_checkpoint

    try:
        if not is_sharded_checkpoint(args.checkpoint):
            what = "does not exist" if not os.path.exists(args.checkpoint) else "is not a sharded checkpoint folder"
            raise UserError(
                f"{args.checkpoint} {what}; give the folder that job.save wrote for a model prepared with shard=True "
                f"(a plain checkpoint file already loads with torch.load)"
            )
        tensors = export_folder(args.checkpoint, args.output, args.key)
    except UserError as exc:
        print(f"trainbridge: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}: {args.key!r} of {args.checkpoint}, {tensors} tensors")
    return 0
