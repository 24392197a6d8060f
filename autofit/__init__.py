"""autofit: find the fastest way to train a PyTorch model inside a memory budget.

The launcher API (``search``, ``estimate``, ``measure`` and their result types) is imported
lazily: ``import autofit`` stays cheap for the command line and for trial processes.
"""

from autofit.budget import format_budget, parse_budget
from autofit.config import Precision, TrainConfig
from autofit.errors import AutofitError, BudgetError, ConfigError, SpaceError, StudyError, WorkloadError
from autofit.workload import Workload, load_workload

__version__ = "0.1.0"

_LAZY = {
    "search": "autofit.api", "estimate": "autofit.api", "measure": "autofit.api", "export": "autofit.exports",
    "SearchResult": "autofit.report", "SearchProgress": "autofit.study",
    "TrainingPlan": "autofit.apply", "TrainingRun": "autofit.apply",
    "hf_workload": "autofit.hf",
    "size": "autofit.sizing", "SizeResult": "autofit.sizing",
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
