"""Models that return a key/value cache (tests/cache_workloads.py: a Hugging Face Llama and GPT-2 written in a
user's file, default ``use_cache=True``): the estimated peak against the measured one on one device (five
configs, micro-batch 2), then each stage's of a 2-stage pipeline split, on this CPU. The figures quoted in
docs/estimate.md come from this script.

    PYTHONPATH=. python scripts/cache_split_check.py
"""

from __future__ import annotations

import statistics

from autofit.core.config import TrainConfig
from autofit.estimator.memory_model import estimate
from autofit.profiling.profile import profile_workload
from autofit.trial.measure import measure_trial
from autofit.trial.pipeline.launch import measure_split
from autofit.workloads.load import load_workload

SINGLE = ("precision=fp32,micro_batch=2", "precision=fp32,micro_batch=2,checkpoint_every=1",
          "precision=fp32,micro_batch=2,checkpoint_every=2", "precision=amp-bf16,micro_batch=2,checkpoint_every=1",
          "precision=bf16,micro_batch=2,grad_accum=2,checkpoint_every=1")
CONFIGS = ("precision=fp32,micro_batch=2,grad_accum=2,device_split=2",
           "precision=fp32,micro_batch=2,grad_accum=2,checkpoint_every=1,device_split=2",
           "precision=amp-bf16,micro_batch=2,grad_accum=2,checkpoint_every=1,device_split=2",
           "precision=bf16,micro_batch=2,grad_accum=2,checkpoint_every=1,device_split=2")


def single_device() -> list[float]:
    """One device: each config's error (estimate vs measured peak), printed as a table."""
    errors = []
    print("| model | config | error (estimate vs measured) |\n| --- | --- | --- |")
    for name in ("llama_lm", "gpt2_lm"):
        workload = load_workload(f"tests/cache_workloads.py:{name}")
        configs = [TrainConfig.parse(text) for text in SINGLE]
        profile = profile_workload(workload, list(dict.fromkeys(c.precision for c in configs)), split_ends=False)
        for text, config in zip(SINGLE, configs):
            measured = measure_trial(workload, config, warmup_steps=2, measure_steps=1)
            if measured["status"] != "ok":
                print(f"| {name} | {text} | {measured['status']}: {measured['error']} |")
                continue
            errors.append((estimate(profile, config).peak_bytes - measured["peak_bytes"]) / measured["peak_bytes"])
            print(f"| {name} | {text} | {errors[-1]:+.2%} |")
    return errors


def main() -> None:
    single = single_device()
    print()
    errors = []
    print("| model | config | stage errors (estimate vs measured) |\n| --- | --- | --- |")
    for name in ("llama_lm", "gpt2_lm"):
        workload = load_workload(f"tests/cache_workloads.py:{name}")
        configs = [TrainConfig.parse(text) for text in CONFIGS]
        profile = profile_workload(workload, list(dict.fromkeys(c.precision for c in configs)))
        for text, config in zip(CONFIGS, configs):
            measured = measure_split(workload, config, device_type="cpu", timeout_s=300, budget_bytes=None)
            if measured["status"] != "ok":
                print(f"| {name} | {text} | {measured['status']}: {measured['error']} |")
                continue
            stage = [(p - m) / m for p, m in zip(estimate(profile, config).per_device_peak_bytes,
                                                 measured["per_device_peak_bytes"], strict=True)]
            errors += stage
            print(f"| {name} | {text} | {', '.join(f'{e:+.2%}' for e in stage)} |")
    print()
    for what, values in (("one device", single), ("split stages", errors), ("both", single + errors)):
        values = sorted(values)
        print(f"{what}: {len(values)} figures, median {statistics.median(values):+.2%}, "
              f"min {values[0]:+.2%}, max {values[-1]:+.2%}, median |error| {statistics.median(map(abs, values)):.2%}")


if __name__ == "__main__":
    main()
