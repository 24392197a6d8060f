"""Does OpenMP's wait policy change a trial's throughput on this machine, quietly?

Runs ``autofit measure`` on ``--model`` for each ``--configs`` entry, alternating ``PASSIVE`` (what
autofit's children run with when the environment sets no policy) and libgomp's default (spin, then
sleep: an empty ``OMP_WAIT_POLICY``, which libgomp rejects with a warning on stderr and then ignores),
for ``--rounds`` rounds, then prints
each config's samples/s per policy and their medians. Run it alone on the machine.

    python scripts/openmp_policy_ab.py [--model gpt-tiny] [--rounds 4] \\
        [--configs precision=fp32,micro_batch=8,grad_accum=8 precision=fp32,micro_batch=32,grad_accum=2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

POLICIES = {"PASSIVE": "PASSIVE", "default": ""}


def measure(model: str, config: str, policy: str) -> float:
    env = {**os.environ, "OMP_WAIT_POLICY": policy}
    out = subprocess.run([sys.executable, "-m", "autofit", "measure", "--model", model, "--config", config, "--json"],
                         env=env, capture_output=True, text=True, check=False)
    try:
        return float(json.loads(out.stdout).get("samples_per_s") or 0.0)
    except ValueError:
        return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--configs", nargs="+", default=["precision=fp32,micro_batch=8,grad_accum=8",
                                                         "precision=fp32,micro_batch=32,grad_accum=2"])
    args = parser.parse_args()
    seen: dict[tuple[str, str], list[float]] = {}
    for round_index in range(1, args.rounds + 1):
        for name, policy in POLICIES.items():
            for config in args.configs:
                value = measure(args.model, config, policy)
                seen.setdefault((config, name), []).append(value)
                print(f"round {round_index} {name:8s} {config}: {value:.1f} samples/s", flush=True)
    print("\nmedians (samples/s):")
    for config in args.configs:
        cells = ", ".join(f"{name} {statistics.median(seen[(config, name)]):.1f}" for name in POLICIES)
        print(f"  {config}: {cells}")


if __name__ == "__main__":
    main()
