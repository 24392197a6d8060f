"""Search spaces: TOML files listing the values of each TrainConfig dimension."""

from __future__ import annotations

import itertools
import math
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from autofit.core.config import (
    CheckpointPolicy,
    Offload,
    OptimizerChoice,
    Precision,
    SplitMode,
    TrainConfig,
)
from autofit.core.errors import AutofitError, SpaceError

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_SPACE = "default"
MAX_CONFIGS = 100_000  # the estimate scores this many in seconds; more is a typo or a space to narrow
_DIMENSIONS = ("precision", "micro_batch", "grad_accum", "checkpoint_every", "device_split", "split_mode",
               "optimizer", "checkpoint_policy", "offload")
_ENUMS = {"precision": Precision, "split_mode": SplitMode, "optimizer": OptimizerChoice,
          "checkpoint_policy": CheckpointPolicy, "offload": Offload}
_KEYS = set(_DIMENSIONS) | {"global_batch", "description"}


@dataclass(frozen=True)
class SearchSpace:
    """The values of each dimension. With ``global_batch`` set, ``grad_accum`` is derived as
    ``global_batch / micro_batch`` (``global_batch / (micro_batch × device_split)`` under fsdp,
    where every rank runs a micro-batch) and only configs that divide it evenly are kept.
    ``device_split = 1`` is one device whatever the split mode: it is listed once, as pipeline;
    likewise ``checkpoint_every = 0`` checkpoints nothing whatever the policy: listed once, as full.
    ``optimizer`` values other than ``as-given`` change the training (opt-in: the ``lean`` space)."""

    precision: tuple[Precision, ...]
    micro_batch: tuple[int, ...]
    grad_accum: tuple[int, ...] = (1,)
    checkpoint_every: tuple[int, ...] = (0,)
    device_split: tuple[int, ...] = (1,)
    split_mode: tuple[SplitMode, ...] = (SplitMode.PIPELINE,)
    optimizer: tuple[OptimizerChoice, ...] = (OptimizerChoice.AS_GIVEN,)
    checkpoint_policy: tuple[CheckpointPolicy, ...] = (CheckpointPolicy.FULL,)
    offload: tuple[Offload, ...] = (Offload.NONE,)
    global_batch: int | None = None
    source: str = "<inline>"

    def configs(self) -> list[TrainConfig]:
        """Every config in the space, in a stable order."""
        out = []
        for prec, mb, ga, ck, ds, mode, opt, policy, offload in itertools.product(
            self.precision, self.micro_batch, self.grad_accum, self.checkpoint_every, self.device_split,
            self.split_mode, self.optimizer, self.checkpoint_policy, self.offload,
        ):
            mode = mode if ds > 1 else SplitMode.PIPELINE
            ranks = ds if mode is SplitMode.FSDP else 1
            if self.global_batch is not None:
                if self.global_batch % (mb * ranks):
                    continue
                ga = self.global_batch // (mb * ranks)
            out.append(TrainConfig(prec, mb, ga, ck, ds, mode, opt, policy, offload))
        # a fixed global batch collapses the grad_accum axis; no checkpointing, the policy axis
        return list(dict.fromkeys(out))

    def with_global_batch(self, global_batch: int) -> "SearchSpace":
        """This space with a fixed global batch (validated as if it were in the file)."""
        data = {d: [getattr(v, "value", v) for v in getattr(self, d)] for d in _DIMENSIONS}
        data["global_batch"] = global_batch
        return space_from_dict(data, self.source)

    def __len__(self) -> int:
        return len(self.configs())


def _values(data: dict, key: str, source: str, kind) -> tuple:
    values = data[key] if isinstance(data[key], list) else [data[key]]
    if not values:
        raise SpaceError(f"{source}: key {key!r} is an empty list; give at least one value")
    try:
        if kind in _ENUMS.values():
            return tuple(dict.fromkeys(kind(str(v).lower()) for v in values))
        parsed = tuple(v for v in values if isinstance(v, int) and not isinstance(v, bool))
        if len(parsed) != len(values):
            raise ValueError
    except ValueError:
        expected = ", ".join(p.value for p in kind) if kind in _ENUMS.values() else "integers"
        raise SpaceError(f"{source}: key {key!r} has invalid values {values!r}; expected {expected}") from None
    return tuple(dict.fromkeys(parsed))


def space_from_dict(data: dict, source: str = "<inline>") -> SearchSpace:
    """Validate a parsed TOML mapping. Raises SpaceError naming ``source`` and the key."""
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise SpaceError(f"{source}: unknown key {unknown[0]!r}; expected {', '.join(sorted(_KEYS))}")
    for key in ("precision", "micro_batch"):
        if key not in data:
            raise SpaceError(f"{source}: missing key {key!r}")
    values = {d: _values(data, d, source, _ENUMS.get(d, int)) for d in _DIMENSIONS if d in data}
    global_batch = data.get("global_batch")
    if global_batch is not None:
        if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
            raise SpaceError(f"{source}: key 'global_batch' must be a positive integer, got {global_batch!r}")
        divisors = tuple(mb for mb in values["micro_batch"] if global_batch % mb == 0)
        if not divisors:
            raise SpaceError(
                f"{source}: key 'global_batch' = {global_batch} is divided by no micro_batch in {list(values['micro_batch'])}"
            )
        values["micro_batch"] = divisors
        values["grad_accum"] = (1,)  # derived per micro-batch in configs()
    n_configs = math.prod(len(v) for v in values.values())
    if n_configs > MAX_CONFIGS:  # answer in seconds, or not at all: say why
        raise SpaceError(f"{source}: {n_configs:,} configs; at most {MAX_CONFIGS:,} are accepted "
                         f"(sizes {', '.join(f'{k} {len(v)}' for k, v in values.items())}): narrow a dimension")
    space = SearchSpace(**values, global_batch=global_batch, source=source)
    try:
        configs = space.configs()
    except AutofitError as exc:
        raise SpaceError(f"{source}: {exc}") from None
    if not configs:
        raise SpaceError(f"{source}: key 'global_batch' = {global_batch} is divided by no micro_batch × fsdp ranks")
    return space


def builtin_spaces() -> dict[str, Traversable]:
    """The spaces shipped inside the package (``autofit/search_spaces/*.toml``), by name.

    Read through importlib.resources, so they are found in a wheel install, an editable
    install and a source checkout alike.
    """
    folder = resources.files("autofit").joinpath("search_spaces")
    return {f.name.removesuffix(".toml"): f for f in folder.iterdir() if f.name.endswith(".toml")}


def load_space(path: str | Path | None = None) -> SearchSpace:
    """Load a search space: a path to a TOML file, or the name of a built-in space
    (:func:`builtin_spaces`; default: ``default``). An existing path wins over a name.

    Raises SpaceError for a missing file, bad TOML, unknown keys, empty lists or a global
    batch no micro-batch divides.
    """
    builtin = builtin_spaces()
    name = str(path) if path is not None else DEFAULT_SPACE
    source: Path | Traversable
    if path is not None and (Path(path).exists() or Path(path).suffix):
        source = Path(path)
    elif name in builtin:
        source = builtin[name]
    else:
        raise SpaceError(f"{name}: no such search-space file; give a TOML path or one of {', '.join(sorted(builtin))}")
    if not source.is_file():
        raise SpaceError(f"{source}: no such search-space file")
    try:
        data = tomllib.loads(source.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise SpaceError(f"{source}: not valid TOML ({exc})") from None
    return space_from_dict(data, str(source))


def configs_as_arrays(configs: list[TrainConfig]) -> dict[str, np.ndarray]:
    """Column arrays of the config fields (enums as their string values), for vectorized scoring."""
    return {
        "precision": np.array([c.precision.value for c in configs]),
        "micro_batch": np.array([c.micro_batch for c in configs], dtype=np.int64),
        "grad_accum": np.array([c.grad_accum for c in configs], dtype=np.int64),
        "checkpoint_every": np.array([c.checkpoint_every for c in configs], dtype=np.int64),
        "device_split": np.array([c.device_split for c in configs], dtype=np.int64),
        "split_mode": np.array([c.split_mode.value for c in configs]),
        "optimizer": np.array([c.optimizer.value for c in configs]),
        "checkpoint_policy": np.array([c.checkpoint_policy.value for c in configs]),
    }
