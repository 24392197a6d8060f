"""Pipeline splits of models that return a key/value cache (tests/cache_workloads.py: a Hugging Face Llama
and GPT-2 written in a user's file, default ``use_cache=True``): each stage's estimated peak against the
measured one, 2 stages on this CPU. The figures quoted in docs/estimate.md come from this script.

    PYTHONPATH=. python scripts/cache_split_check.py
"""

from __future__ import annotations

from autofit.core.config import TrainConfig
from autofit.estimator.memory_model import estimate
from autofit.profiling.profile import profile_workload
from autofit.trial.pipeline.launch import measure_split
from autofit.workloads.load import load_workload

CONFIGS = ("precision=fp32,micro_batch=2,grad_accum=2,device_split=2",
           "precision=fp32,micro_batch=2,grad_accum=2,checkpoint_every=1,device_split=2",
           "precision=amp-bf16,micro_batch=2,grad_accum=2,checkpoint_every=1,device_split=2",
           "precision=bf16,micro_batch=2,grad_accum=2,checkpoint_every=1,device_split=2")


def main() -> None:
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
    errors.sort()
    print(f"\n{len(errors)} stages: median {errors[len(errors) // 2]:+.2%}, min {errors[0]:+.2%}, max {errors[-1]:+.2%}")


if __name__ == "__main__":
    main()
