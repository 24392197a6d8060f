"""Run one device-split trial under torchrun: one process per pipeline stage or FSDP rank, on one or more machines.

The per-process code is autofit.trial.pipeline.run_stage (``split_mode=pipeline``, the default) or
autofit.trial.fsdp.run_rank (``split_mode=fsdp``), the same that ``measure_split`` / ``measure_fsdp``
run in their own child processes. torchrun provides RANK, WORLD_SIZE, LOCAL_RANK and the
rendezvous; process ``RANK`` runs on ``cuda:LOCAL_RANK`` (NCCL) or on the CPU (gloo).

    # FSDP over two GPUs: each rank runs micro_batch samples, weights/grads/state sharded
    torchrun --nproc-per-node 2 scripts/run_split_torchrun.py --model gpt-tiny \\
        --config precision=amp-bf16,micro_batch=8,split_mode=fsdp --device cuda --json

    # two GPUs on one machine
    torchrun --nproc-per-node 2 scripts/run_split_torchrun.py --model gpt-tiny \\
        --config precision=amp-bf16,micro_batch=8,grad_accum=4 --device cuda --json

    # two machines, one GPU each (run on both, --node-rank 0 and 1)
    torchrun --nnodes 2 --nproc-per-node 1 --node-rank 0 --rdzv-backend c10d \\
        --rdzv-endpoint HOST0:29500 scripts/run_split_torchrun.py --model gpt-tiny --config micro_batch=8,grad_accum=4

``device_split`` defaults to WORLD_SIZE and must equal it. Rank 0 prints the combined
result (the same fields as measure_split); a failing stage prints its own result and exits 1,
and torchrun stops the others. Exit status: 0 ok, 1 the trial failed (oom/error), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from autofit.core.budget import parse_budget
from autofit.core.config import SplitMode, TrainConfig
from autofit.core.errors import AutofitError
from autofit.trial.fsdp import combine_rank_results, run_rank
from autofit.trial.pipeline import Schedule, combine_stage_results, run_stage
from autofit.workloads.load import load_workload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", required=True, help="built-in name, path/to/file.py:function or module:function")
    parser.add_argument("--config", default="", help="k=v,... e.g. precision=amp-bf16,micro_batch=8,grad_accum=4")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--schedule", choices=[s.value for s in Schedule], default=Schedule.ONE_F_ONE_B.value)
    parser.add_argument("--budget", default=None, help="per-device memory budget, e.g. 40GB")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up optimizer steps (at least 2)")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="process-group timeout in seconds")
    parser.add_argument("--json", action="store_true", help="print one JSON object (rank 0)")
    args = parser.parse_args(argv)

    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    try:
        workload = load_workload(args.model)
        config = TrainConfig.parse(args.config, base=TrainConfig(device_split=world_size))
        budget_bytes = parse_budget(args.budget) if args.budget else None
    except AutofitError as exc:
        print(f"autofit: {exc}", file=sys.stderr)
        return 2
    if config.device_split != world_size:
        print(f"autofit: device_split={config.device_split} but torchrun started {world_size} processes; "
              "they must be equal (one process per stage)", file=sys.stderr)
        return 2

    if args.device == "cuda":
        device = torch.device(f"cuda:{local_rank}")
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
    try:
        fsdp = config.split_mode is SplitMode.FSDP
        if fsdp:
            result = run_rank(workload, config, rank=rank, world_size=world_size, device=device,
                              warmup_steps=args.warmup, measure_steps=args.steps, budget_bytes=budget_bytes,
                              seed=args.seed)
        else:
            result = run_stage(workload, config, rank=rank, world_size=world_size, device=device,
                               warmup_steps=args.warmup, measure_steps=args.steps, budget_bytes=budget_bytes,
                               schedule=args.schedule, seed=args.seed)
        if result["status"] != "ok":
            # The other stages are (or will be) blocked on this one: report and leave; torchrun
            # tears the group down when a worker exits non-zero.
            result.pop("traceback", None)
            print(json.dumps(result), file=sys.stderr, flush=True)
            return 1
        gathered = [None] * world_size if rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
        if rank == 0:
            combined = (combine_rank_results if fsdp else combine_stage_results)(gathered, world_size)
            combined = {"workload": workload.name, "config": config.to_dict(), "device": args.device,
                        "world_size": world_size, **combined}
            if args.json:
                print(json.dumps(combined))
            else:
                for key, value in combined.items():
                    print(f"{key}: {value}")
        dist.barrier()  # no rank tears its connections down while another still reads from them
        return 0 if result["status"] == "ok" else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The trial is done and its process group destroyed. Leave without C++ static destructors: in CI a rank
    # aborted there now and then (SIGABRT, "terminate called without an active exception", no Python frame
    # left), and torchrun then reported a finished trial as failed.
    os._exit(code)
