"""Print the largest difference between the model weights of two trainbridge checkpoints.

    python scripts/compare_weights.py runs/a/last.pt runs/b/last.pt
"""
import sys

import torch

a, b = (torch.load(path, weights_only=True, map_location="cpu")["model"] for path in sys.argv[1:3])
if a.keys() != b.keys():
    raise SystemExit(f"{sys.argv[1]} and {sys.argv[2]} hold different models; compare checkpoints of one model")
largest = max((x.double() - y.double()).abs().max().item() for x, y in zip(a.values(), b.values()))
print(f"largest weight difference: {largest:.3g}{' (bitwise equal)' if largest == 0 else ''}")
