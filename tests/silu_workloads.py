"""A convolutional net written as users write one: stride-2 convolutions, GroupNorm and SiLU, AdamW.
``silu_backward`` has no FLOP formula in torch but a decomposition, which torch's counter runs in
its place (tests/profiling/test_flop_counter_aside.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autofit.workloads.base import Workload

CHANNELS, SIZE, CLASSES = 16, 32, 10


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1)
        self.norm = nn.GroupNorm(4, CHANNELS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.norm(self.conv(x)))


class Net(nn.Module):
    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, CHANNELS, 3, stride=2, padding=1)
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.head = nn.Linear(CHANNELS, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.silu(self.stem(x))
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


def silu_convnet() -> Workload:
    return Workload(
        name="silu-convnet",
        model=Net,
        batch=lambda n: (torch.randn(n, 3, SIZE, SIZE), torch.randint(0, CLASSES, (n,))),
        loss=F.cross_entropy,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        layers=lambda m: m.blocks,
    )
