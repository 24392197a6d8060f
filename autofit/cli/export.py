"""``autofit export``: a study's best config (or one --config) in the form a trainer takes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from autofit.cli._args import BUDGET_HELP
from autofit.core.errors import ConfigError
from autofit.report.exports import TARGETS, export, export_study


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "export", help="the best config as TrainingArguments, an Accelerate/DeepSpeed config, Trainer args or torchrun",
        description="Write a study's best config (or --config) in the form a trainer takes: hf (TrainingArguments "
                    "keyword arguments, JSON), accelerate (a config file, YAML), lightning (Trainer keyword arguments "
                    "and the data module's batch size, JSON), deepspeed (a DeepSpeed config, JSON), torchrun (the "
                    "command that runs autofit's pipeline runner for a split config), json (autofit's record). What a "
                    "target cannot say exactly is said on stderr and in the export's comment, with the nearest "
                    "setting, its estimated peak and the code that does it exactly; an export that changes the "
                    "global batch, the precision or the optimizer says so first, with by how much.",
    )
    p.add_argument("dir", nargs="?", help="a study directory (autofit search --out); omit to export --config alone")
    p.add_argument("--to", required=True, choices=TARGETS, help="the target")
    p.add_argument("--config", help="k=v,... over the study's best config, or the whole config without DIR")
    p.add_argument("--model", help="without DIR: the workload (to estimate peaks; needed by --to torchrun)")
    p.add_argument("--budget", help="without DIR: " + BUDGET_HELP + " (to say whether a nearest setting fits)")
    p.add_argument("--device", choices=("cuda", "cpu"), help="without DIR: where training runs (default: cuda if this torch sees a GPU, else cpu)")
    p.add_argument("--storage", help="the storage URL when the study is in a database")
    p.add_argument("--out", help="write to this file instead of stdout")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.dir is None and not args.config:
        raise ConfigError("export needs a study directory or --config k=v,... (e.g. --config micro_batch=8)")
    if args.dir is not None:
        for name in ("model", "budget", "device"):
            if getattr(args, name) is not None:
                raise ConfigError(f"--{name} is taken from the study in {args.dir}; pass it only without DIR")
        exp = export_study(args.dir, args.to, storage=args.storage, override=args.config)
    else:
        exp = export(args.config, args.to, workload=args.model, budget=args.budget, device=args.device)
    for change in exp.changes:  # first: the export trains differently from what was measured
        sys.stderr.write(f"autofit: warning: this export changes the training: {change.text()}\n")
    for note in exp.notes:
        sys.stderr.write(f"autofit: note: {note.text()}\n")
    if args.out:
        if Path(args.out).is_dir():
            raise ConfigError(f"--out {args.out} is a directory; pass a file path (e.g. {Path(args.out) / 'export.json'})")
        try:
            Path(args.out).write_text(exp.text)
        except OSError as exc:
            raise ConfigError(f"--out {args.out}: cannot write ({exc.strerror or exc})") from None
        sys.stderr.write(f"autofit: wrote {args.out}\n")
    else:
        sys.stdout.write(exp.text)
    return 0
