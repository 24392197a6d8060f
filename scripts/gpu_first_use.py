#!/usr/bin/env python
"""Where a cold search's first use goes on a GPU: imports, the CUDA context, profiling, the probe, the trial host.

Each part runs in a fresh interpreter with an empty autofit cache, one after another, and prints its wall
time (so one part's imports never warm another's):

- ``imports``: ``python -c pass``; torch; torch and a CUDA context; transformers' GPT-2 classes; autofit's
  search API; its CLI;
- ``concurrent``: what a search does before it plans (:func:`autofit.api.run_study.search`): the trial host
  started, the device probe in a thread, the default space's profile in this process; when each is done;
- ``profile``: that profile alone (every precision of the default space, split ends, selective forwards,
  optimizer choices), then one precision (bf16) with none of those;
- ``probe``: the device probe alone; ``host``: a trial host's start until it is ready;
- ``inproc``: the default space's profile in one process (``AUTOFIT_PROFILE_WORKERS=1``) under cProfile;
  the top functions go to ``--pstats``.

On the GPU machine, from the repository root (optuna carried as wheels, see scripts/gpu_check.py)::

    PYTHONUNBUFFERED=1 python3 scripts/gpu_first_use.py --pstats "$OUT/first_use_pstats.txt"

``results/benchmarks/gpu/run8-first-use.log`` is its output on an H100 (README.md there, run 8).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("imports", "concurrent", "profile", "probe", "host", "inproc")
IMPORTS = (
    ("python -c pass", "pass"),
    ("import torch", "import torch"),
    ("import torch + a CUDA context", "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()"),
    ("import transformers' GPT-2", "import torch; from transformers import GPT2Config, GPT2LMHeadModel"),
    ("import autofit.api.run_study", "import autofit.api.run_study"),
    ("import autofit.cli.search", "import autofit.cli.search"),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2", help="the workload (default %(default)s)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, among {', '.join(PARTS)}")
    parser.add_argument("--pstats", type=Path, help="where the inproc part writes its cProfile table")
    parser.add_argument("--part", help=argparse.SUPPRESS)  # one part, in the fresh interpreter the driver starts
    args = parser.parse_args()
    if args.part:
        return _one_part(args.part, args.model, args.pstats)
    parts = [p for p in args.parts.split(",") if p]
    if unknown := sorted(set(parts) - set(PARTS)):
        parser.error(f"unknown parts {', '.join(unknown)}; choose among {', '.join(PARTS)}")
    import torch

    if not torch.cuda.is_available():
        print("gpu_first_use: needs a CUDA device (torch.cuda.is_available() is False here)", file=sys.stderr)
        return 2
    for part in parts:
        for label, code in IMPORTS if part == "imports" else ((part, None),):
            cmd = [sys.executable, "-c", code] if code else [sys.executable, __file__, "--part", part,
                                                             "--model", args.model,
                                                             *(["--pstats", str(args.pstats)] if args.pstats else [])]
            _timed(label, cmd)
    return 0


def _timed(label: str, cmd: list[str]) -> None:
    env = {**os.environ, "AUTOFIT_CACHE_DIR": tempfile.mkdtemp(prefix="autofit-first-use-")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    started = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    said = done.stdout.strip() or (done.stderr.strip().splitlines() or [""])[-1]
    print(f"{label}: {time.perf_counter() - started:.2f} s (exit {done.returncode}) {said}", flush=True)


def _one_part(part: str, model: str, pstats_path: Path | None) -> int:
    from autofit.api.run_study import _profile, resolve_space
    from autofit.workloads.load import load_workload

    space, workload, started = resolve_space(None), load_workload(model), time.perf_counter()
    if part == "concurrent":
        from autofit.api.run_study import probe_beside_profiling
        from autofit.trial import host

        host.start_soon(workload.source, "cuda")
        early = probe_beside_profiling("cuda", list(space.precision))
        _profile(workload, space, "cuda", note=None)
        profiled_s = time.perf_counter() - started
        early.result()
        probed_s = time.perf_counter() - started
        ready = host.ready_within(120)
        print(f"profile done at {profiled_s:.2f} s, probe at {probed_s:.2f} s, "
              f"host ready={ready} at {time.perf_counter() - started:.2f} s")
        host.release()
    elif part == "profile":
        from autofit.profiling.profile import profile_workload

        _profile(workload, space, "cuda", note=None)
        whole_s, one_started = time.perf_counter() - started, time.perf_counter()
        profile_workload(workload, ["bf16"], device_type="cuda", use_cache=False, split_ends=False, selective=False)
        print(f"the default space's profile {whole_s:.2f} s; bf16 alone, no split ends, selective forwards "
              f"or optimizer choices {time.perf_counter() - one_started:.2f} s")
    elif part == "probe":
        from autofit.probes.device_rates import probe_rates

        probe_rates("cuda", use_cache=False, precisions=list(space.precision))
        print(f"device probe {time.perf_counter() - started:.2f} s")
    elif part == "host":
        from autofit.trial import host

        host.start_soon(workload.source, "cuda")
        print(f"host ready={host.ready_within(120)} at {time.perf_counter() - started:.2f} s")
        host.release()
    elif part == "inproc":
        _in_process(workload, space, pstats_path)
    return 0


def _in_process(workload, space, pstats_path: Path | None) -> None:
    import cProfile
    import io
    import pstats

    from autofit.api.run_study import _profile

    os.environ["AUTOFIT_PROFILE_WORKERS"] = "1"
    profiler, started = cProfile.Profile(), time.perf_counter()
    profiler.enable()
    _profile(workload, space, "cuda", note=None)
    profiler.disable()
    print(f"the default space's profile in one process, under cProfile: {time.perf_counter() - started:.2f} s")
    if pstats_path is not None:
        table = io.StringIO()
        stats = pstats.Stats(profiler, stream=table)
        stats.sort_stats("cumulative").print_stats(70)
        stats.sort_stats("tottime").print_stats(40)
        pstats_path.parent.mkdir(parents=True, exist_ok=True)
        pstats_path.write_text(table.getvalue())


if __name__ == "__main__":
    sys.exit(main())
