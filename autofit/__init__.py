"""autofit: find the fastest way to train a PyTorch model inside a memory budget.

The launcher API (``search``, ``estimate``, ``measure`` and their result types) is imported
lazily: ``import autofit`` stays cheap for the command line and for trial processes.
"""

from autofit.core.budget import format_budget, parse_budget
from autofit.core.config import Precision, TrainConfig
from autofit.core.errors import (
    AutofitError,
    BudgetError,
    ConfigError,
    SpaceError,
    StudyError,
    WorkloadError,
)

__version__ = "0.1.0"

_LAZY = {
    "search": "autofit.api", "estimate": "autofit.api", "measure": "autofit.api", "export": "autofit.report.exports",
    "SearchResult": "autofit.report.result", "SearchProgress": "autofit.study",
    "TrainingPlan": "autofit.trial.apply", "TrainingRun": "autofit.trial.apply",
    "hf_workload": "autofit.workloads.hf", "Workload": "autofit.workloads.base", "load_workload": "autofit.workloads.load",
    "size": "autofit.sizing.size", "SizeResult": "autofit.sizing.size",
}

__all__ = [
    "AutofitError", "BudgetError", "ConfigError", "Precision", "SearchProgress", "SearchResult", "SizeResult", "SpaceError",
    "StudyError", "TrainConfig", "TrainingPlan", "TrainingRun", "Workload", "WorkloadError", "estimate", "export",
    "format_budget", "hf_workload", "load_workload", "measure", "parse_budget", "search", "size",
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'autofit' has no attribute {name!r}")
