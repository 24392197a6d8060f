"""``autofit size``: the largest models of a family that fit a budget (the fifth lever, a smaller model)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from autofit.cli._args import BUDGET_HELP, positive
from autofit.core.budget import format_budget, format_bytes


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "size", help="the largest models of a family that fit a budget, and how to train them",
        description="Score every shape of a model family (a grid over its size fields) against every config of "
                    "the search space, from fake-tensor estimates alone: does any config fit, which is predicted "
                    "fastest, at what peak. Prints the largest fitting shapes and the frontier (largest model at "
                    "each predicted throughput); --confirm K measures the top K for real.",
    )
    p.add_argument("--family", required=True, help="a built-in decoder preset as the base shape, e.g. gpt2, "
                                                     "gpt-tiny, llama-1b (see `autofit models`)")
    p.add_argument("--budget", required=True, help=BUDGET_HELP)
    p.add_argument("--vary", action="append", metavar="FIELD=V1,V2,...",
                   help="values of one size field (repeatable; the grid is their product). Default: n_layer 2-48 "
                        "by n_embd of 2-64 heads at the base head size")
    p.add_argument("--devices", type=positive(int), help="most devices a config may split over (default: 1 on "
                                                         "the CPU, the visible GPUs on CUDA)")
    p.add_argument("--space", help="search-space TOML file or a built-in space by name: default (the default), tiny, "
                                   "lean (adds the optimizer lever and selective checkpointing; changes the training)")
    p.add_argument("--global-batch", type=positive(int), help="fix the global batch (grad_accum = global_batch / "
                                                               "micro_batch)")
    p.add_argument("--min-tokens-per-s", type=positive(float), help="answer the largest shape predicted at least "
                                                                    "this fast")
    p.add_argument("--confirm", type=positive(int), default=0, metavar="K",
                   help="run real trials of the K largest frontier shapes with their best config")
    p.add_argument("--trial-timeout", type=positive(float), default=600.0, help="seconds per --confirm trial "
                                                                                "(default 600)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="device type to estimate for (default: cuda if "
                                                             "available, else cpu)")
    p.add_argument("--top", type=int, default=15, help="fitting shapes to print, largest first (default 15; 0 = all)")
    p.add_argument("--out", help="write size.json, shapes.csv and frontier.png to this directory")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from autofit.sizing.size import plot_frontier, size

    def progress(message: str) -> None:
        if not args.json:
            print(message, file=sys.stderr, flush=True)

    result = size(args.family, args.budget, vary=args.vary, devices=args.devices, space=args.space,
                  global_batch=args.global_batch, min_tokens_per_s=args.min_tokens_per_s, confirm=args.confirm, device=args.device,
                  trial_timeout_s=args.trial_timeout, progress=progress)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "size.json").write_text(json.dumps(result.to_dict(), indent=2) + "\n")
        table = result.table.copy()
        table["config"] = [c.short() if c is not None and not isinstance(c, float) else "" for c in table["config"]]
        table.to_csv(out / "shapes.csv", index=False)
        try:
            plot_frontier(result, out / "frontier.png")
        except ImportError:
            progress("matplotlib is not installed: no frontier.png")
    lines = _summary(result, args.top)
    if args.out:
        (out / "summary.md").write_text(f"# {_command(args)}\n\n"
                                        "```\n" + "\n".join(_summary(result, 0)) + "\n```\n")
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    print("\n".join(lines))
    if args.out:
        print(f"\nwritten: {args.out}/size.json, shapes.csv, summary.md, frontier.png")
    return 0


def _command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run (its options, not --json/--out/--top)."""
    parts = ["autofit size", f"--family {shlex.quote(args.family)}", f"--budget {args.budget}"]
    parts += [f"--vary {v}" for v in args.vary or []]
    for flag in ("devices", "space", "global_batch", "min_tokens_per_s", "device"):
        if getattr(args, flag) is not None:
            parts.append(f"--{flag.replace('_', '-')} {getattr(args, flag)}")
    if args.confirm:
        parts.append(f"--confirm {args.confirm}")
    return " ".join(parts)


def _rate(value) -> str:
    return "-" if value is None or value != value else f"{value:,.0f}"


def _summary(result, top: int) -> list[str]:
    lines: list[str] = []
    print = lines.append  # noqa: A001 -- the same text goes to stdout and to summary.md
    t = result.timing
    fields = list(result.fields)
    print(f"family     {result.family} (varied: {', '.join(fields)})")
    print(f"budget     {format_budget(result.budget_bytes)} per device, {result.device_type}, up to "
          f"{result.devices} device(s); space {result.space}")
    print(f"scored     {t['shapes']} shapes x {t['configs_per_shape']} configs from the estimate alone in "
          f"{t['total_s']:.1f} s ({t['profiled']} one-layer profiles, {t['interpolated']} interpolated; "
          f"scoring {t['score_s']:.1f} s)")
    table = result.table
    fits = table[table["fits"]]
    print(f"fit        {len(fits)} of {len(table)} shapes fit at least one config")
    measured = "measured_status" in table
    print("")
    head = "  ".join(f"{f:>8}" for f in fields)
    extra = f"  {'measured peak':>13}  {'tok/s':>8}  status" if measured else ""
    shown = fits if top == 0 else fits.head(top)
    width = max([34] + [len(c.short()) for c in shown["config"]])  # the lean levers make configs longer
    print(f"{head}  {'params':>13}  {'best predicted config':<{width}} {'peak':>10}  {'tok/s':>8}  frontier{extra}")
    for row in shown.to_dict("records"):
        line = "  ".join(f"{row[f]:>8}" for f in fields)
        line += (f"  {int(row['param_count']):>13,}  {row['config'].short():<{width}} {format_bytes(row['peak_bytes']):>10}"
                 f"  {_rate(row['tokens_per_s']):>8}  {'yes' if row['frontier'] else '':<8}")
        if measured and (row.get("measured_status") or row.get("measured_note")):
            peak = row.get("measured_peak_bytes")
            line += (f"  {format_bytes(peak) if peak else '-':>13}  {_rate(row.get('measured_tokens_per_s')):>8}  "
                     f"{row.get('measured_status') or ''} {row.get('measured_note') or ''}".rstrip())
        print(line)
    if len(shown) < len(fits):
        print(f"... {len(fits) - len(shown)} more fitting shapes (--top 0 shows all)")
    print("")
    print("frontier (largest model at each predicted throughput):")
    for row in result.frontier.to_dict("records"):
        print(f"  {int(row['param_count']):>13,} params  {_rate(row['tokens_per_s']):>8} tok/s  {row['spec']}")
    top_row = result.top
    print("")
    if top_row is None:
        floor = f" at {result.min_tokens_per_s:,.0f} tokens/s or more" if result.min_tokens_per_s else ""
        print(f"Nothing in the grid fits {format_budget(result.budget_bytes)}{floor}: try smaller shapes "
              "(--vary) or more devices (--devices).")
        return lines
    config = top_row["config"]
    print(f"answer: {top_row['spec']} ({int(top_row['param_count']):,} parameters) with {config.short()}, "
          f"predicted peak {format_bytes(top_row['peak_bytes'])}")
    if config.changes_optimizer:
        print(f"  it changes the training: optimizer={config.optimizer.value} replaces the family's own optimizer")
    cfg = config.to_text()
    print(f"  check it: autofit measure --model {shlex.quote(top_row['spec'])} --config {cfg} "
          f"--budget {result.budget_text}")
    return lines
