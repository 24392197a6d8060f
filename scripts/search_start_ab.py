"""How long a short ``autofit search`` takes from the shell, this checkout against another revision,
interleaved: a change to what a search does before its first trial is judged by it.

    python scripts/search_start_ab.py --base HEAD~1 --pairs 6            # warm caches (filled once per side)
    python scripts/search_start_ab.py --base HEAD~1 --pairs 4 --cold     # empty caches every run

Each side runs ``python -m autofit search --budget 200MB --trials 1`` (gpt-tiny, the README's command
cut to one trial) as a new process, from its own checkout (the base in a temporary git worktree) and
with its own cache directory; the runs alternate, base first. Printed per pair: seconds from the
command's start until its first trial's line says it is running, until that trial's result, and until
the command exits; then the medians and the median of the paired differences. Run it alone: the
machine's other load moves every figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(checkout: Path, cache: Path, out: Path, budget: str) -> dict[str, float]:
    """One search; the seconds at which its first trial was running, had its result, and the command ended."""
    env = {**os.environ, "AUTOFIT_CACHE_DIR": str(cache)}
    command = [sys.executable, "-m", "autofit", "search", "--budget", budget, "--out", str(out), "--trials", "1"]
    started, marks = time.perf_counter(), {}
    with subprocess.Popen(command, cwd=checkout, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as process:
        for line in process.stdout:
            now = time.perf_counter() - started
            if "trial 1 " in line and "running" in line:
                marks.setdefault("running_s", now)
            elif "trial 1 " in line and "samples/s," in line:
                marks.setdefault("result_s", now)
    if process.returncode != 0:
        raise SystemExit(f"the search in {checkout} failed (exit {process.returncode})")
    marks["end_s"] = time.perf_counter() - started
    return marks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the revision to compare the working tree against")
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--cold", action="store_true", help="empty caches for every run")
    parser.add_argument("--budget", default="200MB")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="autofit-ab-") as tmp:
        root = Path(tmp)
        base = root / "base"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(base), args.base], check=True)
        try:
            sides = {"base": base, "this": REPO}
            if not args.cold:  # fill each side's caches once
                for name, checkout in sides.items():
                    _run(checkout, root / f"cache-{name}", root / f"out-{name}", args.budget)
            rows = []
            for pair in range(args.pairs):
                row = {}
                for name, checkout in sides.items():
                    cache, out = root / f"cache-{name}", root / f"out-{name}"
                    subprocess.run(["rm", "-rf", str(out)] + ([str(cache)] if args.cold else []), check=True)
                    row[name] = _run(checkout, cache, out, args.budget)
                rows.append(row)
                print(f"pair {pair + 1}: " + "; ".join(
                    f"{name} running {m.get('running_s', float('nan')):.2f} s, result {m.get('result_s', float('nan')):.2f} s, "
                    f"end {m['end_s']:.2f} s" for name, m in row.items()), flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], check=False)
    for key in ("running_s", "result_s", "end_s"):
        base_s = [r["base"][key] for r in rows if key in r["base"] and key in r["this"]]
        this_s = [r["this"][key] for r in rows if key in r["base"] and key in r["this"]]
        if base_s:
            sooner = sum(b > t for b, t in zip(base_s, this_s))
            print(f"{key}: base median {statistics.median(base_s):.2f} s, this {statistics.median(this_s):.2f} s; "
                  f"paired difference (base - this) median {statistics.median(b - t for b, t in zip(base_s, this_s)):.2f} s; "
                  f"this sooner in {sooner} of {len(base_s)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
