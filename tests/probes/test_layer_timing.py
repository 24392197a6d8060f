"""The layer probe (autofit.probes.layer_timing) times the first layer of models whose forward cannot
run on the meta device (transformers' mask code, a user's value read), and says why when it fails."""

from __future__ import annotations

import pytest
import torch

from autofit.probes.layer_timing import (
    _capture,
    _timed_interleaved,
    layer_probe_child,
    measure_layer_timings,
)
from autofit.workloads.load import load_workload

HF_GPT2 = "hf:gpt2?n_layer=2&n_embd=64&n_head=2&vocab_size=512#seq_len=32"
HF_LLAMA = ("hf:llama?num_hidden_layers=2&hidden_size=64&intermediate_size=128&num_attention_heads=2"
            "&num_key_value_heads=2&vocab_size=512#seq_len=32")


@pytest.mark.parametrize("spec", [HF_GPT2, HF_LLAMA])
def test_the_layer_probe_times_transformers_models(spec, one_thread):
    # Their mask code reads a value (find_packed_sequence_indices: Tensor.item() cannot be called on meta
    # tensors), so the layer's inputs are captured on a real model instead.
    pytest.importorskip("transformers")
    seconds = layer_probe_child({"source": spec, "precisions": ["fp32", "amp-bf16"], "batches": [1, 2]})["seconds"]
    assert set(seconds) == {"fp32", "amp-bf16"}
    assert all(len(line) == 2 and all(0 < s < 5 for s in line) for line in seconds.values()), seconds


def test_a_user_model_that_reads_a_value_is_captured_on_a_real_model(trial_workload_spec, one_thread):
    captured, real = _capture(load_workload(trial_workload_spec("masked_lm")), [2])
    (x, keep), _ = captured[2]
    assert real is not None and x.shape == (2, 8, 32) and keep.dtype is torch.bool and keep.device.type == "cpu"
    seconds = layer_probe_child({"source": trial_workload_spec("masked_lm"), "precisions": ["fp32"],
                                 "batches": [1, 2]})["seconds"]
    assert len(seconds["fp32"]) == 2 and all(s > 0 for s in seconds["fp32"])
    # a model whose forward runs on the meta device is still captured there (no real model built)
    assert _capture(load_workload(trial_workload_spec("tiny_lm")), [2])[1] is None


def test_a_failing_layer_probe_says_why_and_logs_the_traceback(trial_workload_spec, debug_lines):
    notes: list[str] = []
    assert measure_layer_timings(trial_workload_spec("exploding_layer"), ["fp32"], use_cache=False,
                                 note=notes.append) is None
    failed = [line for line in notes if "failed" in line]
    assert len(failed) == 1 and "(ValueError: the layer exploded)" in failed[0], notes
    assert "its second line" not in failed[0] and "\n" not in failed[0]
    assert any("Traceback (most recent call last)" in line and "raise ValueError" in line
               and "its second line" in line for line in debug_lines), debug_lines


def test_a_precision_whose_layer_fails_is_said_and_the_others_are_kept(trial_workload_spec, one_thread):
    # one precision without a kernel on this device must not cost the others their timing
    notes: list[str] = []
    timings = measure_layer_timings(trial_workload_spec("autocast_refusing_layer"), ["fp32", "amp-bf16"],
                                    use_cache=False, note=notes.append)
    seconds = timings and timings.seconds
    assert seconds is not None and set(seconds) == {"fp32"} and all(s > 0 for s in seconds["fp32"]), seconds
    failed = [line for line in notes if "failed" in line]
    assert len(failed) == 1 and "at amp-bf16" in failed[0] and "primitive descriptor" in failed[0], notes
    assert "other precisions' factors" in failed[0]


def test_the_repeats_are_taken_in_rounds_and_a_failing_precision_is_dropped():
    # a slowdown that lasts a while must spread over every point, not inflate all repeats of one
    order, failures = [], []

    def step(key, fail=False):
        def run():
            order.append(key)
            if fail and order.count(key) == 2:
                raise RuntimeError("no kernel")
        return run

    steps = {("fp32", 2): step(("fp32", 2)), ("fp32", 8): step(("fp32", 8)),
             ("bf16", 2): step(("bf16", 2), fail=True), ("bf16", 8): step(("bf16", 8))}
    times = _timed_interleaved(steps, repeats=3, failed=lambda name, exc: failures.append((name, str(exc))))
    assert order[:4] == [("fp32", 2), ("fp32", 8), ("bf16", 2), ("bf16", 8)]  # one of each per round
    assert order[4:7] == [("fp32", 2), ("fp32", 8), ("bf16", 2)]  # bf16 fails here: its 8 is not run again
    assert failures == [("bf16", "no kernel")] and set(times) == {("fp32", 2), ("fp32", 8)}
    assert all(len(v) == 3 and v == sorted(v) for v in times.values())


def test_the_child_reports_how_well_each_best_time_is_known(trial_workload_spec, one_thread):
    out = layer_probe_child({"source": trial_workload_spec("tiny_lm"), "precisions": ["fp32"], "batches": [1, 2]})
    assert len(out["seconds"]["fp32"]) == 2 and len(out["spread_s"]["fp32"]) == 2
    assert all(s >= 0 for s in out["spread_s"]["fp32"])


def test_rounds_stop_after_the_minimum_once_their_time_budget_is_spent():
    def rounds_taken(step_s: float) -> int:
        now = [0.0]  # a clock that only the steps move: each takes step_s

        def step():
            now[0] += step_s

        steps = {("fp32", 2): step, ("fp32", 8): step}
        times = _timed_interleaved(steps, repeats=5, min_repeats=3, budget_s=0.5, clock=lambda: now[0])
        assert len(set(map(len, times.values()))) == 1  # every step the same number of repeats
        assert all(t == pytest.approx(step_s) for v in times.values() for t in v)
        return len(times[("fp32", 2)])

    assert rounds_taken(0.01) == 5   # a quick layer gets every round (0.1 s in all)
    assert rounds_taken(0.2) == 3    # a slow one stops at the minimum, never fewer
    assert rounds_taken(0.07) == 4   # in between: a round starts while the budget lasts (0.42 s after three)
