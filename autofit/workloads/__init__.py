"""Built-in workloads: name → zero-argument factory returning a :class:`autofit.Workload`.

``--model NAME`` resolves here (see :func:`autofit.workloads.load.load_workload`).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from autofit.workloads.base import Workload
from autofit.workloads.convnet import convnet_workload
from autofit.workloads.gpt import GPT, PRESETS, GPTConfig, gpt_preset, gpt_workload
from autofit.workloads.lstm import lstm_workload

BUILTINS: dict[str, Callable[[], Workload]] = {
    **{name: functools.partial(gpt_preset, name) for name in PRESETS},
    "convnet-bn": convnet_workload,
    "lstm-lm": lstm_workload,
}

# What the search command trains when no --model is given: a CPU step takes well under 0.2 s.
DEFAULT_WORKLOAD = "gpt-tiny"


def param_count(workload: Workload) -> int:
    """Exact number of distinct parameters (tied weights once), built on the meta device: no memory, no init cost."""
    with torch.device("meta"):
        model = workload.model()
    return sum(p.numel() for p in model.parameters())


def list_models() -> list[dict]:
    """One dict per built-in: ``name``, ``param_count``, ``description``, ``kind``.

    Example: ``{"name": "gpt2", "param_count": 124439808, "description": "GPT-2 small ...",
    "kind": "transformer"}``. Fast: models are built on the meta device.
    """
    rows = []
    for name, factory in BUILTINS.items():
        workload = factory()
        rows.append({"name": name, "param_count": param_count(workload),
                     "description": workload.description, "kind": workload.meta.get("kind", "other")})
    return rows


__all__ = ["BUILTINS", "DEFAULT_WORKLOAD", "GPT", "GPTConfig", "gpt_preset", "gpt_workload", "list_models",
           "param_count"]
