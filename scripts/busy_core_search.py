"""Does a busy core change the search's answer? A quiet search, the same search beside a busy loop
on one core, then both answers measured quietly (best of ``--repeats`` trials).

    python scripts/busy_core_search.py [--model gpt-tiny] [--budget 1GB] [--repeats 2]

Prints each search's answer, what the loaded trials' threads waited for a CPU, and the loaded
answer's quiet throughput as a share of the quiet answer's (the target: at least 95%). Run it
alone on the machine; it takes about two minutes on gpt-tiny.
"""

from __future__ import annotations

import argparse
import multiprocessing
import tempfile
import time
from pathlib import Path

import autofit
from autofit.trial.run import run_trial

# Three micro-batches at one global batch, one precision: within about 10% of each other on a
# 2-core CPU, so load could reorder them.
SPACE = {"precision": ["fp32"], "micro_batch": [4, 8, 16], "global_batch": 16, "checkpoint_every": [0],
         "device_split": [1]}


def _spin(stop) -> None:
    while not stop.is_set():
        pass


def _quiet_samples_per_s(model: str, config, repeats: int) -> float:
    results = [run_trial(model, config, device="cpu", warmup_steps=1, measure_steps=3, timeout_s=300)
               for _ in range(repeats)]
    return max(r.samples_per_s or 0.0 for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--budget", default="1GB")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        def search(name: str):
            return autofit.search(args.model, args.budget, space=SPACE, trials=3, out=Path(tmp) / name,
                                  device="cpu", progress=False)

        quiet = search("quiet")
        stop = multiprocessing.Event()
        hog = multiprocessing.Process(target=_spin, args=(stop,), daemon=True)
        hog.start()
        try:
            time.sleep(0.2)
            loaded = search("loaded")
        finally:
            stop.set()
            hog.join(5)
    waits = loaded.table["max_wait_share"].dropna()
    print(f"quiet answer:  {quiet.best.short()}")
    print(f"loaded answer: {loaded.best.short()} (longest run-queue wait of a trial's thread: "
          f"{waits.min():.0%}-{waits.max():.0%} of a step)")
    if loaded.best == quiet.best:
        print("same answer")
        return
    answer = _quiet_samples_per_s(args.model, loaded.best, args.repeats)
    reference = _quiet_samples_per_s(args.model, quiet.best, args.repeats)
    print(f"measured quietly: loaded answer {answer:.1f} samples/s, quiet answer {reference:.1f}: "
          f"{answer / reference:.1%} (target >= 95%)")


if __name__ == "__main__":
    main()
