"""A Vision Transformer written as a user would write it in a file: ``nn.TransformerEncoderLayer`` blocks, AdamW.

Not a built-in: ``autofit bench`` loads it as ``--model path/to/vit.py:workload`` to check the
estimator on a model structure it was not built around.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autofit import Workload

IMAGE, PATCH, CHANNELS, CLASSES = 32, 4, 3, 10


class ViT(nn.Module):
    """Patch embedding (a strided conv), a class token, learned positions, pre-norm encoder layers."""

    def __init__(self, dim: int = 128, depth: int = 4, heads: int = 4) -> None:
        super().__init__()
        tokens = (IMAGE // PATCH) ** 2
        self.patch = nn.Conv2d(CHANNELS, dim, PATCH, stride=PATCH)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, tokens + 1, dim) * 0.02)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.1, activation="gelu", batch_first=True,
                                       norm_first=True)
            for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # (B, 3, 32, 32) -> (B, classes)
        x = self.patch(images).flatten(2).transpose(1, 2)  # (B, 64, dim)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0]))


def batch(n: int):
    return torch.randn(n, CHANNELS, IMAGE, IMAGE), torch.randint(0, CLASSES, (n,))


def workload() -> Workload:
    return Workload(name="user-vit", model=ViT, batch=batch, loss=F.cross_entropy,
                    optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.05),
                    layers=lambda model: model.blocks, description="ViT from nn.TransformerEncoderLayer, AdamW")
