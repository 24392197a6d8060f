"""A search's settings: everything that defines one study and its limits, the same for every worker."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from autofit.core.config import FIELDS
from autofit.core.errors import StudyError
from autofit.core.space import SearchSpace, space_from_dict

PATIENCE = 5               # real trials in a row without improving the best by MIN_IMPROVEMENT
MIN_IMPROVEMENT = 0.02     # relative; below this an "improvement" is measurement noise
TRIAL_TIMEOUT_S = 180.0    # a trial's time limit never exceeds this (process start included)
JOURNAL_NAME = "study.journal"  # the default storage, in the output directory


@dataclass(frozen=True)
class StudySettings:
    """Everything that defines one search and its limits; the same for every worker (JSON-ready)."""

    workload_name: str
    workload_source: str | None
    budget_bytes: int
    budget_text: str
    space: dict                  # space dimensions, global_batch and source (space_from_dict's input)
    device_type: str
    devices: int                 # devices per worker (device splits above this are never run)
    study_name: str
    out_dir: str
    storage: str | None = None   # an Optuna storage URL; None: the journal file in out_dir
    seed: int = 0
    trials: int | None = None    # real trials in the study at most
    deadline: float | None = None  # time.time() after which no trial starts
    patience: int = PATIENCE
    min_improvement: float = MIN_IMPROVEMENT
    trial_timeout_s: float = TRIAL_TIMEOUT_S
    command: str | None = None   # the command line that started the search (for best.json)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "StudySettings":
        return cls(**json.loads(text))

    def search_space(self) -> SearchSpace:
        return space_from_dict({k: v for k, v in self.space.items() if k != "source"}, self.space.get("source", "<inline>"))


def space_to_dict(space: SearchSpace) -> dict:
    """A SearchSpace as the mapping :func:`autofit.core.space.space_from_dict` reads (plus its source)."""
    data: dict[str, Any] = {d: [getattr(v, "value", v) for v in getattr(space, d)] for d in FIELDS}
    if space.global_batch is not None:
        data["global_batch"] = space.global_batch
        data.pop("grad_accum")
    data["source"] = space.source
    return data


_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=-]*")


def check_study_name(name: str) -> str:
    """``name`` when it is a safe directory name (it becomes ``results/<name>``); StudyError otherwise."""
    if not _NAME_RE.fullmatch(name) or ".." in name:
        raise StudyError(f"invalid study name {name!r}: expected letters, digits and . _ - + = (no '/', no '..', "
                         "not starting with '.'), e.g. gpt-tiny-8GB")
    return name


def default_study_name(workload_name: str, budget_bytes: int) -> str:
    """``<workload>-<budget>``, the budget in the largest unit that divides it, e.g. ``gpt-tiny-8GB``
    (characters a directory name should not hold, e.g. the ``/`` of ``hf:org/name``, become ``-``)."""
    safe = re.sub(r"[^A-Za-z0-9._+=-]", "-", workload_name).replace("..", "-").lstrip(".-") or "study"
    for unit, size in (("TB", 10**12), ("TiB", 2**40), ("GB", 10**9), ("GiB", 2**30), ("MB", 10**6),
                       ("MiB", 2**20), ("KB", 10**3), ("KiB", 2**10)):
        if budget_bytes % size == 0:
            return f"{safe}-{budget_bytes // size}{unit}"
    return f"{safe}-{budget_bytes}B"


def redact(url: str | None) -> str | None:
    """A storage URL without its password: ``postgresql://user:***@host/db``."""
    return None if url is None else re.sub(r"(//[^:/@]+:)[^@/]*@", r"\1***@", url)
