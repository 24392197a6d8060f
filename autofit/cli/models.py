"""``autofit models``: list the built-in workloads."""

from __future__ import annotations

import argparse
import json


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("models", help="list the built-in workloads",
                              description="List the built-in workloads usable as --model NAME.")
    p.add_argument("--json", action="store_true", help="print a JSON list of {name, param_count, description, ...}")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from autofit.workloads import DEFAULT_WORKLOAD, list_models

    models = list_models()
    if args.json:
        print(json.dumps(models, indent=2))
        return 0
    width = max(len(m["name"]) for m in models)
    for m in models:
        default = "  (default)" if m["name"] == DEFAULT_WORKLOAD else ""
        print(f"{m['name']:<{width}}  {m['param_count']:>14,}  {m['description']}{default}")
    return 0
