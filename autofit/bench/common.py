"""What every suite shares: the environment header, error statistics, and Markdown/CSV writing.

Tables are written from plain rows (lists of dicts) so a suite's numbers go to disk exactly as
computed; nothing under ``results/benchmarks/`` is ever edited by hand.
"""

from __future__ import annotations

import csv
import datetime as _dt
import enum
import math
import os
import platform
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

# Every real training step of a benchmark runs in a child process that inherits this: GNU OpenMP's
# default spin-wait makes a step up to 100x slower when other processes share the two cores.
BENCH_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def apply_bench_env() -> None:
    """Set :data:`BENCH_ENV` in this process's environment (children inherit it)."""
    for key, value in BENCH_ENV.items():
        os.environ.setdefault(key, value)


# --------------------------------------------------------------------------------------
# The environment header


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / 2**30
    except (OSError, ValueError, IndexError):
        pass
    return None


def _git_commit() -> str:
    root = Path(__file__).resolve().parent.parent.parent
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=False)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=False)
        commit = out.stdout.strip() or "unknown"
        return commit + (" (with uncommitted changes)" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment(command: str = "autofit bench", probe_host: bool = False) -> dict[str, str]:
    """Machine, device, versions and date: the header of every table. ``probe_host``: also the CPU's
    matmul rates now (:func:`host_speed`, a second or two)."""
    import optuna
    import pandas
    import torch

    from autofit.core.version import __version__

    memory = _memory_gib()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    device = "cpu"
    if torch.cuda.is_available():
        device = f"cuda ({torch.cuda.get_device_name(0)})"
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{_cpu_model()}, {os.cpu_count()} logical CPUs"
                   + (f", {memory:.0f} GiB RAM" if memory else "") + f", {platform.system()} {platform.release()}",
        "device": device,
        "load average at start (1, 5, 15 min)": load,
        **({HOST_SPEED: host_speed()} if probe_host else {}),
        "versions": f"autofit {__version__} (git {_git_commit()}), torch {torch.__version__}, "
                    f"optuna {optuna.__version__}, numpy {np.__version__}, pandas {pandas.__version__}, "
                    f"Python {platform.python_version()}",
        "environment": ", ".join(f"{k}={os.environ.get(k, '')}" for k in BENCH_ENV),
        "command": f"`{command}`",
    }


HOST_SPEED = "CPU speed at start"


def host_speed(probes: int = 3) -> str:
    """The CPU's matmul rates now, the best of ``probes`` runs of autofit's device probe (on a GPU machine
    too: the trials' Python and data work run there). Two runs of the bench on one machine compare only
    at like speeds, and neither the load average nor the kernel's steal time shows a slower host: the
    2-core machine this repository's bench runs on, under the same name and at no higher load, has read
    fp32 188-248 GFLOP/s on one day against 354-391 the day before, its trials then twice as long and
    their noise twice as wide."""
    from functools import reduce

    from autofit.probes.device_rates import best_of, measure_rates

    runs = [measure_rates("cpu", ("float32", "bfloat16")) for _ in range(max(1, probes))]
    flops = reduce(best_of, runs).matmul_flops_per_s
    return (f"matmul fp32 {flops['float32'] / 1e9:.0f}, bf16 {flops['bfloat16'] / 1e9:.0f} GFLOP/s "
            f"(best of {len(runs)} probe{'s' * (len(runs) > 1)})")


# --------------------------------------------------------------------------------------
# Statistics


def relative_error(predicted: float, measured: float) -> float:
    """``(predicted - measured) / measured``: negative is an under-estimate."""
    if measured is None or predicted is None or not measured:
        return math.nan
    return (float(predicted) - float(measured)) / float(measured)


@dataclass(frozen=True)
class ErrorStats:
    """Absolute relative errors of a set of predictions."""

    n: int
    median: float
    p95: float
    max: float
    mean_signed: float   # mean of the signed errors: < 0 means the estimator is low on average
    under: int           # predictions below the measurement

    @classmethod
    def of(cls, errors: Iterable[float]) -> ErrorStats:
        e = np.array([x for x in errors if x is not None and not math.isnan(x)], dtype=np.float64)
        if e.size == 0:
            return cls(0, math.nan, math.nan, math.nan, math.nan, 0)
        a = np.abs(e)
        return cls(int(e.size), float(np.median(a)), float(np.percentile(a, 95)), float(a.max()),
                   float(e.mean()), int((e < 0).sum()))


class Spread(NamedTuple):
    median: float
    low: float
    high: float


def median_and_spread(values: Sequence[float | None]) -> Spread:
    """(median, min, max) of the non-missing values; NaNs when there are none."""
    v = np.array([x for x in values if x is not None and not (isinstance(x, float) and math.isnan(x))],
                 dtype=np.float64)
    if v.size == 0:
        return Spread(math.nan, math.nan, math.nan)
    return Spread(float(np.median(v)), float(v.min()), float(v.max()))


# --------------------------------------------------------------------------------------
# Formatting and writing


def missing(x: float | None) -> bool:
    """None or NaN: shown as ``-`` in the tables."""
    return x is None or (isinstance(x, float) and math.isnan(x))


def pct(x: float | None, digits: int = 1) -> str:
    """A fraction as a percentage, ``-`` when missing."""
    return "-" if missing(x) else f"{100 * x:.{digits}f}%"


def signed_pct(x: float | None, digits: int = 2) -> str:
    return "-" if missing(x) else f"{100 * x:+.{digits}f}%"


def mib(n_bytes: float | None) -> str:
    return "-" if missing(n_bytes) else f"{n_bytes / 2**20:.1f}"


def seconds(x: float | None, digits: int = 1) -> str:
    return "-" if missing(x) else f"{x:.{digits}f}"


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], align: str | None = None) -> str:
    """A GitHub Markdown table. ``align``: one of ``l``/``r`` per column (default: left)."""
    def cell(x: Any) -> str:
        return str(x).replace("|", "\\|").replace("\n", " ")

    align = align or "l" * len(headers)
    lines = ["| " + " | ".join(cell(h) for h in headers) + " |",
             "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(cell(x) for x in row) + " |")
    return "\n".join(lines)


def write_csv(path: Path, rows: Sequence[dict], columns: Sequence[str] | None = None) -> Path:
    """Rows (dicts) as CSV with a header; columns default to the union of keys in first-seen order."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if columns is None:
        columns = list(dict.fromkeys(k for row in rows for k in row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _csv_value(row.get(k)) for k in columns})
    return path


def _csv_value(x: Any) -> Any:
    if isinstance(x, enum.Enum):
        return x.value
    if isinstance(x, float) and math.isnan(x):
        return ""
    if isinstance(x, (list, tuple)):
        return " ".join(str(v) for v in x)
    return "" if x is None else x


@dataclass
class Report:
    """A Markdown document built section by section, with the environment header on top."""

    title: str
    env: dict[str, str]
    parts: list[str] = field(default_factory=list)
    generator: str = "autofit bench"   # what wrote it (the header's command says how exactly)

    def add(self, text: str) -> None:
        self.parts.append(text.strip("\n"))

    def text(self) -> str:
        header = [f"# {self.title}", "",
                  f"Generated by `{self.generator}`; regenerate with the command below, never edit by hand.", ""]
        header += [f"- **{k}**: {v}" for k, v in self.env.items()]
        return "\n".join(header) + "\n\n" + "\n\n".join(self.parts) + "\n"

    def write(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.text())
        return path


def try_plot(path: Path, draw) -> Path | None:
    """Call ``draw(plt)`` and save a PNG when matplotlib is importable; otherwise do nothing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig = draw(plt)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
