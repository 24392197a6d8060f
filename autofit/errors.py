"""Exceptions a user can cause. The CLI prints their message on one line and exits 2."""


class AutofitError(Exception):
    """Base class for every error caused by user input (budgets, configs, spaces, workloads)."""


class BudgetError(AutofitError, ValueError):
    """A memory budget string that cannot be parsed."""


class ConfigError(AutofitError, ValueError):
    """An invalid TrainConfig value or override string."""


class SpaceError(AutofitError, ValueError):
    """A search-space file that is missing, malformed or inconsistent."""


class WorkloadError(AutofitError, ValueError):
    """A --model value that does not resolve to a usable Workload."""


class StudyError(AutofitError, ValueError):
    """A study that cannot be created, resumed or read."""
