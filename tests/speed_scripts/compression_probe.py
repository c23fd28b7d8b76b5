"""Prints the gradient each --compression value averages, for one parameter with a known gradient.

Every rank's gradient is g = 1 + 2**-9 + 2**-13 (exact in fp32). fp16 keeps 10
mantissa bits, bf16 7, so the averaged gradient is exactly
none: g, fp16: 1 + 2**-9, bf16: 1.0. Run under any launcher with the
compressions to try as arguments; rank 0 prints one JSON line
{"backend": ..., "world_size": ..., "<compression>": <averaged gradient>, ...}.
"""
import json
import sys

import torch

from trainbridge.backends import GradientExchange, create_backend
from trainbridge.launch import detect_launch

G = 1 + 2 ** -9 + 2 ** -13


class Probe(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        return (self.w * g).sum()  # d loss / d w = g


def averaged_gradient(backend, compression: str) -> float:
    model = Probe()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model = backend.wrap(model, [optimizer], GradientExchange(compression=compression))
    optimizer.zero_grad()
    model(torch.tensor([G])).backward()
    backend.step(optimizer)
    return -backend.unwrap(model).w.item()  # w = 0 - lr * averaged gradient


def main() -> None:
    backend = create_backend("auto", detect_launch())
    backend.init()
    result = {"backend": backend.name, "world_size": backend.world_size}
    result.update({c: averaged_gradient(backend, c) for c in sys.argv[1:]})
    backend.print(json.dumps(result))
    backend.shutdown()


if __name__ == "__main__":
    main()
