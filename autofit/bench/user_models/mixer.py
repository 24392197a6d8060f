"""An MLP-Mixer written as a user would write it in a file, trained with RMSprop (momentum).

Not a built-in: ``autofit bench`` loads it as ``--model path/to/mixer.py:workload`` to check the
estimator on a model structure and an optimizer it was not built around.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autofit import Workload

IMAGE, PATCH, CHANNELS, CLASSES = 32, 4, 3, 10


def mlp(width: int, hidden: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))


class MixerBlock(nn.Module):
    """Token mixing across patches, then channel mixing, each pre-norm and residual."""

    def __init__(self, tokens: int, dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.tokens = mlp(tokens, tokens * 2)
        self.norm2 = nn.LayerNorm(dim)
        self.channels = mlp(dim, dim * 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, tokens, dim)
        x = x + self.tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channels(self.norm2(x))


class Mixer(nn.Module):
    def __init__(self, dim: int = 128, depth: int = 4) -> None:
        super().__init__()
        tokens = (IMAGE // PATCH) ** 2
        self.stem = nn.Conv2d(CHANNELS, dim, PATCH, stride=PATCH)
        self.blocks = nn.ModuleList(MixerBlock(tokens, dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # (B, 3, 32, 32) -> (B, classes)
        x = self.stem(images).flatten(2).transpose(1, 2)  # (B, 64, dim)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(dim=1))


def batch(n: int):
    return torch.randn(n, CHANNELS, IMAGE, IMAGE), torch.randint(0, CLASSES, (n,))


def workload() -> Workload:
    return Workload(name="user-mixer", model=Mixer, batch=batch, loss=F.cross_entropy,
                    optimizer=lambda params: torch.optim.RMSprop(params, lr=1e-3, momentum=0.9),
                    layers=lambda model: model.blocks, description="MLP-Mixer, RMSprop with momentum")
