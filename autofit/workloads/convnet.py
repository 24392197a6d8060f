"""``convnet-bn``: a small ResNet-style CIFAR-10 classifier with BatchNorm.

Three stages of residual basic blocks (widths 32/64/128, stride-2 downsampling into stages
2 and 3), so layers differ in shape and activation size — unlike a transformer's identical
blocks. Trained with SGD + momentum (one state tensor per parameter, not AdamW's two).

Known limitation: under activation checkpointing the recomputed forward updates BatchNorm's
running statistics a second time (PyTorch's documented checkpoint behaviour); it changes no
gradients and no memory or speed figure.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autofit.workloads.base import Workload

NUM_CLASSES = 10
IMAGE_SHAPE = (3, 32, 32)


def _conv_bn(c_in: int, c_out: int, kernel: int, stride: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, bias=False),
                         nn.BatchNorm2d(c_out))


class BasicBlock(nn.Module):
    """ResNet basic block: relu(bn(conv(relu(bn(conv(x))))) + shortcut(x)); (B, c_in, H, W) → (B, c_out, H/s, W/s)."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__()
        self.conv1 = _conv_bn(c_in, c_out, 3, stride)
        self.conv2 = _conv_bn(c_out, c_out, 3, 1)
        # 1x1 projection when the shape changes, identity otherwise
        self.shortcut = _conv_bn(c_in, c_out, 1, stride) if stride != 1 or c_in != c_out else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.conv1(x))
        return F.relu(self.conv2(out) + self.shortcut(x))


class ResNetCifar(nn.Module):
    """Images (B, 3, 32, 32) → class logits (B, 10)."""

    def __init__(self, widths: tuple[int, ...] = (32, 64, 128), blocks_per_stage: int = 2):
        super().__init__()
        self.stem = nn.Sequential(_conv_bn(IMAGE_SHAPE[0], widths[0], 3, 1), nn.ReLU())
        blocks, c_in = [], widths[0]
        for stage, width in enumerate(widths):
            for index in range(blocks_per_stage):
                stride = 2 if stage > 0 and index == 0 else 1
                blocks.append(BasicBlock(c_in, width, stride))
                c_in = width
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(c_in, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def _batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, *IMAGE_SHAPE), torch.randint(NUM_CLASSES, (n,))


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=5e-4)


def convnet_workload() -> Workload:
    """The ``convnet-bn`` Workload: random CIFAR-shaped images and labels, cross-entropy, SGD."""
    return Workload(
        name="convnet-bn", model=ResNetCifar, batch=_batch, loss=F.cross_entropy, optimizer=_sgd,
        layers=lambda model: model.blocks,
        description="ResNet-style CIFAR-10 net with BatchNorm: 6 basic blocks, widths 32/64/128, SGD momentum",
        meta={"kind": "convnet", "widths": [32, 64, 128], "blocks_per_stage": 2, "image_shape": list(IMAGE_SHAPE)},
    )
