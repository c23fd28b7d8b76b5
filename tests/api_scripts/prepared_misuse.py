"""Two mistakes with a prepared model, each to end in one line (or, where harmless, to just work).

    preview: after each step, rank 0 alone runs a forward pass with gradients on and
             never runs its backward pass (a preview written without torch.no_grad()).
    unused:  rank 1 skips a layer, and the model was prepared without find_unused_parameters
Prints "finished" when the loop ran to its end.
"""
import sys

import torch
from torch import nn

import trainbridge as tb


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head, self.other = nn.Linear(4, 8), nn.Linear(8, 1), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, skip_head: bool = False) -> torch.Tensor:
        h = torch.relu(self.body(x))
        return self.other(h) if skip_head else self.head(h) + self.other(h)


def main(mode: str) -> None:
    job = tb.init(timeout=60)
    model = TwoHeads()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = job.prepare(model, optimizer)
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    for _step in range(4):
        optimizer.zero_grad()
        loss = model(x, skip_head=(mode == "unused" and job.rank == 1)).pow(2).mean()
        job.backward(loss)
        job.step(optimizer)
        if mode == "preview" and job.is_main:
            model(x)  # with gradients on, and no backward pass will follow
    job.print("finished")
    job.exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
