"""The fifth lever, a smaller model: the largest model of a family that fits a memory budget.

For every shape of a grid over a family's size fields (:mod:`autofit.sizing.family`) and every config
of a search space, from the estimate alone (nothing allocated): does any config fit, which one
the time model predicts fastest, at what peak. Shape profiles come from a few one-layer
fake-tensor profiles (:mod:`autofit.sizing.scaling` says how); scoring is
:func:`autofit.estimator.memory_table.estimate_table` and :func:`autofit.estimator.time_model.predict_table`,
vectorized over each shape's configs. A shape whose weights, gradients and optimizer state
alone exceed the budget times the largest allowed device split fits no config and is not
scored further.

The *frontier* is the fitting shapes no other fitting shape beats in both parameter count and
predicted tokens/s (the largest model at each throughput level); the answer is its largest
shape at or above ``min_tokens_per_s``. ``confirm=K`` runs real trials (:func:`autofit.trial.run.run_trial`)
of the K largest frontier shapes with their best config, where this machine can.

Example::

    result = autofit.size("gpt2", "8GB", vary={"n_layer": [6, 12, 24], "n_embd": [512, 768, 1024]})
    result.top["spec"], result.top["param_count"], result.top["config"]
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from autofit.core.budget import format_budget, parse_budget
from autofit.core.config import TrainConfig
from autofit.core.space import SearchSpace, builtin_spaces, load_space
from autofit.estimator.memory_model import needs_split_ends, optimizer_choices
from autofit.estimator.memory_table import estimate_table
from autofit.estimator.time_model import predict_table
from autofit.probes.device_rates import probe_rates
from autofit.runtime.training import check_fake_device
from autofit.sizing.family import Family, SizeError, load_family, parse_vary
from autofit.sizing.scaling import ShapeProfile, shape_profiles

SHAPE_COLUMNS = ("spec", "param_count", "fits", "reason", "config", "peak_bytes", "step_time_s", "samples_per_s",
                 "tokens_per_s", "n_fit", "frontier")
MEASURED_COLUMNS = ("measured_status", "measured_peak_bytes", "measured_tokens_per_s", "measured_note")


@dataclass(frozen=True)
class SizeResult:
    """What ``autofit size`` found. ``table``: one row per shape (the varied fields, then
    :data:`SHAPE_COLUMNS` and, after ``confirm``, :data:`MEASURED_COLUMNS`), largest first.
    ``top``: the answer's row as a dict (None when nothing fits). ``timing``: seconds spent
    profiling and scoring, shapes and configs scored."""

    family: str
    budget_bytes: int
    budget_text: str
    device_type: str
    devices: int
    space: str
    fields: tuple[str, ...]
    min_tokens_per_s: float | None
    table: pd.DataFrame
    timing: dict = field(default_factory=dict)

    @property
    def frontier(self) -> pd.DataFrame:
        return self.table[self.table["frontier"]]

    @property
    def top(self) -> dict | None:
        eligible = self.table[self.table["fits"] & self._fast_enough()]
        return None if eligible.empty else eligible.iloc[0].to_dict()

    def _fast_enough(self) -> pd.Series:
        if self.min_tokens_per_s is None:
            return pd.Series(True, index=self.table.index)
        return self.table["tokens_per_s"].fillna(0) >= self.min_tokens_per_s

    def to_dict(self) -> dict:
        """JSON-ready: settings, every shape, the frontier and the answer."""
        rows = [_json_row(r) for r in self.table.to_dict("records")]
        return {"family": self.family, "budget_bytes": self.budget_bytes, "budget": self.budget_text,
                "device_type": self.device_type, "devices": self.devices, "space": self.space,
                "fields": list(self.fields), "min_tokens_per_s": self.min_tokens_per_s,
                "top": None if self.top is None else _json_row(self.top),
                "frontier": [r for r in rows if r["frontier"]], "shapes": rows, "timing": self.timing}


def _json_row(row: dict) -> dict:
    out = {}
    for k, v in row.items():
        if isinstance(v, float) and np.isnan(v):
            v = None
        elif isinstance(v, (np.integer,)):
            v = int(v)
        elif isinstance(v, (np.floating,)):
            v = float(v)
        elif isinstance(v, (np.bool_,)):
            v = bool(v)
        if v is not None and (k.endswith("_bytes") or k in ("param_count", "n_fit")):
            v = int(round(v))  # a column with gaps is float in pandas; counts are integers
        out[k] = v.to_dict() if isinstance(v, TrainConfig) else v
    return out


def _grid(family: Family, vary: dict) -> tuple[list[dict], list[dict]]:
    """(resolved shapes, invalid shapes with a reason) over the product of the varied values."""
    names = list(vary)
    shapes, invalid = [], []
    for combo in itertools.product(*(vary[n] for n in names)):
        varied = dict(zip(names, combo))
        try:
            shapes.append(family.resolve(varied))
        except SizeError as exc:
            invalid.append({**varied, "reason": str(exc)})
    return shapes, invalid


def _state_floor(sp: ShapeProfile) -> float:
    """Weights + gradients + optimizer state of the whole model, at its least-memory precision (and
    optimizer, where the lever's choices were profiled)."""
    return min(pp.static_param_bytes + pp.grad_bytes + min([pp.optimizer_bytes]
                                                           + [o.state_bytes for o in pp.optimizer_options])
               for pp in sp.profile.precisions.values())


def score_shape(sp: ShapeProfile, configs: list[TrainConfig], budget_bytes: int, devices: int, rates) -> dict:
    """The fastest predicted config of one shape that fits, as a row (``fits`` False when none does)."""
    profile = sp.profile
    max_split = max(c.device_split for c in configs)
    row = {"spec": profile.workload, "param_count": profile.param_count, "n_fit": 0}
    if _state_floor(sp) > budget_bytes * min(devices, max_split):
        return {**row, "fits": False, "reason": "weights, gradients and optimizer state alone exceed the budget"}
    usable = [c for c in configs if c.device_split <= min(devices, profile.n_layers)]
    if not usable:
        return {**row, "fits": False, "reason": f"no config of the space runs on {devices} device(s)"}
    mem = estimate_table(profile, usable, budget_bytes, overhead=rates.memory_overhead())
    ok = (mem["valid"] & mem["fits"].astype(bool)).to_numpy()
    if not ok.any():
        return {**row, "fits": False, "reason": "no config of the space fits"}
    fitting = [c for c, k in zip(usable, ok) if k]
    times = predict_table(profile, fitting, rates, sp.counts)
    best = int(np.nanargmax(times["samples_per_s"].to_numpy()))
    samples_per_s = float(times["samples_per_s"].iloc[best])
    tokens = profile.tokens_per_sample
    return {**row, "fits": True, "reason": "", "config": fitting[best],
            "peak_bytes": int(round(mem["peak_bytes"].to_numpy()[ok][best])),
            "step_time_s": float(times["step_time_s"].iloc[best]), "samples_per_s": samples_per_s,
            "tokens_per_s": samples_per_s * tokens if tokens else None, "n_fit": int(ok.sum())}


def pareto_frontier(param_count: np.ndarray, throughput: np.ndarray, fits: np.ndarray) -> np.ndarray:
    """True where a fitting shape is beaten by no other fitting shape in both parameters and throughput.

    >>> pareto_frontier(np.array([3, 2, 1]), np.array([1.0, 5.0, 4.0]), np.array([True, True, True]))
    array([ True,  True, False])
    """
    out = np.zeros(len(param_count), dtype=bool)
    best = -np.inf
    for i in sorted(np.nonzero(fits)[0], key=lambda i: (-param_count[i], -throughput[i])):
        if throughput[i] > best:
            out[i] = True
            best = throughput[i]
    return out


def size(family: Family | str, budget: str | int = "8GB", *, vary: dict | list[str] | None = None,
         devices: int | None = None, space: SearchSpace | str | Path | None = None, global_batch: int | None = None,
         min_tokens_per_s: float | None = None, confirm: int = 0, device: str | None = None,
         trial_timeout_s: float = 600.0, progress: Callable[[str], None] | None = None) -> SizeResult:
    """The largest models of ``family`` that fit ``budget`` per device, from the estimate alone.

    - ``family``: a built-in decoder preset (``"gpt2"``, ``"llama-1b"``, ``"gpt2+dropout=0.0"``...)
      as the base shape, an ``"hf:MODEL?field=value#seq_len=N"`` model, or a
      :class:`autofit.sizing.family.Family`.
    - ``vary``: ``{"n_layer": [4, 8], "n_embd": [512, 768]}`` or ``["n_layer=4,8", ...]``; the
      grid is their product (default: depths 2-48 by widths of 2-64 heads). Fields not varied
      keep the base's value, or its head size and ratios when the width changes.
    - ``devices``: the most devices a config may split over (default 1 on the CPU, the visible
      GPUs on CUDA); ``space``: a search space (default ``search_spaces/default.toml``);
      ``global_batch`` fixes its global batch (as ``autofit estimate --global-batch``).
    - ``min_tokens_per_s``: the answer is the largest shape predicted at least this fast.
    - ``confirm``: real trials of that many of the largest frontier shapes (best config each).

    Returns a :class:`SizeResult`. Raises SizeError, BudgetError or SpaceError for bad input.
    """
    started = time.perf_counter()
    fam = load_family(family)
    budget_bytes = parse_budget(budget)
    budget_text = budget if isinstance(budget, str) else format_budget(budget_bytes)
    grid = parse_vary(vary, fam)
    resolved_space = space if isinstance(space, SearchSpace) else load_space(space)
    if global_batch is not None:
        resolved_space = resolved_space.with_global_batch(global_batch)
    device = device or _default_device()
    check_fake_device(device)
    devices = devices or _device_count(device)
    if devices < 1 or (min_tokens_per_s is not None and min_tokens_per_s < 0) or confirm < 0:
        raise SizeError("devices must be >= 1, min_tokens_per_s >= 0 and confirm >= 0")
    shapes, invalid = _grid(fam, grid)
    if not shapes:
        raise SizeError(f"no valid shape in the grid: {invalid[0]['reason']}")
    configs = resolved_space.configs()
    profiles, info = shape_profiles(fam, shapes, list(grid), list(resolved_space.precision), device, progress,
                                    tuple(optimizer_choices(configs)), split_ends=needs_split_ends(configs, devices))
    try:
        rates = probe_rates(device)
    except RuntimeError as exc:  # e.g. --device cuda on a machine without a GPU: no rates to measure
        raise SizeError(f"the time model needs {device} rates measured on this machine: {exc}") from None
    score_started = time.perf_counter()
    rows = []
    for shape, sp in zip(shapes, profiles):
        varied = {f: shape[f] for f in grid}
        if sp is None:
            rows.append({**varied, "spec": fam.spec(shape), "param_count": None, "fits": False, "n_fit": 0,
                         "reason": "the model cannot be built or profiled at this shape"})
        else:
            rows.append({**varied, **score_shape(sp, configs, budget_bytes, devices, rates)})
    score_s = time.perf_counter() - score_started
    rows += [{**r, "fits": False, "n_fit": 0} for r in invalid]
    table = _finish_table(pd.DataFrame(rows), list(grid))
    timing = {"shapes": len(shapes), "configs_per_shape": len(configs), "configs_scored": len(shapes) * len(configs),
              "profile_s": info["profile_s"], "profiled": info["profiled"], "interpolated": info["interpolated"],
              "score_s": score_s, "total_s": time.perf_counter() - started}
    result = SizeResult(family=fam.name, budget_bytes=budget_bytes, budget_text=budget_text, device_type=device,
                        devices=devices, space=_space_label(resolved_space.source), fields=tuple(grid),
                        min_tokens_per_s=min_tokens_per_s, table=table, timing=timing)
    if confirm:
        result = confirm_top(result, confirm, trial_timeout_s, progress)
    return result


def _finish_table(table: pd.DataFrame, fields: list[str]) -> pd.DataFrame:
    for col in SHAPE_COLUMNS:
        if col not in table:
            table[col] = None
    table["fits"] = table["fits"].astype(bool)
    throughput = pd.to_numeric(table["tokens_per_s"], errors="coerce")
    if throughput.isna().all():
        throughput = pd.to_numeric(table["samples_per_s"], errors="coerce")
    params = pd.to_numeric(table["param_count"], errors="coerce").fillna(-1).to_numpy()
    table["frontier"] = pareto_frontier(params, throughput.fillna(-np.inf).to_numpy(), table["fits"].to_numpy())
    table = table.assign(_p=params).sort_values(["fits", "_p"], ascending=[False, False], kind="stable")
    return table.drop(columns="_p").reset_index(drop=True)[fields + list(SHAPE_COLUMNS)]


def _space_label(source: str) -> str:
    """A built-in space by its name (no machine path in written results), any other by its path."""
    builtin = {str(f): name for name, f in builtin_spaces().items()}
    return builtin.get(source, source)


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _device_count(device: str) -> int:
    import torch

    return max(torch.cuda.device_count(), 1) if device == "cuda" else 1


def _available_ram_bytes() -> int | None:
    """RAM a new process can use without swapping (Linux MemAvailable; else free pages; None if unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def _cannot_run(row: dict, result: SizeResult) -> str | None:
    """Why this machine cannot run a shape's trial, or None."""
    import torch

    config = row["config"]
    if result.device_type == "cuda":
        if not torch.cuda.is_available():
            return "estimated for CUDA; this machine has no CUDA GPU"
        if config.device_split > torch.cuda.device_count():
            return f"needs {config.device_split} GPUs; {torch.cuda.device_count()} visible"
        return None
    available = _available_ram_bytes()
    if available is None:
        return None
    # The trial builds the model in real memory: weights, gradients, state, activations and the input.
    if row["peak_bytes"] * 1.2 > available:
        return f"needs about {format_budget(int(row['peak_bytes'] * 1.2))} of RAM; {format_budget(available)} free here"
    return None


def confirm_top(result: SizeResult, k: int, trial_timeout_s: float = 600.0,
                progress: Callable[[str], None] | None = None) -> SizeResult:
    """Real trials of the ``k`` largest frontier shapes (at or above the throughput floor) with
    their best config, under the budget; measured columns filled in (a note where not run)."""
    from autofit.trial.run import run_trial

    table = result.table.copy()
    for col in MEASURED_COLUMNS:
        table[col] = None
    eligible = table[table["frontier"] & result._fast_enough()].head(k)
    for i, row in eligible.iterrows():
        reason = _cannot_run(row.to_dict(), result)
        if reason:
            table.at[i, "measured_note"] = f"not run: {reason}"
            continue
        if progress:
            progress(f"measuring {row['spec']} with {row['config'].short()}")
        trial = run_trial(row["spec"], row["config"], device=result.device_type, budget_bytes=result.budget_bytes,
                          measure_steps=1, timeout_s=trial_timeout_s)
        table.at[i, "measured_status"] = trial.status.value
        table.at[i, "measured_peak_bytes"] = trial.peak_bytes
        table.at[i, "measured_tokens_per_s"] = trial.tokens_per_s
        table.at[i, "measured_note"] = trial.error or ""
    return SizeResult(**{**result.__dict__, "table": table})


def plot_frontier(result: SizeResult, path: str | Path) -> Path:
    """The frontier as a PNG: every fitting shape's parameters against predicted throughput,
    frontier shapes joined, measured throughput where trials ran. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = result.table
    unit = "tokens/s" if table["tokens_per_s"].notna().any() else "samples/s"
    y = "tokens_per_s" if unit == "tokens/s" else "samples_per_s"
    fits, front = table[table["fits"]], table[table["frontier"]].sort_values("param_count")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter(fits["param_count"], fits[y], s=12, color="0.7", label="fits (best predicted config)")
    ax.plot(front["param_count"], front[y], "o-", color="C0", label="frontier")
    if "measured_tokens_per_s" in table and table["measured_tokens_per_s"].notna().any():
        measured = table[table["measured_tokens_per_s"].notna()]
        ax.scatter(measured["param_count"], measured["measured_tokens_per_s"], marker="*", s=120, color="C3",
                   label="measured", zorder=5)
    if result.min_tokens_per_s is not None:
        ax.axhline(result.min_tokens_per_s, color="C2", linestyle="--", label="--min-tokens-per-s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel(f"predicted {unit}")
    ax.set_title(f"{result.family}: largest models within {result.budget_text} per device ({result.device_type}, "
                 f"{result.devices} device{'s' if result.devices > 1 else ''})", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


__all__ = ["SizeResult", "confirm_top", "pareto_frontier", "plot_frontier", "score_shape", "size"]
