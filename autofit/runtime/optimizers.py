"""The ``optimizer`` lever: train with the workload's own optimizer, or with one whose state is smaller.

A config's ``optimizer`` (:class:`~autofit.core.config.OptimizerChoice`) is applied by
:func:`autofit.runtime.training.apply_config` right after the workload's optimizer is made, through
:func:`replace_optimizer`, so the profiler (on fake tensors), the trials and a user's loop
(:class:`autofit.trial.apply.TrainingPlan`) all train with the same object:

- ``as-given``: the workload's optimizer, untouched;
- ``adafactor``: ``torch.optim.Adafactor`` (Shazeer and Stern 2018): for a parameter of two or
  more dimensions a row and a column statistic of its second moment (factored over the last two
  dimensions), for a vector the full second moment; no first moment. Each parameter group keeps
  its learning rate (torch's Adafactor reads it as the relative step size cap) and weight decay;
- ``adamw8bit``: bitsandbytes' blockwise 8-bit Adam, ``bnb.optim.AdamW8bit`` for an AdamW and
  ``bnb.optim.Adam8bit`` for an Adam (bitsandbytes decays weights decoupled, as AdamW, in both):
  each moment in one byte per element plus an fp32 scale per block of 256, for parameters of at
  least 4096 elements (smaller ones keep fp32 moments). Each group keeps its learning rate, betas,
  eps and weight decay.

Which optimizers can be replaced: ``torch.optim.Adam`` and ``torch.optim.AdamW`` themselves (not
subclasses, which may change the update), without ``amsgrad`` or ``maximize`` (neither replacement
has them). The replacements are Adam-family optimizers with the same hyper-parameters; any other
optimizer (SGD with momentum, RMSprop, a user's own) would be swapped for a different algorithm,
so its configs with another ``optimizer`` than ``as-given`` are refused (:func:`refusal`) and the
estimate prunes them with that reason.

bitsandbytes rather than torchao: both install from PyPI with this PyTorch and both step on the
CPU, but torchao's ``AdamW8bit``/``AdamW4bit`` compile their step with ``torch.compile`` on first
use, a compilation every short trial would pay again in its own fresh process (most of a CPU trial's
time), and a compiled step cannot be traced on fake tensors. bitsandbytes' 8-bit step runs eagerly
on the CPU (its CPU backend) and on CUDA, registers fake kernels for its optimizer operators, so the
profile runs it on fake tensors, and is the Hugging Face Trainer's ``adamw_bnb_8bit``. It has no
4-bit optimizer, and torchao's ``AdamW4bit`` cannot step on fake tensors, so there is no ``adamw4bit``
choice (docs/facts.md#4-bit-optimizers). It is the ``autofit[optim]`` extra; without it,
``adamw8bit`` configs are pruned, saying so (:func:`missing_library`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from typing import Iterator

import torch

from autofit.core.config import OptimizerChoice
from autofit.core.errors import WorkloadError

__all__ = ["REPLACEABLE", "cpu_kernel_bytes", "missing_library", "refusal", "replace_optimizer", "scalar_stand_ins"]

# The optimizers the lever may replace, by class name (a profile records its optimizer's class name).
REPLACEABLE = ("Adam", "AdamW")
# bitsandbytes quantizes a tensor's moments only from this many elements on (its ``min_8bit_size``).
BNB_MIN_8BIT_SIZE = 4096
_INSTALL = "pip install 'autofit[optim]'"


def missing_library(choice: OptimizerChoice | str) -> str | None:
    """Why ``choice`` cannot be built in this environment (its library is not installed), else None."""
    if OptimizerChoice(choice) is OptimizerChoice.ADAMW8BIT and importlib.util.find_spec("bitsandbytes") is None:
        return f"optimizer=adamw8bit needs bitsandbytes, which is not installed: {_INSTALL}"
    return None


def refusal(choice: OptimizerChoice | str, optimizer_name: str) -> str | None:
    """Why the lever cannot replace a workload optimizer of class ``optimizer_name`` with ``choice`` (None: it can)."""
    choice = OptimizerChoice(choice)
    if choice is OptimizerChoice.AS_GIVEN or optimizer_name in REPLACEABLE:
        return None
    return (f"the workload's optimizer is {optimizer_name}: optimizer={choice.value} would change the training "
            f"(only {' and '.join(f'torch.optim.{n}' for n in REPLACEABLE)} are replaced)")


def _check_replaceable(choice: OptimizerChoice, base: torch.optim.Optimizer) -> None:
    name = type(base).__name__
    if type(base) not in (torch.optim.Adam, torch.optim.AdamW):
        raise WorkloadError(refusal(choice, name if name not in REPLACEABLE else f"{type(base).__module__}.{name}")
                            or f"optimizer={choice.value}: cannot replace {name}")
    for group in base.param_groups:
        for flag in ("amsgrad", "maximize"):
            if group.get(flag):
                raise WorkloadError(f"the workload's {name} has {flag}=True, which optimizer={choice.value} does not "
                                    f"have: it would change the training; use optimizer=as-given")


def replace_optimizer(choice: OptimizerChoice | str, base: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer a config trains with: ``base`` for ``as-given``, else its replacement over the same
    parameter groups (their hyper-parameters carried over, see the module docstring).

    Works on fake tensors too (the profiler's): bitsandbytes builds its quantization maps from Python
    lists, which fake tensors cannot do, so it is built outside the fake mode and its maps made fake.
    Raises WorkloadError when ``base`` cannot be replaced (:func:`refusal`) or the library is missing.
    """
    choice = OptimizerChoice(choice)
    if choice is OptimizerChoice.AS_GIVEN:
        return base
    _check_replaceable(choice, base)
    if (missing := missing_library(choice)) is not None:
        raise WorkloadError(missing)
    if choice is OptimizerChoice.ADAFACTOR:
        groups = [{"params": g["params"], "lr": float(g["lr"]), "weight_decay": g["weight_decay"]}
                  for g in base.param_groups]
        return torch.optim.Adafactor(groups)
    groups = [{"params": g["params"], "lr": float(g["lr"]), "betas": tuple(g["betas"]), "eps": g["eps"],
               "weight_decay": g["weight_decay"]} for g in base.param_groups]
    bnb = _bitsandbytes()
    kind = bnb.optim.AdamW8bit if isinstance(base, torch.optim.AdamW) else bnb.optim.Adam8bit
    fake_mode = _fake_mode(base)
    if fake_mode is None:
        return kind(groups)
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        optimizer = kind(groups)
    optimizer.name2qmap = {k: fake_mode.from_tensor(v) for k, v in optimizer.name2qmap.items()}
    return optimizer


def _bitsandbytes():
    # bitsandbytes logs a warning on import where an optional CPU kernel package is missing (for its
    # 4-bit matmuls, which autofit does not use): not the user's concern.
    logger = logging.getLogger("bitsandbytes")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        import bitsandbytes
    finally:
        logger.setLevel(level)
    return bitsandbytes


def _fake_mode(optimizer: torch.optim.Optimizer):
    from torch._subclasses.fake_tensor import FakeTensor

    for group in optimizer.param_groups:
        for p in group["params"]:
            if isinstance(p, FakeTensor):
                return p.fake_mode
    return None


def cpu_kernel_bytes(choice: OptimizerChoice | str, numel: int, element_size: int) -> int:
    """Bytes bitsandbytes' CPU kernel allocates inside one parameter's step, beyond its state (0 for the
    other choices, whose steps are torch operators the profile sees).

    Its 8-bit step on the CPU (``_optimizer_update_8bit_blockwise_cpu``) is Python over torch operators,
    run inside one custom operator, where no dispatch mode sees them (neither the fake profile nor the
    CPU tracker; the CPU allocator does): both moments dequantized to fp32, the scaled gradient in fp32,
    the parameter in fp32 where it is not, and the update's denominator (a square root, then a division):
    4 bytes x (5, or 6 for a bf16 parameter) per element at the most. The 32-bit path of tensors under
    4096 elements is the same without the dequantization: fewer. On CUDA the step is one fused kernel."""
    if OptimizerChoice(choice) is not OptimizerChoice.ADAMW8BIT:
        return 0
    return 4 * numel * (5 if element_size == 4 else 6)


class _ScalarStandIns:
    """Answers ``.item()`` of a fake tensor with 1 (see :func:`scalar_stand_ins`)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten._local_scalar_dense.default and _is_fake(args[0]):
                    t = args[0]
                    return True if t.dtype is torch.bool else 1.0 if t.is_floating_point() else 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode()


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


# Optimizers whose step reads tensors' values (``.item()``) only into arithmetic on step sizes, never
# into a shape or a branch that allocates: torch's Adafactor reads its step count and two norms.
_READS_SCALARS = (torch.optim.Adafactor,)


@contextlib.contextmanager
def scalar_stand_ins(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Around a step of ``optimizer`` on fake tensors: where it is one whose step reads values only for
    arithmetic (torch's Adafactor: ``step.item()``, ``norm().item()``), each such read is answered with
    1, which fake tensors cannot answer, so its step runs and allocates what it would. A no-op for any
    other optimizer (it fails on fake tensors as before, and the profile says why)."""
    if type(optimizer) not in _READS_SCALARS:
        yield
        return
    with _ScalarStandIns().mode:
        yield
