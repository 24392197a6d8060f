#!/usr/bin/env python
"""Check autofit's CUDA trial paths on a machine with a GPU (they cannot run on CPU-only CI).

    python scripts/check_gpu.py [--model gpt-tiny] [--timeout 300]

Runs real trials on CUDA, each in its own child process: four precisions without a budget,
one config under a roomy budget (must be ok), one under a tiny budget (must be oom), a
two-stage split when there are two GPUs, and the same config on the CPU tracker for
comparison. Prints a table, then checks that this process never initialised CUDA while the
trials ran and that the GPU's memory is free again afterwards. Exit status 0 when every
check passes, 1 otherwise, 2 without a GPU. Takes a minute or two.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from autofit.core.budget import format_bytes
from autofit.core.config import TrainConfig
from autofit.trial.run import TrialResult, run_trial


def _row(label: str, result: TrialResult) -> str:
    def size(n):
        return format_bytes(n) if n is not None else "-"

    rate = f"{result.samples_per_s:,.1f}" if result.samples_per_s else "-"
    budget = size(result.budget_bytes) if result.budget_bytes else "none"
    return (f"{label:<34} {result.device:<6} {budget:>10} {result.status.value:<8} {size(result.peak_bytes):>11} "
            f"{size(result.peak_reserved_bytes):>11} {rate:>10} {result.wall_s:>6.1f}s  {result.error or ''}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--model", default="gpt-tiny", help="a built-in name or path/file.py:function")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per trial")
    args = parser.parse_args()
    if not torch.cuda.is_available():  # creates no CUDA context
        print("no CUDA GPU: nothing to check", file=sys.stderr)
        return 2
    failures: list[str] = []

    def check(condition: bool, message: str) -> None:
        if not condition:
            failures.append(message)

    def trial(label, config, **kwargs):
        result = run_trial(args.model, TrainConfig.parse(config), timeout_s=args.timeout, **kwargs)
        print(_row(label, result), flush=True)
        return result

    print(f"{'trial':<34} {'device':<6} {'budget':>10} {'status':<8} {'peak':>11} {'reserved':>11} "
          f"{'samples/s':>10} {'wall':>7}")
    base = None
    for config in ("precision=fp32,micro_batch=4", "precision=amp-bf16,micro_batch=4",
                   "precision=amp-fp16,micro_batch=4,grad_accum=2", "precision=bf16,micro_batch=4,checkpoint_every=1"):
        result = trial(config, config, device="cuda")
        check(result.ok, f"{config}: {result.status.value} {result.error}")
        if result.ok:
            check(result.peak_reserved_bytes >= result.peak_bytes > 0, f"{config}: reserved < allocated peak")
            check(result.peak_bytes == sum(result.breakdown.values()), f"{config}: breakdown does not sum to the peak")
            base = base or result
    if base is not None:
        roomy = 2 * base.peak_reserved_bytes + (256 << 20)
        result = trial("fp32 mb=4, roomy budget", "precision=fp32,micro_batch=4", device="cuda", budget_bytes=roomy)
        check(result.ok, f"roomy budget: {result.status.value} {result.error}")
        result = trial("fp32 mb=64, 4 MiB budget", "precision=fp32,micro_batch=64", device="cuda", budget_bytes=4 << 20)
        check(result.status.value == "oom", f"4 MiB budget: expected oom, got {result.status.value} {result.error}")
        cpu = trial("fp32 mb=4 on the CPU tracker", "precision=fp32,micro_batch=4", device="cpu")
        if cpu.ok:  # CUDA's peak adds the input batch and 512-byte rounding; expect close, not equal
            print(f"  CUDA allocated / CPU tracked peak: {base.peak_bytes / cpu.peak_bytes:.3f}")
    if torch.cuda.device_count() >= 2:
        result = trial("fp32 mb=4 ga=4, split over 2 GPUs", "precision=fp32,micro_batch=4,grad_accum=4,device_split=2",
                       device="cuda")
        check(result.ok and len(result.per_device_peak_bytes) == 2, f"split: {result.status.value} {result.error}")
    check(not torch.cuda.is_initialized(), "this (parent) process initialised CUDA")
    free, total = torch.cuda.mem_get_info()  # now initialises CUDA here, after all trials
    used_by_others = total - free
    print(f"\nafter the trials: {format_bytes(free)} of {format_bytes(total)} free "
          f"({format_bytes(used_by_others)} in use, this check's own CUDA context included)")
    if used_by_others > 2 << 30:  # not a failure: the GPU may be shared with other users
        print("NOTE: more than 2 GiB still in use after the trials; check nvidia-smi for a surviving trial process")
    for message in failures:
        print(f"FAIL: {message}")
    print("OK" if not failures else f"{len(failures)} check(s) failed")
    return 0 if not failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
