"""The search in pictures: four PNGs written with the tables, each readable on its own.

- ``throughput_vs_peak.png``: every real trial's samples/s against its measured peak, coloured
  by status, the budget as a vertical line, the best config starred, and the configs the
  estimate pruned (predicted peak, predicted samples/s) faint behind;
- ``predicted_vs_measured.png``: predicted against measured peak, and step time, for every
  real trial, with the identity line;
- ``memory_breakdown.png``: weights, gradients, optimizer state, activations, temporaries and
  overhead of the top configs at their peak, predicted beside measured;
- ``best_so_far.png``: the best measured throughput so far against the study's wall time.

Input is plain data: the trials table (``autofit.report.tables.trials_table``'s columns) and, per
trial number, the predicted and measured breakdowns. matplotlib draws through its Agg canvas
directly (no pyplot), so nothing here touches a caller's backend or needs a display.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from autofit.core.files import write_atomic
from autofit.core.records import TrialStatus

PICTURES = ("throughput_vs_peak", "predicted_vs_measured", "memory_breakdown", "best_so_far")
REAL = tuple(s.value for s in TrialStatus if s.ran)  # real trials that finished
STATUS_COLOURS = {"ok": "#2a9d3f", "oom": "#d62728", "error": "#7f3fbf", "timeout": "#ff7f0e",
                  "pruned": "#b0b0b0"}
CATEGORY_LABELS = {"params_bytes": "weights", "grads_bytes": "gradients", "optimizer_bytes": "optimizer state",
                   "activations_bytes": "activations", "temporary_bytes": "temporaries", "overhead_bytes": "overhead"}
CATEGORY_COLOURS = ("#4c72b0", "#55a868", "#c44e52", "#8172b2", "#ccb974", "#64b5cd")
TOP_BREAKDOWN = 5
DPI = 110


def _figure(width: float = 7.5, height: float = 4.8, *, top: float = 0.4, right: float = 0.2, bottom: float = 0.6,
            left: float = 0.9, wspace: float = 0.2):
    """A figure on an Agg canvas with fixed margins in inches (``left`` fits six-digit tick labels and
    the axis label). A layout engine would cost a second draw of every figure at savefig."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)
    fig.subplots_adjust(left=left / width, right=1 - right / width, bottom=bottom / height, top=1 - top / height,
                        wspace=wspace)
    return fig


def _title(ax, text: str) -> None:
    # At y=1 given, matplotlib does not look for tick labels above the axes (there are none here) at each draw.
    ax.set_title(text, y=1.0)


def _unit(max_bytes: float) -> tuple[str, float]:
    """The binary unit that keeps axis numbers short, and its size."""
    for name, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if max_bytes >= size:
            return name, float(size)
    return "bytes", 1.0


def _num(series: pd.Series) -> np.ndarray:
    return pd.to_numeric(series, errors="coerce").astype(float).to_numpy()


def throughput_vs_peak(table: pd.DataFrame, budget_bytes: int, best: int | None, title: str):
    """Samples/s against measured peak for every real trial; pruned configs' predictions faint behind."""
    fig = _figure()
    ax = fig.add_subplot()
    unit, size = _unit(max(budget_bytes, np.nanmax(np.r_[_num(table["measured_peak_bytes"]), 0.0])))
    pruned = table[table["status"] == "pruned"]
    if not pruned.empty:
        ax.scatter(_num(pruned["predicted_peak_bytes"]) / size, _num(pruned["predicted_samples_per_s"]), s=12,
                   color=STATUS_COLOURS["pruned"], alpha=0.35, linewidths=0, zorder=1,
                   label=f"pruned, never ran: predicted ({len(pruned)})")
    for status in REAL:
        rows = table[table["status"] == status]
        if rows.empty:
            continue
        # a failed trial has no throughput: it stands on the axis at its measured (else predicted) peak
        peak = np.where(np.isnan(_num(rows["measured_peak_bytes"])), _num(rows["predicted_peak_bytes"]),
                        _num(rows["measured_peak_bytes"]))
        rate = np.nan_to_num(_num(rows["samples_per_s"]), nan=0.0)
        ax.scatter(peak / size, rate, s=36, color=STATUS_COLOURS[status], marker="o" if status == "ok" else "x",
                   zorder=3, label=f"{status} ({len(rows)})")
    ax.axvline(budget_bytes / size, color="black", linestyle="--", linewidth=1, label="budget")
    if best is not None and (table["number"] == best).any():
        row = table[table["number"] == best].iloc[0]
        ax.scatter([float(row["measured_peak_bytes"]) / size], [float(row["samples_per_s"])], s=260, marker="*",
                   color="gold", edgecolors="black", zorder=4, label=f"best (trial {best})")
    ax.set_xlabel(f"peak memory per device ({unit}; measured, predicted for pruned)")
    ax.set_ylabel("throughput (samples/s)")
    _title(ax, f"{title}: throughput against peak memory")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return fig


def _identity_panel(ax, predicted: np.ndarray, measured: np.ndarray, statuses: pd.Series, scale: float,
                    unit: str, what: str) -> None:
    ok = ~(np.isnan(predicted) | np.isnan(measured))
    for status in REAL:
        mask = ok & (statuses.to_numpy() == status)
        if mask.any():
            ax.scatter(predicted[mask] / scale, measured[mask] / scale, s=30, color=STATUS_COLOURS[status],
                       label=f"{status} ({int(mask.sum())})", zorder=3)
    if ok.any():
        values = np.r_[predicted[ok], measured[ok]] / scale
        low, high = float(values.min()), float(values.max())
        pad = 0.05 * (high - low or high or 1.0)
        ax.plot([low - pad, high + pad], [low - pad, high + pad], color="black", linewidth=1, label="identity")
        if low > 0 and high / low > 20:
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.legend(fontsize=8, loc="upper left")
    else:
        ax.text(0.5, 0.5, "no trial with both", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel(f"predicted {what} ({unit})")
    ax.set_ylabel(f"measured {what} ({unit})")
    ax.grid(alpha=0.3)


def predicted_vs_measured(table: pd.DataFrame, title: str):
    """Predicted against measured peak and step time for every real trial, with the identity line."""
    real = table[table["status"].isin(REAL)]
    fig = _figure(11.0, 4.8, top=0.6)  # room for the figure's title above the panels' own
    left, right = fig.subplots(1, 2)
    predicted, measured = _num(real["predicted_peak_bytes"]), _num(real["measured_peak_bytes"])
    unit, size = _unit(np.nanmax(np.r_[predicted, measured, 1.0]))
    _identity_panel(left, predicted, measured, real["status"], size, unit, "peak per device")
    _title(left, "peak memory")
    _identity_panel(right, _num(real["predicted_step_time_s"]), _num(real["step_time_s"]), real["status"], 1.0, "s",
                    "step time")
    _title(right, "optimizer step time")
    fig.suptitle(f"{title}: predicted against measured, every real trial")
    return fig


def memory_breakdown(table: pd.DataFrame, breakdowns: dict[int, tuple[dict, dict]], budget_bytes: int, title: str):
    """Stacked bars of the top configs' peak composition, predicted beside measured."""
    from autofit.core.config import FIELDS, TrainConfig

    done = table[(table["status"] == "ok") & table["number"].isin(list(breakdowns))]
    top = done.assign(_r=_num(done["samples_per_s"])).sort_values("_r", ascending=False).head(TOP_BREAKDOWN)
    # room for a two-line title, three-line tick labels and the legend right of the bars
    fig = _figure(max(7.5, 1.9 * len(top) + 2.5), 5.2, top=0.6, right=1.5, bottom=0.7)
    ax = fig.add_subplot()
    if top.empty:
        ax.text(0.5, 0.5, "no trial ran ok yet", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        _title(ax, f"{title}: memory at the peak of the top configs")
        return fig
    largest = max(max(sum(v or 0 for v in b.values()) for b in breakdowns[n]) for n in top["number"])
    unit, size = _unit(max(largest, budget_bytes if budget_bytes < 4 * largest else 0))
    numbers = [int(n) for n in top["number"]]
    x = np.arange(len(numbers), dtype=float)  # a config's predicted bar at x, its measured one at x + 0.4
    for offset, kind in enumerate(("predicted", "measured")):
        bottom = np.zeros(len(numbers))
        for colour, (key, label) in zip(CATEGORY_COLOURS, CATEGORY_LABELS.items()):  # one call a layer of the stacks
            values = np.array([float(breakdowns[n][offset].get(key) or 0) for n in numbers]) / size
            ax.bar(x + offset * 0.4, values, width=0.38, bottom=bottom, color=colour,
                   alpha=0.55 if kind == "predicted" else 1.0, edgecolor="white", linewidth=0.5,
                   label=label if kind == "measured" else None)
            bottom += values
        for position, height in zip(x + offset * 0.4, bottom):
            ax.text(position, height, kind[:4] + ".", ha="center", va="bottom", fontsize=7)
    if budget_bytes / size <= 1.6 * largest / size:
        ax.axhline(budget_bytes / size, color="black", linestyle="--", linewidth=1, label="budget")
    configs = [TrainConfig.from_dict({f: row[f] for f in FIELDS}) for _, row in top.iterrows()]
    ax.set_xticks(x + 0.2, [f"#{n}\n{c.short().replace(' ckpt', chr(10) + 'ckpt')}" for n, c in zip(numbers, configs)],
                  fontsize=7)
    ax.set_ylabel(f"bytes at the peak ({unit})")
    _title(ax, f"{title}: memory at the peak, top {len(top)} configs\n(left, pale: predicted; right, solid: measured)")
    ax.margins(y=0.1)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    return fig


def best_so_far(table: pd.DataFrame, title: str):
    """The best measured throughput so far against seconds since the study's first trial began."""
    fig = _figure()
    ax = fig.add_subplot()
    real = table[table["status"].isin(REAL)].copy()
    started = pd.to_datetime(table["started"], errors="coerce").min()
    real["t"] = (pd.to_datetime(real["finished"], errors="coerce") - started).dt.total_seconds()
    done = real[(real["status"] == "ok") & real["t"].notna()].sort_values("t")
    if done.empty or pd.isna(started):
        ax.text(0.5, 0.5, "no trial ran ok yet", ha="center", va="center", transform=ax.transAxes)
    else:
        rates = _num(done["samples_per_s"])
        ax.scatter(done["t"], rates, s=18, color=STATUS_COLOURS["ok"], alpha=0.6, label="each trial that ran ok")
        best = np.fmax.accumulate(np.nan_to_num(rates, nan=0.0))
        ax.step(np.r_[0.0, done["t"].to_numpy()], np.r_[0.0, best], where="post", color="black", linewidth=1.5,
                label="best so far")
        failed = real[real["status"] != "ok"]
        if not failed.empty:
            ax.scatter(failed["t"], np.zeros(len(failed)), s=24, marker="x", color=STATUS_COLOURS["oom"],
                       label=f"oom / error / timeout ({len(failed)})")
        ax.legend(fontsize=8, loc="lower right")
    ax.set_xlabel("wall time since the study's first trial (s)")
    ax.set_ylabel("throughput (samples/s)")
    _title(ax, f"{title}: best throughput so far")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    return fig


def render(table: pd.DataFrame, breakdowns: dict[int, tuple[dict, dict]], budget_bytes: int, best: int | None,
           title: str) -> dict[str, bytes]:
    """Every picture as PNG bytes, keyed by :data:`PICTURES` names."""
    import io

    figures = {
        "throughput_vs_peak": throughput_vs_peak(table, budget_bytes, best, title),
        "predicted_vs_measured": predicted_vs_measured(table, title),
        "memory_breakdown": memory_breakdown(table, breakdowns, budget_bytes, title),
        "best_so_far": best_so_far(table, title),
    }
    out = {}
    for name, fig in figures.items():
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png")
        out[name] = buffer.getvalue()
    return out


def write(pngs: dict[str, bytes], out_dir: str | Path) -> dict[str, Path]:
    """Write ``render``'s PNGs as ``<name>.png`` in ``out_dir`` (each whole or not at all)."""
    paths = {}
    for name, data in pngs.items():
        path = Path(out_dir) / f"{name}.png"
        write_atomic(path, data)
        paths[name] = path
    return paths


def breakdowns_of(records) -> dict[int, tuple[dict, dict]]:
    """Per trial that ran ok and measured one: (predicted, measured) peak composition by category."""
    out = {}
    for r in records:
        measured = r.measurement.get("breakdown") or {}
        if r.status.value == "ok" and any(v is not None for v in measured.values()):
            out[r.number] = ({k: r.prediction.get(k) for k in CATEGORY_LABELS}, dict(measured))
    return out
