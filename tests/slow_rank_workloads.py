"""Split workloads whose one rank is slowed, to measure ranks that drift apart.

The rank named by ``AUTOFIT_TEST_SLOW_RANK`` (inherited by the rank processes) sleeps
``AUTOFIT_TEST_SLOW_S`` before each layer's forward and backward, each loss and each optimizer
step, so the other ranks run ahead and wait in collectives (or for their neighbour stage)
while holding whatever they hold.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from autofit.workloads.base import Workload
from autofit.workloads.load import load_workload

_SIBLING = Path(__file__).with_name("fsdp_workloads.py")


def _sleep(*_args) -> None:
    slow = int(os.environ.get("AUTOFIT_TEST_SLOW_RANK", "-1"))
    if dist.is_initialized() and dist.get_rank() == slow:
        time.sleep(float(os.environ.get("AUTOFIT_TEST_SLOW_S", "0.02")))


def _sleep_in_backward(_module, _args, output) -> None:
    # a hook on the output tensor (not a backward module hook, which would wrap the output in a
    # new tensor and break the layers' chain that checkpoint segments rely on)
    if isinstance(output, torch.Tensor) and output.requires_grad:
        output.register_hook(lambda _grad: _sleep())


def _slowed(workload: Workload, name: str) -> Workload:
    make = workload.model

    def model() -> nn.Module:
        m = make()
        for layer in workload.layers(m):
            layer.register_forward_pre_hook(_sleep)
            layer.register_forward_hook(_sleep_in_backward)
        return m

    loss, optimizer = workload.loss, workload.optimizer

    def slow_loss(outputs, targets):
        _sleep()  # pipeline stages are traced graphs without the hooks: the loss slows the last stage
        return loss(outputs, targets)

    def slow_optimizer(params):
        opt = optimizer(params)
        opt.register_step_pre_hook(lambda *_: _sleep())  # and the step slows the first
        return opt

    return dataclasses.replace(workload, name=name, model=model, loss=slow_loss, optimizer=slow_optimizer)


def slow_odd_mlp() -> Workload:
    return _slowed(load_workload(f"{_SIBLING}:odd_mlp"), "slow-odd-mlp")


def slow_tiny_decoder() -> Workload:
    return _slowed(load_workload(f"{_SIBLING}:tiny_decoder"), "slow-tiny-decoder")


def slow_small_resnet() -> Workload:
    return _slowed(load_workload(f"{_SIBLING}:small_resnet"), "slow-small-resnet")


def slow_deeper_decoder() -> Workload:
    """tiny_decoder with a fourth block: a pipeline over 4 stages needs 4 layers."""
    decoder = load_workload(f"{_SIBLING}:tiny_decoder")
    make = decoder.model

    def model() -> nn.Module:
        m = make()
        m.blocks.append(type(m.blocks[0])())
        return m

    return _slowed(dataclasses.replace(decoder, name="deeper-decoder", model=model), "slow-deeper-decoder")
