#!/usr/bin/env python
"""How often a gloo collective's output buffer is still referenced after the collective returned.

    python scripts/gloo_buffer_race.py [--calls 2000] [--op all_gather|all_gather_async|reduce_scatter_async]

Two gloo ranks on this machine call the collective ``--calls`` times on a fresh 2 MiB buffer,
drop their own references as soon as it returns (``wait()`` done), and count the calls after
which the buffer's storage is still alive. ProcessGroupGloo's worker thread marks a work
complete and only afterwards, once it re-takes its queue lock, drops the work and the tensors
it holds (``ProcessGroupGloo::runLoop``), so a caller that runs on first sees the buffer freed a
moment late, from that thread. FSDP2 on the CPU drops each unit's all-gather buffer right after
copying it out; when such a late free happens across a rank's peak moment, the tracker (and the
allocator) counts one unit's gathered weights more on that rank, once
(:mod:`autofit.bench.repeats`). Takes about a minute.
"""

from __future__ import annotations

import argparse
import socket
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

NUMEL = 2**19  # 2 MiB of fp32 gathered, 1 MiB a rank


def _rank(rank: int, port: int, calls: int, op: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    late = 0
    for _ in range(calls):
        gathered, shard = torch.empty(NUMEL), torch.ones(NUMEL // 2)
        watched = gathered if op.startswith("all_gather") else shard  # the buffer the collective writes
        alive = weakref.ref(watched.untyped_storage())
        if op == "reduce_scatter_async":
            dist.reduce_scatter_tensor(shard, gathered, async_op=True).wait()
        else:
            work = dist.all_gather_into_tensor(gathered, shard, async_op=op == "all_gather_async")
            if work is not None:
                work.wait()
            del work
        del gathered, shard, watched
        late += alive() is not None
    dist.barrier()
    print(f"{op}: rank {rank}: buffer still referenced after the call returned in {late} of {calls} calls", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--op", choices=("all_gather", "all_gather_async", "reduce_scatter_async"), default="all_gather")
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_rank, args=(port, args.calls, args.op), nprocs=2)


if __name__ == "__main__":
    main()
