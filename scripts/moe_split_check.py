"""Two-stage pipeline splits of two mixture-of-experts decoders through ``hf:`` (a Mixtral, the accuracy
suite's, and an OLMoE of the same size): each stage's estimated peak against the measured one on this
CPU, three precisions, micro-batch 2 and 4, checkpointing off and every layer, accumulation 2. The
figures quoted in docs/estimate.md come from this script (about 5 minutes).

    PYTHONPATH=. python scripts/moe_split_check.py
"""

from __future__ import annotations

import itertools
import statistics

from autofit.core.config import TrainConfig
from autofit.estimator.memory_model import estimate
from autofit.profiling.profile import profile_workload
from autofit.trial.pipeline.launch import measure_split
from autofit.workloads.hf import hf_workload

SHAPE = "num_hidden_layers=4&hidden_size=128&num_attention_heads=4&num_key_value_heads=2&vocab_size=2048"
MODELS = {"mixtral": f"mixtral?{SHAPE}&intermediate_size=256&num_local_experts=4&num_experts_per_tok=2",
          "olmoe": f"olmoe?{SHAPE}&intermediate_size=128&num_experts=8&num_experts_per_tok=2"}
SEQ_LEN = 64


def main() -> None:
    errors = []
    print("| model | config | stage errors (estimate vs measured) | bytes over |\n| --- | --- | --- | --- |")
    for name, spec in MODELS.items():
        workload = hf_workload(spec, seq_len=SEQ_LEN)
        for precision in ("fp32", "amp-bf16", "bf16"):
            profile = profile_workload(workload, [precision])
            for micro_batch, every in itertools.product((2, 4), (0, 1)):
                config = TrainConfig.parse(f"precision={precision},micro_batch={micro_batch},grad_accum=2,"
                                           f"checkpoint_every={every},device_split=2")
                predicted = estimate(profile, config).per_device_peak_bytes
                measured = measure_split(workload, config, device_type="cpu", timeout_s=300, budget_bytes=None)
                if measured["status"] != "ok":
                    print(f"| {name} | `{config.short()}` | {measured['status']}: {measured['error']} | |")
                    continue
                stage = [(p - m) / m for p, m in zip(predicted, measured["per_device_peak_bytes"])]
                errors += stage
                over = [p - m for p, m in zip(predicted, measured["per_device_peak_bytes"])]
                print(f"| {name} | `{config.short()}` | {' / '.join(f'{e:+.2%}' for e in stage)} | "
                      f"{' / '.join(map(str, over))} |", flush=True)
    if errors:
        print(f"\n{len(errors)} stage peaks: median {statistics.median(errors):+.2%}, max {max(errors):+.2%}, "
              f"min {min(errors):+.2%}, {sum(e < 0 for e in errors)} under")


if __name__ == "__main__":
    main()
