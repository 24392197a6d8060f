"""autofit: find the fastest way to train a PyTorch model inside a memory budget."""

from autofit.budget import format_budget, parse_budget
from autofit.config import Precision, TrainConfig
from autofit.errors import AutofitError, BudgetError, ConfigError, SpaceError, StudyError, WorkloadError
from autofit.workload import Workload, load_workload

__version__ = "0.1.0"

__all__ = [
    "AutofitError", "BudgetError", "ConfigError", "Precision", "SpaceError", "StudyError",
    "TrainConfig", "Workload", "WorkloadError", "format_budget", "load_workload", "parse_budget",
]
