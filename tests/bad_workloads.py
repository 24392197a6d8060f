"""Workload functions that misbehave, for tests/cli/test_bad_input.py (``tests/bad_workloads.py:NAME``)."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from autofit.workloads.base import Workload

DIM = 16


class Net(nn.Module):
    def __init__(self, depth: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(depth))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Flat(nn.Module):
    """No ModuleList: nothing to checkpoint or split."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x):
        return self.fc(x)


def _batch(n: int):
    return torch.randn(n, DIM), torch.randn(n, DIM)


def _workload(name="bad", model=Net, batch=_batch, loss=F.mse_loss) -> Workload:
    return Workload(name=name, model=model, batch=batch, loss=loss)


def raises() -> Workload:
    raise RuntimeError("dataset path not configured")


def wrong_type():
    return {"model": Net}


def exits() -> Workload:
    sys.exit(3)


def bad_shapes() -> Workload:
    return _workload("bad-shapes", batch=lambda n: (torch.randn(n, DIM + 3), torch.randn(n, DIM)))


def nonscalar_loss() -> Workload:
    return _workload("nonscalar", loss=lambda out, target: (out - target) ** 2)


def no_layers() -> Workload:
    return _workload("flat", model=Flat)


def frozen() -> Workload:
    def model():
        net = Net()
        net.requires_grad_(False)
        return net
    return _workload("frozen", model=model)


def optimizer_reads_values() -> Workload:
    """ASGD's step reads a tensor's value (``.item()``): it cannot run on fake tensors."""
    return Workload(name="asgd", model=Net, batch=_batch, loss=F.mse_loss,
                    optimizer=lambda params: torch.optim.ASGD(params, lr=0.01))


def optimizer_needs_closure() -> Workload:
    """LBFGS's step takes a closure that re-evaluates the loss: autofit's step calls step() once."""
    return Workload(name="lbfgs", model=Net, batch=_batch, loss=F.mse_loss,
                    optimizer=lambda params: torch.optim.LBFGS(params))


def one_tensor_batch() -> Workload:
    return _workload("one-tensor", batch=lambda n: torch.randn(n, DIM))


def model_instance() -> Workload:
    return Workload(name="instance", model=Net(), batch=_batch, loss=F.mse_loss)


def optimizer_instance() -> Workload:
    return Workload(name="instance", model=Net, batch=_batch, loss=F.mse_loss,
                    optimizer=torch.optim.SGD(Net().parameters(), lr=0.1))


def model_returns_none() -> Workload:
    return _workload("no-model", model=lambda: None)


def layers_not_a_list() -> Workload:
    return Workload(name="one-layer", model=Net, batch=_batch, loss=F.mse_loss, layers=lambda m: m.blocks[0])


def fine() -> Workload:
    return _workload("fine")


not_a_function = 42
