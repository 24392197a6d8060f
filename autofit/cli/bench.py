"""``autofit bench``: run the benchmark suites and write their tables."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from autofit.core.errors import ConfigError


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", help="benchmark the estimator, the search against its peers, and the machinery's cost",
        description="Run benchmark suites on this machine and write Markdown + CSV tables (machine, device, "
                    "versions and date on top). accuracy: predicted vs measured peak memory; search: autofit's "
                    "search against Optuna TPE, HF Accelerate, Lightning and DeepSpeed's method on exhaustively "
                    "measured grids; cost: estimator, profiler, trial runner and tracker costs; steady: the README's "
                    "searches run three times and beside a busy core, their answers measured quietly.",
        epilog="On a 2-core CPU: all suites take 60-75 minutes, --quick about 5.",
    )
    p.add_argument("--suite", choices=("accuracy", "search", "cost", "steady", "all"), default="all",
                   help="which suite to run (default: all)")
    p.add_argument("--quick", action="store_true", help="a reduced version of each suite (minutes, not half an hour)")
    p.add_argument("--out", type=Path,
                   help="output directory (default: results/benchmarks, or results/benchmarks/quick with --quick; "
                        "results/benchmarks/selected with --workloads)")
    p.add_argument("--workloads", metavar="PART[,PART...]",
                   help="accuracy suite only: measure just the workloads whose name contains one of these parts, "
                        "e.g. --workloads hf:,user_models (default: all)")
    p.add_argument("--lean", action="store_true",
                   help="just the lean space's levers (adafactor, adamw8bit, selective checkpointing): the accuracy "
                        "suite measures only the configs that use them, the search suite runs only its lean cell; "
                        "with --suite all, those two (the cost and steady suites have no lean part) and no summary.md; "
                        "not with --suite cost or steady (default folder results/benchmarks/lean)")
    p.set_defaults(run=run)


def _restart_with_bench_env(args: argparse.Namespace) -> None:
    """Run this command again in a fresh interpreter with ``OMP_WAIT_POLICY=PASSIVE``.

    GNU OpenMP reads the policy when the library loads, before this code runs; with its default
    spin-wait, the benchmark process's own timed work (the time model's device probe, which
    autofit's search runs in-process) is up to 500x slow on a loaded 2-core machine.
    """
    argv = [sys.executable, "-m", "autofit", "bench", "--suite", args.suite]
    argv += ["--quick"] if args.quick else []
    argv += ["--out", str(args.out)] if args.out else []
    argv += ["--workloads", args.workloads] if args.workloads else []
    argv += ["--lean"] if args.lean else []
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})


def _workload_parts(args: argparse.Namespace) -> tuple[str, ...]:
    if args.workloads is None:
        return ()
    parts = tuple(p.strip() for p in args.workloads.split(",") if p.strip())
    if not parts:
        raise ConfigError(f"--workloads {args.workloads!r} names no workload: expected parts of workload names, "
                          "e.g. --workloads hf:,user_models")
    if args.suite != "accuracy":
        raise ConfigError("--workloads selects the accuracy suite's workloads: use it with --suite accuracy")
    return parts


def _check_lean(args: argparse.Namespace) -> None:
    if args.lean and args.suite in ("cost", "steady"):
        raise ConfigError(f"--lean selects the accuracy and search suites' lean parts; the {args.suite} suite has "
                          "none: use it with --suite accuracy, search or all")


def run(args: argparse.Namespace) -> int:
    from autofit.bench import DEFAULT_OUT, SUITES, run_bench

    workloads = _workload_parts(args)  # checked before the restart: a bad one is one line, exit 2
    _check_lean(args)
    if "OMP_WAIT_POLICY" not in os.environ:  # a policy the user chose is kept
        _restart_with_bench_env(args)
    from autofit.bench.readme import update_readme
    from autofit.bench.summary import headline, write_summary

    # all with --lean: the suites that have a lean part
    suites = tuple(s for s in SUITES if not args.lean or s in ("accuracy", "search")) if args.suite == "all" \
        else (args.suite,)
    # A run of some workloads never overwrites the committed tables of all of them.
    out = args.out or (DEFAULT_OUT / "selected" if workloads else DEFAULT_OUT / "lean" if args.lean
                       else DEFAULT_OUT / "quick" if args.quick else DEFAULT_OUT)
    command = "autofit bench" + (f" --suite {args.suite}" if args.suite != "all" else "") + \
              (" --quick" if args.quick else "") + (f" --out {args.out}" if args.out else "") + \
              (f" --workloads {args.workloads}" if workloads else "") + (" --lean" if args.lean else "")

    def progress(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    results = run_bench(suites, out_dir=out, quick=args.quick, command=command, progress=progress, workloads=workloads,
                        lean_only=args.lean)
    # summary.md (and the README's block) come from every suite in full: not from --lean's parts
    summary = write_summary(out, results, command, complete=args.suite == "all" and not args.lean)
    print(summary.read_text() if summary else "\n".join(f"- {line}" for line in headline(results)))
    written = results.files + ([summary] if summary else [])
    # The committed run (every suite, default folder) also rewrites the README's benchmark block.
    if summary and args.out is None and not args.quick and update_readme(Path("README.md"), summary):
        written.append(Path("README.md"))
    for path in written:
        print(f"wrote {path}")
    return 0
