"""What would fit when nothing in the space does: the fewest devices, a precision, a checkpoint interval
(and, given the ``lean`` space's levers, another optimizer or selective checkpointing, named as such)."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from autofit.core.budget import format_bytes
from autofit.core.config import (
    CheckpointPolicy,
    Offload,
    OptimizerChoice,
    Precision,
    SplitMode,
    TrainConfig,
)
from autofit.estimator.memory_table import estimate_table, lever_refusal, profile_for
from autofit.estimator.offload_memory import offload_refusal
from autofit.profiling.data import Profile
from autofit.runtime.optimizers import REPLACEABLE


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


# FSDP ranks are not bounded by the layer count: powers of two up to this many devices are tried.
MAX_FSDP_RANKS = 1024


def fewest_devices(profile: Profile, budget_bytes: int, precisions: list[Precision] | None = None) -> pd.DataFrame:
    """The fewest devices that fit ``budget_bytes`` each, per split mode and precision, at micro_batch 1.

    One row per (split_mode, precision): ``devices`` (None when nothing fits), the least
    recomputation that fits at that count (``checkpoint_every``), ``peak_bytes`` per device and
    its parts -- ``model_state_bytes`` (pipeline: the largest stage's weights, gradients and
    optimizer state; fsdp: all shards and buffers), ``gathered_bytes`` (fsdp: whole weights of
    the units being computed at the peak), ``activations_bytes`` and ``other_bytes`` (the rest:
    temporaries, buffers in flight, on CUDA the context).
    """
    precisions = [Precision(p) for p in (precisions or profile.precisions)]
    fsdp_ranks = [2 ** i for i in range(1, MAX_FSDP_RANKS.bit_length())]
    candidates = [TrainConfig(prec, 1, 1, every, split)
                  for prec in precisions for every in (0, 1, 2, 4) for split in _splits(profile.n_layers)]
    candidates += [TrainConfig(prec, 1, 1, every, ranks, SplitMode.FSDP)
                   for prec in precisions for every in (0, 1, 2, 4) for ranks in fsdp_ranks]
    table = estimate_table(profile, candidates, budget_bytes)
    table["config"] = candidates
    rows = []
    for mode in SplitMode:
        for prec in precisions:
            group = table[(table.split_mode == mode.value) & (table.precision == prec.value) & table.fits]
            row = {"split_mode": mode.value, "precision": prec.value, "devices": None, "checkpoint_every": None,
                   "peak_bytes": None, "model_state_bytes": None, "gathered_bytes": None,
                   "activations_bytes": None, "other_bytes": None}
            if not group.empty:
                best = group.sort_values(["device_split", "checkpoint_every", "peak_bytes"]).iloc[0]
                state = (best.shard_bytes if mode is SplitMode.FSDP
                         else best.params_bytes + best.optimizer_bytes + best.grads_bytes)
                gathered = best.gathered_bytes if mode is SplitMode.FSDP else 0.0
                row.update(devices=int(best.device_split), checkpoint_every=int(best.checkpoint_every),
                           peak_bytes=int(round(best.peak_bytes)), model_state_bytes=int(round(state)),
                           gathered_bytes=int(round(gathered)), activations_bytes=int(round(best.activations_bytes)),
                           other_bytes=int(round(best.peak_bytes - state - gathered - best.activations_bytes)))
            rows.append(row)
    return pd.DataFrame(rows, dtype=object)  # None stays None (not NaN) where nothing fits


def fewest_devices_lines(profile: Profile, budget_bytes: int, precisions: list[Precision] | None = None) -> list[str]:
    """:func:`fewest_devices` as sentences, one per split mode and precision."""
    lines = []
    for row in fewest_devices(profile, budget_bytes, precisions).itertuples():
        if row.devices is None:
            limit = MAX_FSDP_RANKS if row.split_mode == SplitMode.FSDP.value else max(_splits(profile.n_layers))
            why = ""
            if row.split_mode == SplitMode.FSDP.value and Precision(row.precision).is_amp:
                # autocast's half-precision weight copies are saved for backward, whatever the sharding
                copies = sum(max(0.0, l.forward.delta[0]) for l in profile.for_precision(row.precision).layers)
                why = (f" (autocast over FSDP keeps a half-precision copy of every layer's weights from forward "
                       f"to backward: {format_bytes(copies)} on every rank)")
            lines.append(f"{row.split_mode} {row.precision}: does not fit even over {limit} devices{why}")
            continue
        parts = (f"shards {format_bytes(row.model_state_bytes)} + gathered weights {format_bytes(row.gathered_bytes)}"
                 if row.split_mode == SplitMode.FSDP.value
                 else f"stage weights+gradients+optimizer {format_bytes(row.model_state_bytes)}")
        lines.append(f"{row.split_mode} {row.precision}: {row.devices} devices, checkpoint_every={row.checkpoint_every}, "
                     f"micro_batch=1: peak {format_bytes(row.peak_bytes)} per device = {parts} + activations "
                     f"{format_bytes(row.activations_bytes)} + other {format_bytes(row.other_bytes)}")
    return lines


def lever_words(config: TrainConfig) -> str:
    """How ``config`` checkpoints and with which optimizer, in words: ``checkpoint_every=2``, or with the
    ``lean`` levers e.g. ``adamw8bit + selective checkpointing every 1 layer``."""
    if config.checkpoint_policy is CheckpointPolicy.SELECTIVE:
        every = config.checkpoint_every
        ckpt = f"selective checkpointing every {every} layer{'s' if every > 1 else ''}"
    else:
        ckpt = f"checkpoint_every={config.checkpoint_every}"
    return f"{config.optimizer.value} + {ckpt}" if config.changes_optimizer else ckpt


def _least_change(group: pd.DataFrame, *then: str) -> pd.Series:
    """The row of ``group`` that changes the training least (the workload's own optimizer first), then
    recomputes least (no checkpointing, then selective, then full), then by ``then``."""
    order = group.assign(_opt=[c.changes_optimizer for c in group.config],
                         _ckpt=[0 if c.checkpoint_every == 0 else 1 if c.checkpoint_policy is CheckpointPolicy.SELECTIVE
                                else 2 for c in group.config])
    return order.sort_values(["_opt", "_ckpt", "checkpoint_every", *then], kind="stable").iloc[0]


def advise(profile: Profile, budget_bytes: int, precisions: list[Precision] | None = None,
           optimizers=(OptimizerChoice.AS_GIVEN,), policies=(CheckpointPolicy.FULL,)) -> Advice:
    """Search the extremes (micro-batch 1, every checkpoint interval, every power-of-two split)
    for what would fit ``budget_bytes`` per device, and say it in a few lines. ``optimizers`` and
    ``policies``: the ``optimizer`` lever's choices and the checkpoint policies to try too (a space's:
    the ``lean`` space's change the training, and each line that uses them names them); the profile
    must hold those choices (``profile_workload(optimizers=...)``)."""
    precisions = [Precision(p) for p in (precisions or profile.precisions)]
    optimizers = [OptimizerChoice(o) for o in optimizers] or [OptimizerChoice.AS_GIVEN]
    policies = [CheckpointPolicy(p) for p in policies] or [CheckpointPolicy.FULL]
    candidates = list(dict.fromkeys(
        TrainConfig(prec, 1, 1, every, split, optimizer=opt, checkpoint_policy=policy)
        for prec in precisions
        for opt in optimizers
        for every in (0, 1, 2, 4)
        for policy in policies
        for split in _splits(profile.n_layers)
    ))
    table = estimate_table(profile, candidates, budget_bytes)
    table["config"] = candidates
    lines = []
    for prec in precisions:
        for opt in optimizers:
            if lever_refusal(profile, opt, CheckpointPolicy.FULL, fsdp=False) is not None:
                continue
            state = profile_for(profile, prec, opt)
            model_state = state.static_param_bytes + state.grad_bytes + state.optimizer_bytes
            if model_state > budget_bytes:
                with_opt = f" with {opt.value}" if opt is not OptimizerChoice.AS_GIVEN else ""
                lines.append(f"{prec.value}{with_opt}: weights + gradients + optimizer state alone are "
                             f"{format_bytes(model_state)}, over the {format_bytes(budget_bytes)} budget on one device")
    for opt in optimizers:
        why = lever_refusal(profile, opt, CheckpointPolicy.FULL, fsdp=False)
        if why is not None:
            lines.append(f"optimizer={opt.value} not tried: {why}")
    single = table[(table.device_split == 1) & table.fits]
    if single.empty:
        lines.append("no single-device configuration fits, even at micro_batch=1 with checkpointing of every layer"
                     + (" and the levers given" if len(optimizers) > 1 or len(policies) > 1 else ""))
        if optimizers == [OptimizerChoice.AS_GIVEN] and profile.optimizer in REPLACEABLE:
            lines.append("the lean space (--space lean) also tries a smaller optimizer state (adafactor, adamw8bit) "
                         "and selective checkpointing; they change the training")
        lines.extend(_offload_lines(profile, budget_bytes, precisions))
    else:
        for prec, group in single.groupby("precision", sort=False):
            best = _least_change(group)
            lines.append(f"fits on one device: {prec} with {lever_words(best.config)} "
                         f"at micro_batch=1 (peak {format_bytes(best.peak_bytes)})")
    fitting = table[table.fits]
    smallest = None
    if not fitting.empty:
        fewest = int(fitting.device_split.min())
        for prec, group in fitting[fitting.device_split == fewest].groupby("precision", sort=False):
            best = _least_change(group, "peak_bytes")
            lines.append(f"fewest devices: {fewest} x {prec}, {lever_words(best.config)}, "
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
    lines.append("fewest devices per split mode (pipeline stages, or FSDP ranks sharding the model state):")
    lines.extend(f"  {line}" for line in fewest_devices_lines(profile, budget_bytes, precisions))
    return Advice(tuple(lines), smallest)


def _offload_lines(profile: Profile, budget_bytes: int, precisions: list[Precision]) -> list[str]:
    """On CUDA, where nothing fits one device: whether keeping the optimizer state on the host would."""
    candidates = [TrainConfig(prec, 1, 1, every, offload=Offload.OPTIMIZER)
                  for prec in precisions if prec is not Precision.AMP_FP16 for every in (0, 1, 2, 4)]
    if not candidates or profile.device_type != "cuda" or offload_refusal(profile, candidates[0]) is not None:
        return []
    table = estimate_table(profile, candidates, budget_bytes)
    fitting = table[table.fits]
    if fitting.empty:
        return []
    best = fitting.sort_values("peak_bytes").iloc[0]
    return [f"with offload=optimizer (the optimizer state on the host; it does not change the training): "
            f"{best.precision} with checkpoint_every={best.checkpoint_every} fits one device at micro_batch=1 "
            f"(peak {format_bytes(best.peak_bytes)})"]


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
    from autofit.profiling.profile import profile_workload
    from autofit.workloads.load import load_workload

    profile = profile_workload(load_workload(workload), list(Precision), device_type=device_type)
    return advise(profile, budget_bytes, list(Precision))


def nothing_fits(settings) -> tuple[str, ...]:
    """What would fit, for a search (its stored ``settings``) in which no trial ran ok under the
    budget: :func:`advise_workload`'s lines, or one line saying why there is no advice."""
    from autofit.core.errors import AutofitError

    spec, budget = settings.get("workload_source"), settings.get("budget_bytes")
    if not spec or not budget:
        return ("no advice: the study does not record a loadable workload (--model spec) and budget",)
    try:
        return advise_workload(spec, int(budget), settings.get("device_type") or "cpu").lines
    except AutofitError as exc:
        return (f"no advice: {exc}",)
