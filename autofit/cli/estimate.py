"""``autofit estimate``: predicted memory of one config or of a whole search space."""

from __future__ import annotations

import argparse
import json
import sys

from autofit.cli._args import BUDGET_HELP, MODEL_HELP, add_hf_options, model_spec
from autofit.core.budget import format_budget, format_bytes, parse_budget
from autofit.core.config import FIELDS, CheckpointPolicy, Offload, OptimizerChoice, TrainConfig
from autofit.core.space import load_space
from autofit.estimator.advice import advise
from autofit.estimator.memory_model import estimate, optimizer_choices
from autofit.estimator.memory_table import BREAKDOWN, estimate_table
from autofit.probes.device_rates import device_overhead
from autofit.profiling.profile import profile_workload
from autofit.runtime.training import check_fake_device
from autofit.workloads.load import load_workload

DEFAULT_MODEL_HELP = MODEL_HELP


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "estimate", help="predict the memory of a config or a whole search space (nothing is trained)",
        description="Predict peak memory per device from a fake-tensor profile of the model. With --config, "
                    "one config's breakdown; without, every config of the space sorted by predicted peak.",
        epilog="Exit status: 0 when a config is predicted to fit; 1 when none is (the config given, or nothing in "
               "the space); 2 for a usage error.",
    )
    p.add_argument("--model", required=True, help=DEFAULT_MODEL_HELP)
    add_hf_options(p)
    p.add_argument("--budget", required=True, help=BUDGET_HELP)
    p.add_argument("--config", help="one config as k=v,... e.g. precision=amp-bf16,micro_batch=8")
    p.add_argument("--space", help="search-space TOML file, or a built-in space by name: default (the default), tiny, "
                                   "lean (adds the optimizer lever and selective checkpointing; changes the training)")
    p.add_argument("--global-batch", type=int, help="fix the global batch (grad_accum = global_batch / micro_batch)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="device type to estimate for (default: cuda if available, else cpu)")
    p.add_argument("--top", type=int, default=25, help="rows of the space table to print (default 25; 0 = all)")
    p.add_argument("--no-cache", action="store_true", help="re-profile instead of using the profile cache")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=run)


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def run(args: argparse.Namespace) -> int:
    budget_bytes = parse_budget(args.budget)
    config = TrainConfig.parse(args.config) if args.config else None
    space = load_space(args.space) if config is None else None
    if space is not None and args.global_batch is not None:
        space = space.with_global_batch(args.global_batch)
    device = args.device or default_device()
    check_fake_device(device)
    workload = load_workload(model_spec(args))
    precisions = [config.precision] if config else list(space.precision)
    if not args.json:
        print(f"profiling {workload.name} on fake tensors ({device}, {', '.join(p.value for p in precisions)})...",
              file=sys.stderr, flush=True)
    profile = profile_workload(workload, precisions, device_type=device, use_cache=not args.no_cache,
                               optimizers=optimizer_choices([config] if config else space.configs()))
    if config is not None:
        return _one(profile, config, budget_bytes, args.json)
    return _space(profile, space, budget_bytes, args)


def _one(profile, config: TrainConfig, budget_bytes: int, as_json: bool) -> int:
    est = estimate(profile, config, budget_bytes, overhead=device_overhead(profile.device_type))
    if as_json:
        print(json.dumps({**est.to_dict(), "workload": profile.workload}, indent=2))
        return 0 if est.fits else 1
    print(f"workload   {profile.workload} ({profile.param_count:,} parameters, {profile.n_layers} layers, {profile.optimizer})")
    print(f"device     {profile.device_type}")
    print(f"budget     {format_budget(budget_bytes)} per device")
    print(f"config     {config.short()}")
    print()
    for name in BREAKDOWN:
        print(f"  {name.removesuffix('_bytes'):<12} {format_bytes(getattr(est, name)):>12}")
    print(f"  {'peak':<12} {format_bytes(est.peak_bytes):>12}   (at: {est.peak_phase})")
    if len(est.per_device_peak_bytes) > 1:
        print("  per device   " + ", ".join(format_bytes(b) for b in est.per_device_peak_bytes))
    print(f"  model state  {format_bytes(est.model_state_bytes):>12}   (weights + gradients + optimizer state, whole model)")
    if est.shard_bytes is not None:
        print(f"  fsdp rank    shards {format_bytes(est.shard_bytes)} + gathered weights at the peak "
              f"{format_bytes(est.gathered_bytes)} (both inside the breakdown above)")
    for note in est.notes:
        print(f"  note: {note}")
    print()
    print("FITS" if est.fits else f"DOES NOT FIT: {format_bytes(est.peak_bytes)} > {format_bytes(budget_bytes)}")
    if not est.fits:
        for line in advise(profile, budget_bytes, [config.precision], (OptimizerChoice.AS_GIVEN, config.optimizer),
                           (CheckpointPolicy.FULL, config.checkpoint_policy)).lines:
            print(f"  - {line}")
    return 0 if est.fits else 1


def _space(profile, space, budget_bytes: int, args) -> int:
    configs = space.configs()
    overhead = device_overhead(profile.device_type)
    full = estimate_table(profile, configs, budget_bytes, overhead=overhead)
    table = full[full["valid"]].sort_values("peak_bytes", kind="stable")
    refused = full[~full["valid"]]["reason"].value_counts()
    if args.json:
        rows = []
        for row in table.to_dict("records"):
            rows.append({**{k: row[k] for k in FIELDS},
                         "peak_bytes": int(round(row["peak_bytes"])),
                         "per_device_peak_bytes": list(row["per_device_peak_bytes"]),
                         "fits": bool(row["fits"]), **{k: int(round(row[k])) for k in BREAKDOWN}})
        print(json.dumps({"workload": profile.workload, "budget_bytes": budget_bytes, "device_type": profile.device_type,
                          "space": space.source, "cuda_overhead": overhead and overhead.to_dict(),
                          "optimizer": profile.optimizer, "configs": rows,
                          "cannot_run": [{"reason": reason, "configs": int(n)} for reason, n in refused.items()]},
                         indent=2))
        return 0 if any(row["fits"] for row in rows) else 1
    n_fit = int(table["fits"].sum())
    print(f"workload   {profile.workload} ({profile.param_count:,} parameters, {profile.n_layers} layers, {profile.optimizer})")
    print(f"device     {profile.device_type}    budget {format_budget(budget_bytes)} per device")
    if overhead is not None:
        print(f"note       {overhead.note()}")
    print(f"space      {space.source}: {len(configs)} configs, {n_fit} predicted to fit")
    for reason, n in refused.items():
        print(f"           {n} cannot run: {reason}")
    print()
    shown = table if args.top == 0 else table.head(args.top)
    lean = any(c.changes_optimizer or c.checkpoint_policy is CheckpointPolicy.SELECTIVE for c in configs)
    offload = any(c.offload is not Offload.NONE for c in configs)
    print(f"{'precision':<9} {'micro':>5} {'accum':>5} {'ckpt':>4} {'split':>5} {'mode':>8}"
          + (f" {'optimizer':>9}" if lean else "") + (f" {'offload':>9}" if offload else "")
          + f" {'peak/device':>12}  fits")
    for row in shown.itertuples():
        ckpt = f"{row.checkpoint_every}{'s' if row.checkpoint_policy == 'selective' else ''}"
        print(f"{row.precision:<9} {row.micro_batch:>5} {row.grad_accum:>5} {ckpt:>4} "
              f"{row.device_split:>5} {row.split_mode:>8}" + (f" {row.optimizer:>9}" if lean else "")
              + (f" {row.offload:>9}" if offload else "")
              + f" {format_bytes(row.peak_bytes):>12}  {'yes' if row.fits else 'no'}")
    if len(shown) < len(table):
        print(f"... {len(table) - len(shown)} more (--top 0 shows all)")
    if lean:
        print("(ckpt 2s: selective checkpointing every 2 layers)")
    fitting = table[table["fits"]]
    changed = fitting[fitting["optimizer"] != OptimizerChoice.AS_GIVEN.value]
    if len(changed):
        print()
        kept = len(fitting) - len(changed)
        print(f"note: {len(changed)} of the {n_fit} configs that fit replace the workload's {profile.optimizer} "
              f"({', '.join(sorted(set(changed['optimizer'])))}): that changes the training"
              + ("; none fits with its own optimizer" if kept == 0 else f"; {kept} fit with its own"))
    if n_fit == 0:
        print()
        print(f"Nothing in the space fits {format_budget(budget_bytes)}.")
        for line in advise(profile, budget_bytes, list(space.precision), space.optimizer, space.checkpoint_policy).lines:
            print(f"  - {line}")
    elif table[(table.device_split == 1) & table.fits].empty:
        print()
        print("No single-device configuration fits; only split ones do.")
    return 0 if n_fit else 1

