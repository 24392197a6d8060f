"""The search in pictures: four PNGs written with the tables, each readable on its own.

- ``throughput_vs_peak.png``: every real trial's throughput (the search's objective) against its
  measured peak, coloured by status, the best config starred on the sample it is ranked by, the budget as a
  vertical line (or, far right of the data, named at the axis' end rather than stretching it), and
  the configs the estimate pruned drawn hollow at their estimate, one legend entry per prune reason;
- ``predicted_vs_measured.png``: predicted against measured peak, and step time, for every
  real trial, with the line where they are equal;
- ``memory_breakdown.png``: weights, gradients, optimizer state, activations, temporaries and
  overhead of the top configs at their peak, predicted beside measured;
- ``best_so_far.png``: the best measured throughput so far against the study's wall time.

Input is plain data: the trials table (``autofit.report.tables.trials_table``'s columns; its
``trial`` column is the number shown), per storage number the predicted and measured breakdowns
(:func:`breakdowns_of`) and the pruned configs' estimates (:func:`estimates_of`). matplotlib draws
through its Agg canvas directly (no pyplot), so nothing here touches a caller's backend or needs a
display. Every drawn collection has a ``gid`` (``status:ok``, ``pruned:devices``, ``best``...) so a
test can read what was drawn where.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from autofit.core.budget import format_bytes
from autofit.core.files import write_atomic
from autofit.core.records import TrialStatus

PICTURES = ("throughput_vs_peak", "predicted_vs_measured", "memory_breakdown", "best_so_far")
REAL = tuple(s.value for s in TrialStatus if s.ran)  # real trials that finished
STATUS_COLOURS = {"ok": "#2a9d3f", "oom": "#d62728", "error": "#7f3fbf", "timeout": "#ff7f0e",
                  "pruned": "#b0b0b0"}
# Pruned configs are drawn hollow (an estimate, never measured), one colour per reason.
REASON_COLOURS = {"devices": "#6baed6", "dominated": "#969696", "over_budget": "#e6550d", "too_slow": "#9e9ac8",
                  "slow_precision": "#74c476", "duplicate": "#bdbdbd", "invalid": "#e7969c"}
CATEGORY_LABELS = {"params_bytes": "weights", "grads_bytes": "gradients", "optimizer_bytes": "optimizer state",
                   "activations_bytes": "activations", "temporary_bytes": "temporaries", "overhead_bytes": "overhead"}
CATEGORY_COLOURS = ("#4c72b0", "#55a868", "#c44e52", "#8172b2", "#ccb974", "#64b5cd")
TOP_BREAKDOWN = 5
DPI = 110
# The x-axis of throughput_vs_peak: pruned estimates up to this many times the largest real peak are
# in range (further ones sit at the right edge, counted); a budget up to this many times it too
# (further, it is named at the edge). So the axis is never stretched past 1.5 x 1.08 of the data.
NEAR = 1.5
PAD = 1.08
NO_TRIAL = "no real trial has run\n(what the estimate pruned, and why: summary.md)"
WIDE, RIGHT = 9.5, 2.5  # throughput_vs_peak's width and its right margin (the legend and notes), inches


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


def _nothing(ax, text: str) -> None:
    """An empty panel that says why, without the meaningless 0..1 axes."""
    ax.set_axis_off()
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=10, color="#444444",
            wrap=True)


def _empty_figure(title: str, text: str):
    """A short picture that only says why there is nothing to draw (a page of empty axes says nothing)."""
    fig = _figure(7.5, 1.6, top=0.4, bottom=0.1)
    ax = fig.add_subplot()
    _title(ax, title)
    _nothing(ax, text)
    return fig


def _unit(max_bytes: float) -> tuple[str, float]:
    """The binary unit that keeps axis numbers short, and its size."""
    for name, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if max_bytes >= size:
            return name, float(size)
    return "bytes", 1.0


def _num(series) -> np.ndarray:
    return pd.to_numeric(pd.Series(series), errors="coerce").astype(float).to_numpy()


def _reason_name(kind: str) -> str:
    return str(kind).replace("_", " ")


def objective_label(devices: int) -> str:
    """The throughput axes' label: what :mod:`autofit.core.objective` scores on ``devices`` devices."""
    if devices <= 1:
        return "throughput (samples/s per device)"
    return f"throughput (samples/s of the job on {devices} devices;\nper device for larger splits)"


def _real_peaks(rows: pd.DataFrame) -> np.ndarray:
    """A real trial's measured peak, else (a failed trial measured none) its predicted one."""
    measured = _num(rows["measured_peak_bytes"])
    return np.where(np.isnan(measured), _num(rows["predicted_peak_bytes"]), measured)


def throughput_vs_peak(table: pd.DataFrame, budget_bytes: int, best: int | None, title: str, *,
                       estimates: pd.DataFrame | None = None, devices: int = 1, calibrated_on: int | None = None):
    """Throughput against peak for every real trial; the configs the estimate pruned hollow, at their estimate.

    ``best``: the storage number of the best config's best sample (starred). ``estimates``
    (:func:`estimates_of`): per pruned storage number, its calibrated peak and objective; without
    them the pruned configs are drawn at what was predicted when they were pruned.
    ``calibrated_on``: how many real trials that calibration learned from (said in the note)."""
    # Long on purpose: one figure's layers in drawing order (ran, best, pruned by reason, the budget, the axes); split, each part would need them all.
    from autofit.report.tables import never_ran

    fig = _figure(WIDE, 4.8, right=RIGHT)
    ax = fig.add_subplot()
    real = table[table["status"].isin(REAL)]
    pruned = never_ran(table)
    real_peak = _real_peaks(real)
    real_rate = np.nan_to_num(_num(real["objective"]), nan=0.0)  # a failed trial measured nothing: on the axis
    if estimates is not None and not pruned.empty:
        est = estimates.reindex(pruned["number"].to_numpy())
        pruned_peak, pruned_rate = _num(est["peak_bytes"]), _num(est["objective"])
    else:
        pruned_peak, pruned_rate = _num(pruned["predicted_peak_bytes"]), _num(pruned["predicted_samples_per_s"])
    drawable = np.isfinite(pruned_peak) & np.isfinite(pruned_rate)

    # x range: the real trials (else, when none ran, the estimates), pruned estimates near them, the budget if near
    core = real_peak[np.isfinite(real_peak)]
    if not core.size:
        core = pruned_peak[drawable]
    data_max = float(core.max()) if core.size else float(budget_bytes or 1)
    near = pruned_peak[drawable & (pruned_peak <= NEAR * data_max)]
    high = max([data_max, *near.tolist()])
    budget_near = bool(budget_bytes) and budget_bytes <= NEAR * high
    if budget_near:
        high = max(high, float(budget_bytes))
    unit, size = _unit(high)
    x_max = PAD * high / size

    # pruned configs: hollow, by reason; those right of the axis at its edge (">"), counted
    clipped_total = 0
    kinds = pruned["reason_kind"].fillna("other").to_numpy()
    for kind in dict.fromkeys(kinds):
        mask = kinds == kind
        n = int(mask.sum())
        show = mask & drawable
        x, y = pruned_peak[show] / size, pruned_rate[show]
        inside = x <= x_max
        colour = REASON_COLOURS.get(kind, STATUS_COLOURS["pruned"])
        label = f"pruned: {_reason_name(kind)} ({n})" + ("" if show.any() else ", no estimate")
        ax.scatter(x[inside], y[inside], s=16, facecolors="none", edgecolors=colour, linewidths=0.8, alpha=0.8,
                   zorder=1, label=label, gid=f"pruned:{kind}")
        if (~inside).any():
            clipped_total += int((~inside).sum())
            ax.scatter(np.full(int((~inside).sum()), x_max), y[~inside], s=22, marker=">", color=colour, alpha=0.8,
                       zorder=1, clip_on=False, gid=f"pruned-beyond:{kind}")
    statuses = real["status"].to_numpy()
    for status in REAL:
        mask = statuses == status
        if mask.any():
            ax.scatter(real_peak[mask] / size, real_rate[mask], s=36, color=STATUS_COLOURS[status],
                       marker="o" if status == "ok" else "x", zorder=3, label=f"ran {status} ({int(mask.sum())})",
                       gid=f"status:{status}")
    budget_text = f"budget {format_bytes(budget_bytes)}" if budget_bytes else None
    if budget_near:
        ax.axvline(budget_bytes / size, color="black", linestyle="--", linewidth=1, label=budget_text, gid="budget")
    if best is not None and (table["number"] == best).any():
        row = table[table["number"] == best].iloc[0]
        # where the figure was timed (its own trial, or head to head beside the other leaders), as the tables say it
        together = "" if pd.isna(row.get("head_to_head")) else ", timed head to head"
        ax.scatter([float(row["measured_peak_bytes"]) / size], [float(row["objective"])], s=280, marker="*",
                   color="gold", edgecolors="black", zorder=4, label=f"best: trial {row['trial']}{together}", gid="best")

    notes = []
    if budget_text and not budget_near:
        notes.append(f"{budget_text} →")  # far right of the data: named, not drawn
    if clipped_total:
        notes.append(f"{clipped_total} pruned further right →")
    if notes:
        ax.annotate("\n".join(notes), xy=(1.0, 0.0), xycoords="axes fraction", xytext=(6, 0),
                    textcoords="offset points", ha="left", va="center", fontsize=8, gid="edge-note")
    if len(pruned):
        if estimates is None:
            basis = "as predicted when pruned"
        else:
            basis = f"calibrated on the {calibrated_on} real trial(s)" if calibrated_on else "uncalibrated:\nno real trial ran"
        fig.text(1 - (RIGHT - 0.1) / WIDE, 0.45, f"hollow: pruned, never ran;\ndrawn at the estimate,\n{basis}",
                 ha="left", va="bottom", fontsize=7.5, color="#444444", gid="pruned-note")
    ax.set_xlabel(f"peak memory per device ({unit}): measured; pruned: estimated")
    ax.set_ylabel(objective_label(devices))
    _title(ax, f"{title}: throughput against peak memory")
    ax.set_xlim(0, x_max)
    visible = np.r_[real_rate, pruned_rate[drawable]]
    ax.set_ylim(0, 1.08 * float(np.nanmax(visible)) if visible.size and np.nanmax(visible) > 0 else 1.0)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if handles:  # what ran first, then the estimates (drawn first, beneath)
        order = sorted(range(len(labels)), key=lambda i: labels[i].startswith("pruned"))
        ax.legend([handles[i] for i in order], [labels[i] for i in order], fontsize=8, loc="upper left",
                  bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    return fig


def _log_ticks(axis, low: float, high: float) -> None:
    """Few, plain tick labels on a log axis (1, 2, 5 per decade when it spans few decades, else 1)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    decades = np.log10(high / low)
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if decades <= 2.5 else (1.0,)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _identity_panel(ax, predicted: np.ndarray, measured: np.ndarray, statuses: np.ndarray, scale: float,
                    unit: str, what: str) -> None:
    ok = ~(np.isnan(predicted) | np.isnan(measured))
    if not ok.any():
        _nothing(ax, f"no real trial measured its {what}" if len(statuses) else NO_TRIAL)
        return
    for status in REAL:
        mask = ok & (statuses == status)
        if mask.any():
            ax.scatter(predicted[mask] / scale, measured[mask] / scale, s=30, color=STATUS_COLOURS[status],
                       label=f"ran {status}", zorder=3, gid=f"status:{status}")
    values = np.r_[predicted[ok], measured[ok]] / scale
    low, high = float(values.min()), float(values.max())
    if low > 0 and high / low > 20:
        ax.set_xscale("log")
        ax.set_yscale("log")
        low, high = low / 1.25, high * 1.25
        for axis in (ax.xaxis, ax.yaxis):
            _log_ticks(axis, low, high)
    else:
        pad = 0.06 * (high - low or high or 1.0)
        low, high = low - pad, high + pad
    ax.plot([low, high], [low, high], color="black", linewidth=1, label="predicted = measured", zorder=2)
    ax.set_xlim(low, high)
    ax.set_ylim(low, high)
    ax.set_xlabel(f"predicted {what} ({unit})")
    ax.set_ylabel(f"measured {what} ({unit})")
    ax.grid(alpha=0.3)


def predicted_vs_measured(table: pd.DataFrame, title: str):
    """Predicted against measured peak and step time for every real trial, with the line where they are equal."""
    real = table[table["status"].isin(REAL)]
    if real.empty:
        return _empty_figure(f"{title}: predicted against measured", NO_TRIAL)
    fig = _figure(11.0, 5.0, top=0.6, bottom=0.9, wspace=0.28)  # the figure's title above, one legend below
    left, right = fig.subplots(1, 2)
    predicted, measured = _num(real["predicted_peak_bytes"]), _num(real["measured_peak_bytes"])
    unit, size = _unit(np.nanmax(np.r_[predicted, measured, 1.0]))
    statuses = real["status"].to_numpy()
    _identity_panel(left, predicted, measured, statuses, size, unit, "peak per device")
    _title(left, "peak memory per device")
    _identity_panel(right, _num(real["predicted_step_time_s"]), _num(real["step_time_s"]), statuses, 1.0, "s",
                    "step time")
    _title(right, "step time (one optimizer step)")
    labels = {}
    for ax in (left, right):
        for handle, label in zip(*ax.get_legend_handles_labels()):
            labels.setdefault(label, handle)
    if labels:
        fig.legend(list(labels.values()), list(labels), loc="lower center", ncol=len(labels), fontsize=8,
                   frameon=False)
    fig.suptitle(f"{title}: predicted (before it ran) against measured, every real trial")
    return fig


def memory_breakdown(table: pd.DataFrame, breakdowns: dict[int, tuple[dict, dict]], budget_bytes: int, title: str,
                     top: list[int] | None = None):
    """Stacked bars of the top configs' peak composition, predicted beside measured.

    ``top``: the storage numbers of the top configs' best samples, best first (the summary's ranking,
    :func:`autofit.report.tables.top_configs`); without it, the ok trials by objective."""
    from autofit.core.config import FIELDS, TrainConfig

    if top is not None:
        order = [n for n in top if n in breakdowns][:TOP_BREAKDOWN]
        rows = table.set_index("number").loc[order].reset_index() if order else table.iloc[:0]
    else:
        done = table[(table["status"] == "ok") & table["number"].isin(list(breakdowns))]
        rows = done.assign(_r=_num(done["objective"])).sort_values("_r", ascending=False).head(TOP_BREAKDOWN)
    if rows.empty:
        return _empty_figure(f"{title}: memory at the peak of the top configs",
                             "no real trial ran ok: no measured peak to break down"
                             if table["status"].isin(REAL).any() else NO_TRIAL)
    numbers = [int(n) for n in rows["number"]]
    used = [key for key in CATEGORY_LABELS  # a category nothing holds (overhead on a CPU) is left out of the legend
            if any(float(breakdowns[n][k].get(key) or 0) for n in numbers for k in (0, 1))]
    # room for a two-line title, three-line tick labels and the legend right of the bars
    fig = _figure(max(7.5, 1.9 * len(rows) + 2.5), 5.2, top=0.6, right=1.5, bottom=0.7)
    ax = fig.add_subplot()
    largest = max(sum(float(v or 0) for v in breakdowns[n][k].values()) for n in numbers for k in (0, 1))
    budget_shown = bool(budget_bytes) and budget_bytes <= 1.6 * largest
    unit, size = _unit(max(largest, budget_bytes if budget_shown else 0))
    x = np.arange(len(numbers), dtype=float)  # a config's predicted bar at x, its measured one at x + 0.4
    for offset, kind in enumerate(("predicted", "measured")):
        bottom = np.zeros(len(numbers))
        for colour, (key, label) in zip(CATEGORY_COLOURS, CATEGORY_LABELS.items()):  # one call a layer of the stacks
            if key not in used:
                continue
            values = np.array([float(breakdowns[n][offset].get(key) or 0) for n in numbers]) / size
            ax.bar(x + offset * 0.4, values, width=0.38, bottom=bottom, color=colour,
                   alpha=0.55 if kind == "predicted" else 1.0, edgecolor="white", linewidth=0.5,
                   label=label if kind == "measured" else None)
            bottom += values
        for position, height in zip(x + offset * 0.4, bottom):
            ax.text(position, height, kind[:4] + ".", ha="center", va="bottom", fontsize=7)
    if budget_shown:
        ax.axhline(budget_bytes / size, color="black", linestyle="--", linewidth=1,
                   label=f"budget {format_bytes(budget_bytes)}")
    # an explicit top: the bars' labels stay inside the frame (a zero-height layer's sticky edge at
    # the stack's top would cancel margins)
    ax.set_ylim(0, 1.14 * max(largest, budget_bytes if budget_shown else 0) / size)
    configs = [TrainConfig.from_dict({f: row[f] for f in FIELDS}) for _, row in rows.iterrows()]
    ax.set_xticks(x + 0.2, [f"trial {t}\n{c.short().replace(' ckpt', chr(10) + 'ckpt')}"
                            for t, c in zip(rows["trial"], configs)], fontsize=7)
    ax.set_ylabel(f"bytes at the peak ({unit})")
    _title(ax, f"{title}: memory at the peak, top {len(rows)} configs\n(left, pale: predicted; right, solid: measured)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    return fig


def best_curve(table: pd.DataFrame, budget_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """(seconds since the first real trial started, the best objective so far) at each real trial's end,
    ranked as the report ranks (:func:`autofit.core.records.best_of`): a config by its best sample,
    among those whose every trial so far ran ok under the budget."""
    from autofit.core.config import FIELDS

    real = table[table["status"].isin(REAL)]
    started = pd.to_datetime(real["started"], errors="coerce").min()
    t = (pd.to_datetime(real["finished"], errors="coerce") - started).dt.total_seconds().to_numpy()
    order = np.argsort(np.where(np.isnan(t), np.inf, t), kind="stable")
    keys = [tuple(map(str, k)) for k in real[list(FIELDS)].to_numpy()]
    fits = (real["status"].to_numpy() == "ok") & ~(_num(real["measured_peak_bytes"]) > budget_bytes if budget_bytes
                                                   else np.zeros(len(real), dtype=bool))
    rate = _num(real["objective"])
    failed, bests, times, values = set(), {}, [], []
    for i in order:
        if np.isnan(t[i]):
            continue
        if fits[i] and np.isfinite(rate[i]):
            bests[keys[i]] = max(bests.get(keys[i], 0.0), rate[i])
        else:
            failed.add(keys[i])
        times.append(t[i])
        values.append(max([v for k, v in bests.items() if k not in failed], default=0.0))
    return np.array(times), np.array(values)


def best_so_far(table: pd.DataFrame, title: str, budget_bytes: int = 0, best: int | None = None, devices: int = 1):
    """The best measured throughput so far against seconds since the study's first real trial began."""
    real = table[table["status"].isin(REAL)].copy()
    started = pd.to_datetime(real["started"], errors="coerce").min()
    real["t"] = (pd.to_datetime(real["finished"], errors="coerce") - started).dt.total_seconds()
    done = real[(real["status"] == "ok") & real["t"].notna()].sort_values("t")
    if done.empty or pd.isna(started):
        return _empty_figure(f"{title}: best throughput so far",
                             "no real trial ran ok: nothing measured to draw" if len(real) else NO_TRIAL)
    fig = _figure(7.5, 5.0, bottom=0.95)
    ax = fig.add_subplot()
    _title(ax, f"{title}: best throughput so far")
    ax.scatter(done["t"], _num(done["objective"]), s=18, color=STATUS_COLOURS["ok"], alpha=0.6,
               label="a trial that ran ok", gid="status:ok")
    times, values = best_curve(table, budget_bytes)
    shown = values > 0  # from the first trial that ran ok under the budget
    ax.step(times[shown], values[shown], where="post", color="black", linewidth=1.5, label="best so far",
            gid="best-so-far")
    failed = real[real["status"] != "ok"]
    if not failed.empty:
        ax.scatter(failed["t"], np.zeros(len(failed)), s=24, marker="x", color=STATUS_COLOURS["oom"], clip_on=False,
                   label=f"oom / error / timeout ({len(failed)})", gid="failed")
    if best is not None and (real["number"] == best).any():
        row = real[real["number"] == best].iloc[0]
        ax.scatter([row["t"]], [float(row["objective"])], s=220, marker="*", color="gold", edgecolors="black",
                   zorder=4, label=f"best: trial {row['trial']}", gid="best")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=4, frameon=False)
    ax.set_xlabel("seconds since the first real trial started")
    ax.set_ylabel(objective_label(devices))
    ax.set_xlim(0, max(1.05 * float(real["t"].max()), 1.0))  # trials within one second of each other
    ax.set_ylim(0, 1.1 * float(np.nanmax(_num(done["objective"]))))
    ax.grid(alpha=0.3)
    return fig


def render(table: pd.DataFrame, breakdowns: dict[int, tuple[dict, dict]], budget_bytes: int, best: int | None,
           title: str, *, estimates: pd.DataFrame | None = None, devices: int = 1, calibrated_on: int | None = None,
           top: list[int] | None = None) -> dict[str, bytes]:
    """Every picture as PNG bytes, keyed by :data:`PICTURES` names (``best``: the best sample's storage number)."""
    import io

    figures = {
        "throughput_vs_peak": throughput_vs_peak(table, budget_bytes, best, title, estimates=estimates,
                                                 devices=devices, calibrated_on=calibrated_on),
        "predicted_vs_measured": predicted_vs_measured(table, title),
        "memory_breakdown": memory_breakdown(table, breakdowns, budget_bytes, title, top),
        "best_so_far": best_so_far(table, title, budget_bytes, best, devices),
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


def estimates_of(records, calibration, devices: int = 1) -> pd.DataFrame:
    """Per pruned config (index: its storage number), its estimate corrected by ``calibration`` (the
    study's, from every real trial; what the planner would predict now): ``peak_bytes`` and ``objective``
    (:func:`autofit.core.objective.objective` on ``devices``). A config pruned before any trial ran was
    predicted by the uncalibrated model, which may be far off (on a shared CPU 1.2x to 3x fast): drawn at
    that, it would sit above configs that measured faster. Where a record keeps no uncalibrated time
    (older journals), its objective is the one predicted when it was pruned."""
    from autofit.core.objective import objective

    pruned = [r for r in records if r.status is TrialStatus.PRUNED]
    frame = pd.DataFrame([r.config.to_dict() for r in pruned], index=[r.number for r in pruned])
    if frame.empty:
        return pd.DataFrame({"peak_bytes": [], "objective": []})
    ratios = np.asarray(calibration.time_ratios(frame), dtype=float)
    peaks, rates = [], []
    for r, ratio in zip(pruned, ratios):
        p = r.prediction
        peak = p.get("peak_bytes")
        peaks.append(np.nan if peak is None else float(calibration.corrected_peak(float(peak))))
        prior = p.get("prior_step_time_s")
        if prior:
            rate = objective(r.config, r.config.samples_per_step / (prior * ratio), devices)
        else:
            rate = p.get("objective") or p.get("samples_per_s")
        rates.append(np.nan if rate is None else float(rate))
    return pd.DataFrame({"peak_bytes": peaks, "objective": rates}, index=frame.index)
