#!/usr/bin/env python
"""What is live on a CUDA card at a trial's peak, beside what autofit's estimate says about it.

For each ``WORKLOAD:CONFIG`` given, builds the config as a trial does (:func:`autofit.runtime.training.build_trainee`),
runs the trial's warm-up steps, then records the caching allocator's history
(``torch.cuda.memory._record_memory_history``) over two more steps. Replaying that history gives the
moment of the largest allocated total and the blocks live then, summed by the Python frame that
allocated them (the innermost frame in autofit, torchao or transformers, and the innermost frame).
Blocks allocated before the recording (weights, and state that lives across steps) are one line.
Beside it: autofit's estimate of ``max_memory_allocated`` for the config (its fake-tensor profile).

Needs a CUDA build of PyTorch and a GPU; where torchao is missing, ``offload=optimizer`` configs fail
their build with a line. From the repository root::

    PYTHONUNBUFFERED=1 python3 scripts/cuda_peak_trace.py \\
        "gpt-tiny:precision=amp-bf16,micro_batch=4,grad_accum=2,offload=optimizer" \\
        "lstm-lm:precision=fp32,micro_batch=8" --out /tmp/trace

Prints one block per config and writes it to ``--out/peak_trace.txt``.
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MiB = 2**20
OURS = ("/autofit/", "torchao", "transformers")


def frame_key(frames: list[dict]) -> str:
    """Where a block was allocated: the innermost frame of ours (or the innermost), with the innermost."""
    if not frames:
        return "(no frames)"
    inner = frames[0]
    ours = next((f for f in frames if any(o in f["filename"] for o in OURS)), inner)
    at = lambda f: f"{Path(f['filename']).name}:{f['line']} {f['name']}"  # noqa: E731
    return at(ours) if ours is inner else f"{at(ours)} <- {at(inner)}"


def peak_blocks(trace: list[dict]) -> tuple[int, dict[str, int]]:
    """The largest total the traced allocations reached (bytes above the recording's start) and the bytes
    live then, by :func:`frame_key`."""
    live: dict[int, tuple[int, str]] = {}
    total = best = 0
    at_best: dict[int, tuple[int, str]] = {}
    for entry in trace:
        action = entry["action"]
        if action == "alloc":
            live[entry["addr"]] = (entry["size"], frame_key(entry.get("frames", [])))
            total += entry["size"]
            if total > best:
                best, at_best = total, dict(live)
        elif action == "free_completed" and entry["addr"] in live:
            total -= live.pop(entry["addr"])[0]
    by_key: dict[str, int] = defaultdict(int)
    for size, key in at_best.values():
        by_key[key] += size
    return best, dict(by_key)


def trace_one(spec: str, config_text: str) -> str:
    import torch

    from autofit.core.config import TrainConfig
    from autofit.probes.cuda_overhead import context_bytes_now
    from autofit.runtime.schedule import DEFAULT_SCHEDULE, run_steps
    from autofit.runtime.training import build_trainee, train_step
    from autofit.trial.measure import trial_micro_batches
    from autofit.workloads.load import load_workload

    config = TrainConfig.parse(config_text)
    workload = load_workload(spec)
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.empty_cache()
    trainee = build_trainee(workload, config, dev)
    batches = trial_micro_batches(workload, config, dev, DEFAULT_SCHEDULE)
    run_steps(DEFAULT_SCHEDULE, lambda: train_step(trainee, batches))
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev)
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    for _ in range(2):
        train_step(trainee, batches)
    torch.cuda.synchronize(dev)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak = torch.cuda.max_memory_allocated(dev)
    context, how = context_bytes_now(dev)
    traces = snapshot.get("device_traces", [[]])
    best, by_key = peak_blocks(traces[dev.index] if dev.index < len(traces) else [])
    lines = [f"== {spec} {config_text}",
             f"max_memory_allocated {peak / MiB:.1f} MiB; before the recorded steps {before / MiB:.1f} MiB; "
             f"traced peak {(before + best) / MiB:.1f} MiB; context now "
             + (f"{context / MiB:.0f} MiB ({how})" if context is not None else f"unknown ({how})")]
    for key, size in sorted(by_key.items(), key=lambda kv: -kv[1])[:14]:
        lines.append(f"  {size / MiB:8.2f} MiB  {key}")
    del trainee, batches
    gc.collect()  # an offloading optimizer and its parameters' hooks form a reference cycle
    torch.cuda.empty_cache()
    return "\n".join(lines)


def estimated(spec: str, configs: list[str], overhead) -> dict[str, str]:
    sys.path.insert(0, str(ROOT / "scripts"))
    from gpu_check import estimates

    got = estimates(spec, configs, "cuda", overhead=lambda: overhead)
    return {c: (v if isinstance(v, str) else f"estimate: allocated {v[1] / MiB:.1f} MiB, card {v[0] / MiB:.1f} MiB")
            for c, v in got.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("items", nargs="+", help="WORKLOAD:CONFIG, e.g. gpt-tiny:precision=fp32,micro_batch=4")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("cuda_peak_trace: no CUDA device here (it traces the card's allocator); run it on a GPU machine")
        return 2
    from autofit.probes.cuda_overhead import measure_overhead

    overhead = measure_overhead("cuda")  # before any tensor of ours is on the card (its docstring)
    blocks = []
    by_spec: dict[str, list[str]] = defaultdict(list)
    for item in args.items:
        spec, _, config = item.rpartition(":")
        by_spec[spec].append(config)
    for spec, configs in by_spec.items():
        try:
            est = estimated(spec, configs, overhead)
        except Exception as exc:  # noqa: BLE001
            est = dict.fromkeys(configs, f"estimate failed: {type(exc).__name__}: {exc}")
        for config in configs:
            try:
                block = trace_one(spec, config)
            except Exception as exc:  # noqa: BLE001
                block = f"== {spec} {config}\nfailed: {type(exc).__name__}: {str(exc).splitlines()[0]}"
            block += "\n  " + est[config]
            print(block, flush=True)
            blocks.append(block)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "peak_trace.txt").write_text("\n\n".join(blocks) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
