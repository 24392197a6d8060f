"""The ``offload`` lever: the optimizer's state, and its step, on the host (CUDA only).

``offload=optimizer`` wraps the optimizer a config trains with (the workload's Adam or AdamW, or the
``optimizer`` lever's Adafactor) in torchao's ``CPUOffloadOptimizer``
(``torchao/optim/cpu_offload.py``): every trainable parameter of at least
:data:`MIN_OFFLOAD_NUMEL` elements gets a pinned host copy and a pinned host gradient; a hook copies
its gradient to the host on a side stream as backward accumulates it, the parameter's own optimizer
steps there on the host copy, and the result is copied back into the device parameter in place. The
smaller parameters (norms, biases) keep an optimizer of the same class on the device. So the device
keeps the weights, the gradients and the small parameters' state; the host keeps two pinned copies of
the large parameters and their state.

torchao rather than a wrapper of our own: it is PyTorch's own library for this (the same authors as
FSDP2's ``CPUOffloadPolicy``), installs from PyPI without dependencies, imports with this PyTorch, and
overlaps the gradient copies with backward, which a hand-written wrapper would have to get right
again. It asserts a CUDA (or XPU) device: on the CPU the lever means nothing, and such configs are
pruned before they run (:mod:`autofit.estimator.offload_memory`).

What is not combined, each pruned with its reason (:func:`refusal`): amp-fp16, whose GradScaler would
unscale and check the host gradients the side stream writes; adamw8bit (bitsandbytes' state is a
quarter of Adam's already, and its host step is not wired); FSDP ranks (FSDP2's ``CPUOffloadPolicy``
offloads the sharded parameters and gradients too: another lever, and another memory model).
"""

from __future__ import annotations

import importlib.util

import torch

from autofit.core.config import Offload, OptimizerChoice, Precision, SplitMode, TrainConfig
from autofit.core.errors import WorkloadError

__all__ = ["MIN_OFFLOAD_NUMEL", "OFFLOADABLE", "apply_offload", "missing_library", "offload_optimizer", "refusal",
           "release_offloaded"]

# torchao's ``minimal_size``: smaller parameters stay on the device, with their state (copying many
# tiny tensors costs more than their state saves).
MIN_OFFLOAD_NUMEL = 4096
# The optimizer classes the lever wraps, by name: torch's own, whose constructors take a parameter
# group with every hyper-parameter in it (torchao builds one optimizer per offloaded parameter).
OFFLOADABLE = ("Adam", "AdamW", "Adafactor")
_INSTALL = "pip install 'autofit[offload]'"
# Flags that choose a device's implementation: the host optimizer picks its own.
_DEVICE_FLAGS = ("foreach", "fused", "capturable", "differentiable")


def missing_library() -> str | None:
    """Why ``offload=optimizer`` cannot be built here (torchao is not installed), else None."""
    if importlib.util.find_spec("torchao") is None:
        return f"offload=optimizer needs torchao, which is not installed: {_INSTALL}"
    return None


def refusal(config: TrainConfig, optimizer_name: str, device_type: str) -> str | None:
    """Why ``config``'s offload cannot run where the workload's optimizer is of class ``optimizer_name``
    and the trials run on ``device_type`` (None: it can, or it offloads nothing)."""
    if config.offload is Offload.NONE:
        return None
    if device_type != "cuda":
        return (f"offload=optimizer keeps the optimizer's state on the host: on device {device_type} it is "
                "there already, so the lever means nothing (use offload=none)")
    if config.split_mode is SplitMode.FSDP and config.device_split > 1:
        return ("offload=optimizer with split_mode=fsdp: FSDP2's CPUOffloadPolicy would offload the sharded "
                "parameters and gradients too, which autofit does not model; use one device or a pipeline split")
    if config.precision is Precision.AMP_FP16:
        return ("offload=optimizer with amp-fp16: the GradScaler would unscale and check the host gradients "
                "while the side stream writes them; use amp-bf16 or offload=none")
    if config.optimizer is OptimizerChoice.ADAMW8BIT:
        return ("offload=optimizer with optimizer=adamw8bit: not combined (the 8-bit state is a quarter of "
                "Adam's already, and bitsandbytes' host step is not wired); use one of them")
    if config.optimizer is OptimizerChoice.AS_GIVEN and optimizer_name not in OFFLOADABLE:
        return (f"the workload's optimizer is {optimizer_name}: offload=optimizer wraps only "
                f"{', '.join(f'torch.optim.{n}' for n in OFFLOADABLE)}")
    return missing_library()


def offload_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``optimizer``'s parameter groups, stepped on the host by torchao's ``CPUOffloadOptimizer`` (one
    optimizer of the same class per offloaded parameter, its hyper-parameters carried over). Build it
    before the first step: the state it makes is the host optimizers'. Raises WorkloadError when the
    class is not one the lever wraps or torchao is missing."""
    kind = type(optimizer)
    if kind not in (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adafactor):
        raise WorkloadError(f"offload=optimizer wraps only {', '.join(OFFLOADABLE)} (torch.optim), "
                            f"not {kind.__module__}.{kind.__name__}")
    if (missing := missing_library()) is not None:
        raise WorkloadError(missing)
    from torchao.optim import CPUOffloadOptimizer

    # copies: torchao pops each group's "params"
    groups = [{k: v for k, v in g.items() if k not in _DEVICE_FLAGS} for g in optimizer.param_groups]
    # the fused CPU kernels step Adam and AdamW in one pass, with no temporaries the size of a parameter
    fused = {"fused": True} if kind in (torch.optim.Adam, torch.optim.AdamW) else {}
    return CPUOffloadOptimizer(groups, optimizer_class=kind, minimal_size=MIN_OFFLOAD_NUMEL, **fused)


def apply_offload(config: TrainConfig, optimizer: torch.optim.Optimizer, device_type: str) -> torch.optim.Optimizer:
    """The optimizer ``config`` trains with on ``device_type``: ``optimizer`` itself with ``offload=none``,
    else offloaded (:func:`offload_optimizer`). Raises WorkloadError with the reason the estimate prunes
    such a config for (:func:`refusal`), e.g. on the CPU."""
    if config.offload is Offload.NONE:
        return optimizer
    why = refusal(config, type(optimizer).__name__, device_type)
    if why is not None:
        raise WorkloadError(why)
    return offload_optimizer(optimizer)


# torchao's CPUOffloadOptimizer attributes that hold the device parameters (keys) or their host copies.
_HOLDING = ("param_d2h_map", "optim_dict", "queue")


def release_offloaded(optimizer) -> None:
    """Let an offloading optimizer's parameters be freed once the model is dropped (a no-op for any other).

    Each offloaded parameter holds a gradient hook whose closure holds the optimizer, which maps the
    parameter to its host copy: a cycle through C++ (the hook lives in the tensor's autograd metadata) that
    Python's collector cannot see, so the weights and gradients of a finished trial would stay on the card
    and count towards the next trial of the same process (measured on an H200: about two parameter-sized
    fp32 tensors per earlier offloaded trial). Emptying the optimizer's maps breaks the cycle on its side.
    """
    for name in _HOLDING:
        held = getattr(optimizer, name, None)
        if isinstance(held, dict):
            held.clear()
