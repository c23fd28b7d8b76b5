"""What the launched programs of real_programs.py and same_model.py share: batch arithmetic and the final write."""
import os
from typing import Dict

import torch
from torch import nn


def per_rank_batch(job, global_batch: int) -> int:
    if global_batch % job.world_size:
        raise SystemExit(f"global batch {global_batch} is not divisible by world size {job.world_size}")
    return global_batch // job.world_size


def host_copy(state: Dict[str, torch.Tensor], prefix: str = "") -> Dict[str, torch.Tensor]:
    return {prefix + k: v.detach().cpu().clone() for k, v in state.items()}


def plain_state(model: nn.Module, prefix: str = "") -> Dict[str, torch.Tensor]:
    """``model.state_dict()`` of the prepared model, which must have the user's keys on every backend."""
    state = model.state_dict()
    wrapped = [k for k in state if k.startswith(("module.", "_orig_mod."))]
    assert not wrapped, f"prepared model's state_dict has wrapper keys: {wrapped[:3]}"
    return host_copy(state, prefix)


def finish(job, out_dir: str, name: str, initial: Dict[str, torch.Tensor], final: Dict[str, torch.Tensor],
           **extra) -> None:
    """Gather every rank's final weights, compare them with rank 0's and write OUT/<name>.pt on rank 0."""
    everyone = job.allgather_object(final)
    cross_rank = max((other[k] - final[k]).abs().max().item() for other in everyone for k in final)
    per_rank_extra = job.allgather_object(extra)
    if job.is_main:
        torch.save({"world_size": job.world_size, "backend": job.backend_name, "initial": initial, "final": final,
                    "cross_rank_max_diff": cross_rank, "per_rank": per_rank_extra, **extra},
                   os.path.join(out_dir, f"{name}.pt"))
    job.print(f"{name}: done, world size {job.world_size}, cross-rank max diff {cross_rank:.3g}")
