"""Exceptions a user can cause. The CLI prints their message on one line and exits with their
``exit_status``: 2 for a usage error (what was typed or given), 1 for a run-time failure."""


class AutofitError(Exception):
    """Base class for every error caused by user input (budgets, configs, spaces, workloads)."""

    exit_status = 2


class BudgetError(AutofitError, ValueError):
    """A memory budget string that cannot be parsed."""


class ConfigError(AutofitError, ValueError):
    """An invalid TrainConfig value or override string."""


class SpaceError(AutofitError, ValueError):
    """A search-space file that is missing, malformed or inconsistent."""


class WorkloadError(AutofitError, ValueError):
    """A --model value that does not resolve to a usable Workload."""


class ProfileError(AutofitError, ValueError):
    """A profile that lacks what an estimate needs (e.g. made without split ends, asked for a pipeline split)."""


class StudyError(AutofitError, ValueError):
    """A study that cannot be created, resumed or read."""


class RunFailure(AutofitError):
    """Not the input but the surroundings: a storage that cannot be reached, a directory that
    cannot be written, another search running on the same directory. The CLI exits 1."""

    exit_status = 1
