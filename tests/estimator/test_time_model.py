"""The time model: the probe, and predictions checked against hand-computed values."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from trial_workloads import TINY_LM as TINY

from autofit.core.config import TrainConfig
from autofit.estimator.time_model import op_counts, predict_table
from autofit.probes.device_rates import DeviceRates, probe_rates
from autofit.runtime import forkserver, procs
from autofit.workloads.load import load_workload


@pytest.fixture(scope="module")
def profile():
    from autofit.profiling.profile import profile_workload

    # The session's profile cache (conftest.profile_cache) is shared with the study tests.
    return profile_workload(load_workload(TINY), ["fp32", "amp-bf16"], device_type="cpu")


def compute_only(fp32=1e11, bf16=5e10) -> DeviceRates:
    """Rates where only FLOPs cost time: memory is free and operators have no overhead."""
    return DeviceRates("cpu", "test", 1, {"float32": fp32, "bfloat16": bf16, "float16": 1e9}, math.inf, 0.0, 0.0, "x")


def test_probe_measures_every_dtype_and_is_cached(monkeypatch, tmp_path):
    from autofit.probes import device_rates as time_model

    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(time_model, "RATE_AGREEMENT", math.inf)  # a loaded machine's repeats may differ: not judged here
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.delenv("AUTOFIT_TRIAL_SERVER", raising=False)
    forked = []
    start_trial = forkserver.start_trial
    monkeypatch.setattr(forkserver, "start_trial", lambda entry, *a, **k: forked.append(entry) or start_trial(entry, *a, **k))
    rates = probe_rates("cpu")
    assert forked == ["autofit.probes.device_rates:probe_child"]  # the trials' fork server: no interpreter to start
    assert set(rates.matmul_flops_per_s) == {"float32", "bfloat16", "float16"}
    assert all(rate > 0 for rate in rates.matmul_flops_per_s.values())
    assert rates.memory_bytes_per_s > 0 and rates.op_latency_s > 0
    cached = list(tmp_path.glob("rates-cpu-*.json"))
    assert len(cached) == 1 and json.loads(cached[0].read_text())["device_type"] == "cpu"
    assert probe_rates("cpu") == rates  # read back, not measured again


def test_the_probe_runs_in_a_child_and_its_rates_come_back_as_json():
    # What probe_rates does for CUDA (so the caller never holds a CUDA context), run on the CPU.
    child = procs.spawn("autofit.probes.device_rates:probe_child", {"device_type": "cpu"}, timeout_s=300)
    try:
        assert child.wait()
    finally:
        child.kill()
    rates = DeviceRates.from_dict(child.last_message())
    assert rates.device_type == "cpu" and set(rates.matmul_flops_per_s) == {"float32", "bfloat16", "float16"}


def test_step_time_is_accumulated_micro_steps_plus_the_optimizer(profile):
    pp = profile.for_precision("fp32")
    rates = compute_only()
    configs = [TrainConfig("fp32", 4, 1), TrainConfig("fp32", 4, 8), TrainConfig("amp-bf16", 4, 1)]
    table = predict_table(profile, configs, rates)
    flops_per_sample = pp.forward_flops[1] + pp.backward_flops[1]
    # hand-computed: 4 samples of forward + backward FLOPs at 1e11 FLOP/s; the optimizer is free
    assert table.loc[0, "micro_step_time_s"] == pytest.approx(4 * flops_per_sample / 1e11)
    assert table.loc[0, "optimizer_step_time_s"] == 0.0
    assert table.loc[1, "step_time_s"] == pytest.approx(8 * table.loc[0, "micro_step_time_s"])
    assert table.loc[1, "samples_per_s"] == pytest.approx(table.loc[0, "samples_per_s"])
    # autocast bf16 matmuls run at the bf16 rate: half the fp32 rate here
    assert table.loc[2, "step_time_s"] == pytest.approx(2 * table.loc[0, "step_time_s"])


def test_recomputation_adds_the_checkpointed_layers_forward(profile):
    pp = profile.for_precision("fp32")
    table = predict_table(profile, [TrainConfig("fp32", 2, 1, 0), TrainConfig("fp32", 2, 1, 2)], compute_only())
    layers_forward = sum(layer.forward_flops[1] for layer in pp.layers) * 2
    assert table.loc[1, "recompute_flops_per_step"] == pytest.approx(layers_forward)
    assert table.loc[1, "flops_per_step"] - table.loc[0, "flops_per_step"] == pytest.approx(layers_forward)
    assert table.loc[1, "step_time_s"] > table.loc[0, "step_time_s"]


def test_pipeline_bubble(profile):
    table = predict_table(profile, [TrainConfig("fp32", 2, 8, 0, 1), TrainConfig("fp32", 2, 8, 0, 2),
                                    TrainConfig("fp32", 2, 8, 0, 8)], compute_only())
    assert table.loc[0, "bubble_fraction"] == 0.0
    assert table.loc[1, "bubble_fraction"] == pytest.approx(1 / 9)  # (p - 1) / (m + p - 1)
    # two stages: each micro-step takes the slower stage's time, m + p - 1 of them
    assert table.loc[1, "step_time_s"] == pytest.approx(9 * table.loc[1, "micro_step_time_s"])
    assert table.loc[1, "micro_step_time_s"] < table.loc[0, "micro_step_time_s"]
    assert math.isnan(table.loc[2, "step_time_s"])  # 8 stages of 4 layers cannot run


def test_a_dtype_without_a_native_kernel_is_predicted_that_slow(profile):
    # FACTS.md: a CPU without native fp16 matmuls runs them ~1000x slower than bf16/fp32
    slow = compute_only(fp32=1e11, bf16=1e8)
    table = predict_table(profile, [TrainConfig("fp32", 8, 1), TrainConfig("amp-bf16", 8, 1)], slow)
    assert table.loc[1, "step_time_s"] == pytest.approx(1000 * table.loc[0, "step_time_s"])
    assert slow.flops_per_s("amp-fp16") == 1e9 and slow.flops_per_s("bf16") == 1e8


def test_operator_counts_come_from_the_parameter_tensors():
    counts = op_counts(load_workload(TINY))
    assert counts.tensors_per_layer == (4, 4, 4, 4)  # LayerNorm and Linear, weight and bias each
    assert counts.tensors_outside == 3               # embedding, head weight and bias


def test_fsdp_rank_runs_the_whole_model_and_steps_its_shards(profile):
    rates = compute_only()
    one, fsdp = predict_table(profile, [TrainConfig(micro_batch=4, grad_accum=2),
                                        TrainConfig(micro_batch=4, grad_accum=2, device_split=2, split_mode="fsdp")],
                              rates).itertuples()
    assert fsdp.micro_step_time_s == pytest.approx(one.micro_step_time_s)  # a rank's micro-batch, no stages
    assert fsdp.optimizer_step_time_s == pytest.approx(one.optimizer_step_time_s / 2)  # half the state each
    assert fsdp.bubble_fraction == 0.0
    assert fsdp.samples_per_s == pytest.approx(2 * 4 * 2 / fsdp.step_time_s)  # both ranks' samples


def _rates(fp32=1e11, memory=1e10, latency=1e-5) -> DeviceRates:
    return DeviceRates("cpu", "test", 2, {"float32": fp32, "bfloat16": fp32 / 2, "float16": 1e9}, memory, latency,
                       0.1, "x")


def test_zero_infinite_or_nan_rates_are_implausible():
    from autofit.probes.device_rates import implausible

    assert implausible(_rates()) is None
    assert "float32" in implausible(_rates(fp32=0.0))
    assert "memory" in implausible(_rates(memory=math.inf))
    assert "latency" in implausible(_rates(latency=math.nan))


def test_a_probe_far_off_its_repeat_is_probed_again_and_never_cached(monkeypatch, tmp_path):
    from autofit.probes import device_rates as time_model

    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path))
    runs = iter([[_rates(fp32=1e11), _rates(fp32=1e9)], [_rates(fp32=0.0), _rates(fp32=2e11)],
                 [_rates(fp32=1e11), _rates(fp32=5e11)]])
    monkeypatch.setattr(time_model, "_probe_once", lambda device_type, dtypes=None: next(runs))
    with pytest.warns(RuntimeWarning, match="disagree"):
        rates = probe_rates("cpu")
    assert rates.matmul_flops_per_s["float32"] == 5e11  # the best plausible figure, the zero left out
    assert not list(tmp_path.glob("rates-cpu-*.json"))
    agreeing = iter([[_rates(memory=math.inf), _rates()], [_rates(fp32=1e11), _rates(fp32=1.5e11)]])
    monkeypatch.setattr(time_model, "_probe_once", lambda device_type, dtypes=None: next(agreeing))
    assert probe_rates("cpu").matmul_flops_per_s["float32"] == 1.5e11
    assert len(list(tmp_path.glob("rates-cpu-*.json"))) == 1


def test_an_implausible_cached_entry_is_measured_again(monkeypatch, tmp_path):
    from autofit.probes import device_rates as time_model

    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(time_model, "_probe_once", lambda device_type, dtypes=None: [_rates(), _rates()])
    path = time_model._cache_path("cpu")
    path.write_text(json.dumps(_rates(fp32=-1.0).to_dict()))
    assert probe_rates("cpu").matmul_flops_per_s["float32"] == 1e11
    assert json.loads(path.read_text())["matmul_flops_per_s"]["float32"] == 1e11


def test_the_probe_times_only_the_dtypes_asked_for_and_adds_a_missing_one_to_the_cache(monkeypatch, tmp_path):
    from autofit.probes import device_rates as time_model

    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path))
    asked = []

    def probe_once(device_type, dtypes=time_model.ALL_DTYPES):
        asked.append(tuple(dtypes))
        full = _rates()
        flops = {"float32": 1e11, "bfloat16": 4e11, "float16": 1e9}
        return [dataclasses.replace(full, matmul_flops_per_s={d: flops[d] for d in dtypes})] * 2

    monkeypatch.setattr(time_model, "_probe_once", probe_once)
    first = probe_rates("cpu", precisions=["fp32", "amp-bf16", "bf16"])
    assert asked == [("float32", "bfloat16")] and set(first.matmul_flops_per_s) == {"float32", "bfloat16"}
    assert probe_rates("cpu", precisions=["bf16"]) == first and len(asked) == 1  # read back
    both = probe_rates("cpu", precisions=["amp-fp16", "fp32"])
    assert asked[1] == ("float16",)  # only what the cache lacked
    assert both.matmul_flops_per_s == {"float32": 1e11, "bfloat16": 4e11, "float16": 1e9}
    assert probe_rates("cpu") == both and len(asked) == 2  # every dtype now cached


def test_children_run_with_a_passive_openmp_policy_unless_the_user_chose_one(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert procs.child_env()["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert procs.child_env()["OMP_WAIT_POLICY"] == "ACTIVE"
    assert procs.child_env({"OMP_WAIT_POLICY": "PASSIVE"})["OMP_WAIT_POLICY"] == "PASSIVE"


def test_the_cpu_probe_forks_from_the_trial_server_which_has_the_probes_policy(monkeypatch):
    import threading

    from autofit.probes.device_rates import start_probe_child

    # a fork server an earlier test's profiling started in the background must not spawn through the fakes below
    for thread in threading.enumerate():
        if thread.name in ("autofit-zygote-start", "autofit-profile-fork"):
            thread.join(timeout=120)
    spawned, forked = [], []
    monkeypatch.setattr(procs, "spawn", lambda entry, request, **kw: spawned.append(kw["env"]) or "spawned")
    monkeypatch.setattr(forkserver, "start_trial", lambda entry, request, **kw: forked.append(entry) or "forked")
    monkeypatch.delenv("AUTOFIT_TRIAL_SERVER", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)  # the server has the children's PASSIVE policy too
    assert start_probe_child("m:f", {}, "cpu", 1.0) == "forked" and forked == ["m:f"]
    assert start_probe_child("m:f", {}, "cuda", 1.0) == "spawned"  # a forked child cannot use CUDA
    assert spawned[-1]["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("AUTOFIT_TRIAL_SERVER", "0")
    assert start_probe_child("m:f", {}, "cpu", 1.0) == "spawned"

    def refuse(*_a, **_k):
        raise OSError("no server")

    monkeypatch.setenv("AUTOFIT_TRIAL_SERVER", "1")
    monkeypatch.setattr(forkserver, "start_trial", refuse)
    assert start_probe_child("m:f", {}, "cpu", 1.0) == "spawned" and len(spawned) == 3


def test_the_layer_probe_times_the_workloads_first_layer_in_each_precision():
    from autofit.probes.layer_timing import layer_probe_child

    out = layer_probe_child({"source": TINY, "precisions": ["fp32", "bf16"], "batches": [1, 4]})["seconds"]
    assert set(out) == {"fp32", "bf16"} and all(len(s) == 2 and min(s) > 0 for s in out.values())


def test_layer_scales_are_the_measured_line_over_the_models_and_rescale_the_micro_step(profile):
    from autofit.estimator.layer_prior import layer_scales
    from autofit.estimator.time_model import OpCounts, layer_time_line
    from autofit.probes.layer_timing import LAYER_BATCHES

    rates = _rates()
    counts = op_counts(load_workload(TINY))
    fixed, per_sample = layer_time_line(profile, "fp32", rates, counts)
    measured = [3 * fixed + 2 * per_sample * b for b in LAYER_BATCHES]  # twice as slow per sample, 3x fixed
    scales = layer_scales(profile, rates, counts, {"fp32": measured, "amp-bf16": [1.0, 0.5]})
    assert scales["fp32"] == pytest.approx((2.0, 3.0)) and "amp-bf16" not in scales  # a falling line: no evidence
    config = TrainConfig.parse("precision=fp32,micro_batch=4")
    plain = predict_table(profile, [config], rates, counts).iloc[0]
    doubled = OpCounts(counts.tensors_per_layer, counts.tensors_outside, (("fp32", 2.0, 2.0),))
    scaled = predict_table(profile, [config], rates, doubled).iloc[0]
    assert scaled["micro_step_time_s"] == pytest.approx(2 * plain["micro_step_time_s"])
    assert scaled["optimizer_step_time_s"] == pytest.approx(plain["optimizer_step_time_s"])


def test_a_precision_without_its_own_layer_factors_gets_the_others_mean(profile, monkeypatch):
    from autofit.estimator import layer_prior
    from autofit.estimator.time_model import layer_time_line
    from autofit.probes.layer_timing import LAYER_BATCHES, LayerTimings

    rates = _rates()
    counts = op_counts(load_workload(TINY))
    fixed, per_sample = layer_time_line(profile, "fp32", rates, counts)
    line = [fixed + 4 * per_sample * b for b in LAYER_BATCHES]  # fixed x1, per sample x4
    monkeypatch.setattr(layer_prior, "measure_layer_timings",
                        lambda *a, **k: LayerTimings({"fp32": line, "amp-bf16": [1.0, 0.5]}, {}))
    notes = []
    prior = layer_prior.workload_prior(load_workload(TINY), profile, rates, ["fp32", "amp-bf16"], note=notes.append)
    assert prior.scales("fp32") == pytest.approx((4.0, 1.0)) and prior.scales("amp-bf16") == pytest.approx((4.0, 1.0))
    assert notes == ["the layer timings of amp-bf16 are not used (the slope lost in noise, or the layer 0.2-20x off the "
                     "time model's): they get the others' mean factors"]  # said, not silent


def test_a_spawned_probe_waits_for_a_fork_server_still_starting(monkeypatch):
    """Profiling may leave the fork server importing when the probe starts: a probe spawned beside it
    (on CUDA: a forked child cannot use it) waits for it to finish, so its imports never run beside
    the timing; waiting starts no server."""
    from autofit.probes.device_rates import start_probe_child

    events = []
    monkeypatch.setattr(procs, "spawn", lambda entry, request, **kw: events.append("spawn") or "spawned")
    monkeypatch.setattr(forkserver, "wait_started", lambda: events.append("wait"))
    assert start_probe_child("m:f", {}, "cuda", 1.0) == "spawned"
    assert events == ["wait", "spawn"]
    monkeypatch.undo()
    forkserver.stop_server()
    forkserver.wait_started()  # none starting: returns at once
    assert not forkserver.ready()


def test_the_fixed_factor_moves_only_by_what_the_timing_resolves(profile):
    """The fixed part is the small intercept of two timed points: a few percent of noise on a point moves
    it several times over, so within the points' noise band the prediction stays, beyond it the factor
    moves by the excess only."""
    from autofit.estimator.layer_prior import _fixed_seconds, layer_scales
    from autofit.estimator.time_model import layer_time_line
    from autofit.probes.layer_timing import LAYER_BATCHES

    rates = _rates()
    counts = op_counts(load_workload(TINY))
    fixed, per_sample = layer_time_line(profile, "fp32", rates, counts)
    line = [3 * fixed + per_sample * b for b in LAYER_BATCHES]  # measured: fixed x3, per sample x1
    assert layer_scales(profile, rates, counts, {"fp32": line})["fp32"] == pytest.approx((1.0, 3.0))
    b1, b2 = LAYER_BATCHES
    # a band as wide as the difference: the prediction stays
    wide = 2 * fixed * (b2 - b1) / b2
    scales = layer_scales(profile, rates, counts, {"fp32": line}, {"fp32": [wide, 0.0]})
    assert scales["fp32"] == pytest.approx((1.0, 1.0))
    # a band of half of it: the factor moves half way
    half = fixed * (b2 - b1) / b2
    scales = layer_scales(profile, rates, counts, {"fp32": line}, {"fp32": [half, 0.0]})
    assert scales["fp32"] == pytest.approx((1.0, 2.0))
    # below the prediction the same way, down to it and no further
    assert _fixed_seconds((0.010, 0.040), (0.0, 0.0), 0.002) == pytest.approx(0.0)
    assert _fixed_seconds((0.010, 0.040), (0.003, 0.0), 0.002) == pytest.approx(0.002)
