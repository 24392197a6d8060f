"""Hand a config to the trainer people use: Transformers, Accelerate, Lightning, DeepSpeed, torchrun.

``export(config, target)`` turns a :class:`TrainConfig` into what the target takes as it is:

- ``hf``: keyword arguments of ``transformers.TrainingArguments``;
- ``accelerate``: an Accelerate config file (YAML, for ``accelerate launch --config_file``);
- ``lightning``: keyword arguments of ``lightning.Trainer`` plus the data module's batch size;
- ``deepspeed``: a DeepSpeed config (JSON);
- ``torchrun``: the ``torchrun`` command that runs autofit's own pipeline runner
  (``scripts/run_split_torchrun.py``) for a config split over devices;
- ``json``: autofit's own config record.

A target that cannot say a setting exactly (checkpointing every k layers in the Trainer, pure
bf16 weights in Accelerate, a pipeline split in Lightning) gets a :class:`Note`: what it cannot
say, the nearest setting it can, that nearest setting's estimated peak (when the workload is
known), and the few lines of code that do it exactly. Notes travel in the export's ``comment``
field (``#`` lines in YAML and shell) so that nothing is dropped silently. A config whose
``optimizer`` lever replaces the workload's optimizer changes the training: its note comes first,
in every target (the Trainer's ``optim`` says it where it can: ``adamw_bnb_8bit``, ``adafactor``).

An export that trains differently from the config autofit measured -- another global batch
(samples per optimizer step), precision or optimizer -- says so first: a :class:`Change` per
difference, with by how much (``global batch 64 -> 8 (x0.125)``), at the top of the file
(``changes``, or ``# WARNING: this export changes the training: ...`` lines) and first on
stderr from ``autofit export``. Every target keeps the global batch where it can express it;
only an Accelerate config file cannot (it holds no gradient accumulation: the code is given).

Example::

    exp = autofit.export("precision=amp-bf16,micro_batch=8,grad_accum=4,checkpoint_every=1", "hf")
    args = transformers.TrainingArguments(**exp.kwargs)
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path
from typing import Any, Callable

from autofit.core.budget import parse_budget
from autofit.core.config import (
    FIELDS,
    Precision,
    TrainConfig,
)
from autofit.core.errors import AutofitError, ConfigError
from autofit.report.export_notes import (
    Change,
    Context,
    Export,
    Note,
    _batch_change,
    _precision_change,
)
from autofit.report.export_targets import (
    _accelerate,
    _deepspeed,
    _hf,
    _json,
    _lightning,
    _torchrun,
)

TARGETS = ("hf", "accelerate", "lightning", "deepspeed", "torchrun", "json")


_BUILDERS: dict[str, Callable[[TrainConfig, Context], tuple[Any, dict, list[Note], list[Change]]]] = {
    "hf": _hf, "accelerate": _accelerate, "lightning": _lightning, "deepspeed": _deepspeed,
    "torchrun": _torchrun, "json": _json,
}


# --- rendering ----------------------------------------------------------------------------------


def _yaml(data: dict, indent: int = 0) -> str:
    """Flat-ish YAML without a YAML library: JSON scalars are valid YAML."""
    lines = []
    for key, value in data.items():
        if isinstance(value, dict):
            lines.append(" " * indent + f"{key}:")
            lines.append(_yaml(value, indent + 2).rstrip("\n"))
        else:
            lines.append(" " * indent + f"{key}: {json.dumps(value)}")
    return "\n".join(lines) + "\n"


CHANGES_HEADER = "WARNING: this export changes the training: "


def _render(target: str, kwargs: Any, extra: dict, comment: list[str], changes: list[str] = ()) -> str:
    """The file: the changes first (``#`` lines, or a ``changes`` field when there are any), then the
    notes, then the target's own settings."""
    if target in ("accelerate", "torchrun"):
        head = "".join(f"# {CHANGES_HEADER}{line}\n" for line in changes) + "".join(f"# {line}\n" for line in comment)
        return head + (_yaml(kwargs) if target == "accelerate" else shlex.join(kwargs) + "\n")
    first = {"changes": list(changes)} if changes else {}
    if target == "hf":
        body = {**first, "comment": comment, "training_arguments": kwargs}
    elif target == "lightning":
        body = {**first, "comment": comment, "trainer": kwargs, **extra}
    else:  # deepspeed ignores unknown top-level keys; json is autofit's own record
        body = {**first, "comment": comment, **kwargs}
    return json.dumps(body, indent=2) + "\n"


# --- entry points ---------------------------------------------------------------------------------


def _together(config: TrainConfig, notes: list[Note]) -> list[Note]:
    """With two or more inexact settings: the config the target's own settings give with none of
    the notes' code, all nearest settings at once (its peak is what running the export as-is risks)."""
    nearest = [n.nearest_config for n in notes if n.nearest_config is not None and n.nearest_config != config]
    if len(nearest) < 2:
        return []
    changes: dict = {}
    for other in nearest:
        changes.update({f: getattr(other, f) for f in FIELDS if getattr(other, f) != getattr(config, f)})
    combined = dataclasses.replace(config, **changes)
    return [Note("all together", "the export as it is, without the code of the notes above",
                 nearest=combined.short(), nearest_config=combined)]


def _peaks(notes: list[Note], ctx: Context) -> list[Note]:
    """Fill each note's nearest-setting peak from autofit's estimate (one profile for all)."""
    wanted = [n.nearest_config for n in notes if n.nearest_config is not None]
    if not wanted or (ctx.workload is None and not ctx.model_spec and ctx.profile is None):
        return [dataclasses.replace(n, budget_bytes=ctx.budget_bytes) for n in notes]
    from autofit.estimator.memory_model import (
        needs_selective,
        needs_split_ends,
        optimizer_choices,
    )
    from autofit.estimator.memory_table import estimate_table
    from autofit.profiling.profile import profile_workload
    from autofit.workloads.load import load_workload

    precisions = sorted({c.precision for c in wanted}, key=str)
    split_ends = needs_split_ends(wanted)  # only where a note's config needs them (a search without splits skips them)
    optimizers = optimizer_choices(wanted)
    selective = needs_selective(wanted)
    try:
        profile = (ctx.profile if profile_covers(ctx.profile, precisions, split_ends, ctx.device_type, optimizers,
                                                 selective) else None)
        if profile is None:
            if ctx.workload is None and not ctx.model_spec:
                raise ConfigError(f"the profile given lacks {', '.join(p.value for p in precisions)} on {ctx.device_type} "
                                  "and no workload was given to profile")
            workload = ctx.workload if ctx.workload is not None else load_workload(ctx.model_spec)
            profile = profile_workload(workload, precisions, device_type=ctx.device_type, split_ends=split_ends,
                                       optimizers=optimizers, selective=selective)
    except AutofitError as exc:  # e.g. a cuda export on a CPU-only torch: the export itself still holds
        return [dataclasses.replace(n, budget_bytes=ctx.budget_bytes, no_peak_reason=str(exc)) for n in notes]
    table = estimate_table(profile, wanted, ctx.budget_bytes)
    peaks = iter(None if not row.valid else int(round(row.peak_bytes)) for row in table.itertuples())
    return [dataclasses.replace(n, budget_bytes=ctx.budget_bytes,
                                nearest_peak_bytes=next(peaks) if n.nearest_config is not None else None)
            for n in notes]


def profile_covers(profile: Any, precisions: list, split_ends: bool, device_type: str,
                   optimizers: list[str] = (), selective: bool = False) -> bool:
    """Whether ``profile`` (a Profile or None) estimates every one of ``precisions`` (with the untied
    ends a pipeline split needs when ``split_ends``, the ``optimizer`` lever's ``optimizers``, and the
    selective forwards when ``selective``) on ``device_type``."""
    if profile is None or profile.device_type != device_type:
        return False
    held = [profile.precisions.get(Precision(p).value) for p in precisions]
    return all(pp is not None and not (split_ends and pp.split_ends_skipped)
               and not (selective and pp.selective_skipped) and all(pp.optimizer_option(o) is not None for o in optimizers) for pp in held)


def export(config: TrainConfig | str | dict, target: str, *, workload: Any = None, budget: str | int | None = None,
           device: str | None = None, extra: dict | None = None, profile: Any = None,
           changes: tuple[Change, ...] = ()) -> Export:
    """``config`` in ``target``'s own form (one of :data:`TARGETS`).

    ``workload`` (a Workload or a ``--model`` spec) lets notes give the estimated peak of the
    nearest setting a target can express; ``budget`` says whether it fits; ``device`` is where
    training runs (``cuda`` or ``cpu``; default cuda when this torch sees a GPU). ``profile``: the
    workload's :class:`autofit.profiling.data.Profile` on that device when known (a study's,
    :func:`autofit.profiling.cache.study_profile`): the peaks come from it when it holds their
    precisions, without profiling the workload. ``changes``: changes made before the export (a
    study's best config overridden), said first with the target's own. Raises ConfigError for an
    unknown target or config, or a torchrun export of a config that does not split.

    The export's ``changes`` say how it trains differently from ``config`` (global batch,
    precision, optimizer: the optimizer is known with a workload or profile), first in its text.
    """
    if target not in TARGETS:
        raise ConfigError(f"unknown export target {target!r}: expected one of {', '.join(TARGETS)}")
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cuda", "cpu"):
        raise ConfigError(f"invalid device {device!r}: expected cuda or cpu")
    if isinstance(config, str):
        config = TrainConfig.parse(config)
    elif isinstance(config, dict):
        config = TrainConfig.from_dict(config)
    spec = workload if isinstance(workload, str) else getattr(workload, "source", None)
    ctx = Context(device_type=device, budget_bytes=parse_budget(budget) if budget is not None else None,
                  model_spec=spec, workload=None if isinstance(workload, str) else workload, extra=extra or {},
                  profile=profile)
    kwargs, extra_out, notes, own_changes = _BUILDERS[target](config, ctx)
    notes = _peaks(notes + _together(config, notes), ctx)
    all_changes = tuple(changes) + tuple(own_changes)
    comment = [n.text() for n in notes]
    text = _render(target, kwargs, extra_out, comment, [c.text() for c in all_changes])
    return Export(target, config, kwargs, extra_out, tuple(notes), text, all_changes)


def export_study(out_dir: str | Path, target: str, *, storage: str | None = None,
                 override: str | None = None) -> Export:
    """The best config of the study in ``out_dir`` in ``target``'s form (see :func:`export`).

    ``override`` (``"micro_batch=4"``) changes fields of the best config. The workload, device
    and budget come from the study. Raises StudyError when the study has no best config yet.
    """
    from autofit.core.errors import StudyError
    from autofit.profiling.cache import study_profile
    from autofit.report.tables import best_record
    from autofit.study import load_snapshot

    study = load_snapshot(out_dir, storage=storage)
    best = best_record(study)
    settings = study.settings
    if best.get("config") is None and override is None:
        raise StudyError(f"study {study.study_name}: no config ran under the budget yet; nothing to export "
                         "(pass --config to export one anyway)")
    base = TrainConfig.from_dict(best["config"]) if best.get("config") else TrainConfig()
    config = TrainConfig.parse(override, base=base) if override else base
    extra = {"study": study.study_name}
    if best.get("config") and config == base:  # what was measured belongs only to the config that ran
        extra.update(trial=best.get("trial"), measured=best.get("measured"), predicted=best.get("predicted"))
    changes = []
    if best.get("config") and config.samples_per_step != base.samples_per_step:
        changes.append(_batch_change(base, config.samples_per_step, f"--config {override} over the study's best "
                                     f"({base.short()})"))
    if best.get("config") and config.precision != base.precision:
        changes.append(_precision_change(base, config.precision.value, f"--config {override} over the study's best"))
    return export(config, target, workload=settings.get("workload_source"), budget=settings.get("budget_bytes"),
                  device=settings.get("device_type"), extra=extra, profile=study_profile(study), changes=tuple(changes))
