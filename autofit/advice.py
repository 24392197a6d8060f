"""What would fit when nothing in the space does: the fewest devices, a precision, a checkpoint interval."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from autofit.budget import format_bytes
from autofit.config import Precision, TrainConfig
from autofit.memory_model import estimate_table
from autofit.profile_data import Profile


@dataclass(frozen=True)
class Advice:
    """Plain sentences plus the smallest fitting config found (if any)."""

    lines: tuple[str, ...]
    smallest_fit: TrainConfig | None


def _splits(n_layers: int) -> list[int]:
    splits, p = [], 1
    while p <= n_layers:
        splits.append(p)
        p *= 2
    if n_layers not in splits:
        splits.append(n_layers)
    return splits


def advise(profile: Profile, budget_bytes: int, precisions: list[Precision] | None = None) -> Advice:
    """Search the extremes (micro-batch 1, every checkpoint interval, every power-of-two split)
    for what would fit ``budget_bytes`` per device, and say it in a few lines."""
    precisions = [Precision(p) for p in (precisions or profile.precisions)]
    candidates = [
        TrainConfig(prec, 1, 1, every, split)
        for prec in precisions
        for every in (0, 1, 2, 4)
        for split in _splits(profile.n_layers)
    ]
    table = estimate_table(profile, candidates, budget_bytes)
    table["config"] = candidates
    lines = []
    for prec in precisions:
        state = profile.for_precision(prec)
        model_state = state.static_param_bytes + state.grad_bytes + state.optimizer_bytes
        if model_state > budget_bytes:
            lines.append(f"{prec.value}: weights + gradients + optimizer state alone are {format_bytes(model_state)}, "
                         f"over the {format_bytes(budget_bytes)} budget on one device")
    single = table[(table.device_split == 1) & table.fits]
    if single.empty:
        lines.append("no single-device configuration fits, even at micro_batch=1 with checkpointing of every layer")
    else:
        for prec, group in single.groupby("precision", sort=False):
            best = group.sort_values(["checkpoint_every"]).iloc[0]  # least recomputation that fits
            lines.append(f"fits on one device: {prec} with checkpoint_every={best.checkpoint_every} "
                         f"at micro_batch=1 (peak {format_bytes(best.peak_bytes)})")
    fitting = table[table.fits]
    smallest = None
    if not fitting.empty:
        fewest = int(fitting.device_split.min())
        for prec, group in fitting[fitting.device_split == fewest].groupby("precision", sort=False):
            best = group.sort_values(["checkpoint_every", "peak_bytes"]).iloc[0]
            lines.append(f"fewest devices: {fewest} x {prec}, checkpoint_every={best.checkpoint_every}, "
                         f"micro_batch=1 (peak {format_bytes(best.peak_bytes)} per device)")
        smallest = fitting.sort_values(["device_split", "peak_bytes"]).iloc[0]["config"]
        for prec in precisions:
            per_prec = fitting[fitting.precision == prec.value]
            if per_prec.empty:  # said, not left out: this precision fits nowhere
                lines.append(f"at {prec.value}: nothing fits even split across {max(_splits(profile.n_layers))} devices")
            elif int(per_prec.device_split.min()) > fewest:
                lines.append(f"at {prec.value}: at least {int(per_prec.device_split.min())} devices")
    else:
        lines.append(f"nothing fits even split across {max(_splits(profile.n_layers))} devices: "
                     "use a smaller model or a larger budget")
    return Advice(tuple(lines), smallest)


def fitting_summary(table: pd.DataFrame) -> dict:
    """Counts for a scored space: total, valid, fitting."""
    return {
        "configs": int(len(table)),
        "valid": int(table["valid"].sum()),
        "fit": int(table["fits"].sum()) if table["fits"].notna().all() else None,
    }


def advise_workload(workload, budget_bytes: int, device_type: str = "cpu") -> Advice:
    """:func:`advise` over every precision for ``workload`` (a Workload or a ``--model`` spec),
    profiling it first (from the profile cache when it is there). What ``autofit search`` says
    when nothing in its space ran under the budget. Raises WorkloadError when the workload
    cannot be loaded or profiled."""
    from autofit.profile import profile_workload
    from autofit.workload import load_workload

    profile = profile_workload(load_workload(workload), list(Precision), device_type=device_type)
    return advise(profile, budget_bytes, list(Precision))


def nothing_fits(settings) -> tuple[str, ...]:
    """What would fit, for a search (its stored ``settings``) in which no trial ran ok under the
    budget: :func:`advise_workload`'s lines, or one line saying why there is no advice."""
    from autofit.errors import AutofitError

    spec, budget = settings.get("workload_source"), settings.get("budget_bytes")
    if not spec or not budget:
        return ("no advice: the study does not record a loadable workload (--model spec) and budget",)
    try:
        return advise_workload(spec, int(budget), settings.get("device_type") or "cpu").lines
    except AutofitError as exc:
        return (f"no advice: {exc}",)
