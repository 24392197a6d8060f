"""A small ResNet written as a user would write it in a file, trained with SGD (Nesterov momentum, weight decay).

Not a built-in: ``autofit bench`` loads it as ``--model path/to/resnet.py:workload`` to check the
estimator on residual convolution blocks with BatchNorm whose output is a ReLU's (its backward keeps
that output: a pipeline stage ending with such a block holds it, and its gradient, through the block's
backward), on an optimizer other than Adam.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autofit import Workload

IMAGE, CHANNELS, CLASSES, WIDTH = 32, 3, 10, 32


class BasicBlock(nn.Module):
    """conv-BN-ReLU-conv-BN, added to the input, then ReLU."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


class ResNet(nn.Module):
    def __init__(self, width: int = WIDTH, depth: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(CHANNELS, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU())
        self.blocks = nn.Sequential(*(BasicBlock(width) for _ in range(depth)))
        self.head = nn.Linear(width, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # (B, 3, 32, 32) -> (B, classes)
        x = self.blocks(self.stem(images))
        return self.head(x.mean(dim=(2, 3)))


def batch(n: int):
    return torch.randn(n, CHANNELS, IMAGE, IMAGE), torch.randint(0, CLASSES, (n,))


def workload() -> Workload:
    return Workload(name="user-resnet", model=ResNet, batch=batch, loss=F.cross_entropy,
                    optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True,
                                                             weight_decay=5e-4),
                    layers=lambda model: model.blocks, description="ResNet basic blocks with BatchNorm, SGD Nesterov")
