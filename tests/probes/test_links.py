"""The device splits' communication in the time model: FSDP's gathers and reduce-scatters, a pipeline's
sends, costed from the profile's bytes and a link probe (autofit.probes.links)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from trial_workloads import TINY_LM as TINY

from autofit.core.config import TrainConfig
from autofit.estimator.time_model import predict_table
from autofit.probes.device_rates import DeviceRates
from autofit.probes.links import LinkRates, probe_links, with_links
from autofit.workloads.load import load_workload


@pytest.fixture(scope="module")
def profile():
    from autofit.profiling.profile import profile_workload

    return profile_workload(load_workload(TINY), ["fp32", "bf16"], device_type="cpu")


def _rates(links: LinkRates | None = None) -> DeviceRates:
    """Rates where only FLOPs cost time (memory free, operators instant), plus ``links``."""
    return DeviceRates("cpu", "test", 2, {"float32": 1e11, "bfloat16": 1e11, "float16": 1e9}, math.inf, 0.0, 0.0, "x",
                       links={"2": links.to_dict()} if links is not None else None)


def _link(bytes_per_s=math.inf, unit_s=0.0, latency_s=0.0, dtensor_op_s=0.0) -> LinkRates:
    ops = ("all_gather", "reduce_scatter", "send")
    return LinkRates("cpu", 2, "gloo", {op: latency_s for op in ops}, {op: bytes_per_s for op in ops}, unit_s,
                     dtensor_op_s, 0.1, "x")


def _step(profile, config: TrainConfig, links: LinkRates | None) -> float:
    return float(predict_table(profile, [config], _rates(links))["step_time_s"].iloc[0])


def _fsdp(precision="fp32", checkpoint_every=0, grad_accum=2) -> TrainConfig:
    return TrainConfig(precision, 4, grad_accum, checkpoint_every, device_split=2, split_mode="fsdp")


def test_fsdp_moves_its_parameters_and_gradients_at_every_micro_step(profile):
    bare = _step(profile, _fsdp(), None)
    slow = _step(profile, _fsdp(), _link(bytes_per_s=1e8))
    slower = _step(profile, _fsdp(), _link(bytes_per_s=5e7))
    added = slow - bare
    assert added > 0  # the gathers and reduce-scatters cost time
    assert slower - bare == pytest.approx(2 * added)  # bytes over the link: half the rate, twice the time
    # every micro-step gathers and reduce-scatters again
    assert _step(profile, _fsdp(grad_accum=4), _link(bytes_per_s=1e8)) - _step(profile, _fsdp(grad_accum=4), None) \
        == pytest.approx(2 * added)
    # the bytes are the parameters' in their dtype: bf16 moves half of fp32's
    half = _step(profile, _fsdp("bf16"), _link(bytes_per_s=1e8)) - _step(profile, _fsdp("bf16"), None)
    assert half == pytest.approx(added / 2, rel=0.02)


def test_fsdp_pays_its_measured_overhead_once_per_unit(profile):
    def added(every: int) -> float:
        return _step(profile, _fsdp(checkpoint_every=every), _link(unit_s=1e-3)) - \
            _step(profile, _fsdp(checkpoint_every=every), None)

    # a unit per layer (4) or per checkpoint segment of 2 layers (2), and the root: 5 or 3 units per micro-step
    assert added(0) / added(2) == pytest.approx(5 / 3)
    assert added(1) == pytest.approx(added(0))


def test_an_fsdp_rank_steps_a_shard_of_every_tensor_as_dtensors(profile):
    def optimizer_s(rates: DeviceRates) -> tuple[float, float]:
        one, fsdp = predict_table(profile, [TrainConfig("fp32", 4, 2, 0), _fsdp()], rates)["optimizer_step_time_s"]
        return one, fsdp

    ops_only = dataclasses.replace(_rates(), op_latency_s=1e-5)
    one, fsdp = optimizer_s(ops_only)
    assert one > 0 and fsdp == pytest.approx(one)  # as many tensors (shards), as many operators
    one, fsdp = optimizer_s(dataclasses.replace(_rates(), memory_bytes_per_s=1e9))
    assert one > 0 and fsdp == pytest.approx(one / 2)  # half the bytes
    # each of those operators on a DTensor costs what the probe measured beyond a plain one
    one, fsdp = optimizer_s(dataclasses.replace(_rates(_link(dtensor_op_s=1e-5)), op_latency_s=1e-5))
    assert fsdp == pytest.approx(2 * one)


def test_a_pipeline_sends_activations_and_their_gradients_at_each_boundary(profile):
    def added(micro_batch: int, link: LinkRates) -> float:
        config = TrainConfig("fp32", micro_batch, 4, 0, device_split=2)
        return _step(profile, config, link) - _step(profile, config, None)

    # without the probe a boundary is a copy at the memory rate (free here): with it, sends cost time
    link = _link(bytes_per_s=1e7)
    assert added(2, link) > 0
    assert added(4, link) == pytest.approx(2 * added(2, link))  # the activations of each sample
    assert added(2, _link(bytes_per_s=5e6)) == pytest.approx(2 * added(2, link))
    assert added(2, _link(latency_s=1e-3)) > 0  # each send has its latency
    one_device = TrainConfig("fp32", 2, 4, 0)
    assert _step(profile, one_device, link) == _step(profile, one_device, None)  # nothing to send


def test_no_probe_without_a_split_that_runs(monkeypatch):
    from autofit.probes import links as collectives

    monkeypatch.setattr(collectives, "probe_links", lambda *a, **k: pytest.fail("probed"))
    rates = _rates()
    one = [TrainConfig("fp32", 2, 1, 0)]
    assert with_links(rates, one, devices=2) is rates
    assert with_links(rates, [TrainConfig("fp32", 2, 1, 0, device_split=2)], devices=1) is rates  # estimated only


def test_probe_times_gloo_ranks_and_is_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    lines = []
    links = probe_links("cpu", 2, note=lines.append)
    assert links is not None and links.backend == "gloo" and links.world_size == 2
    assert all(v > 0 for v in [*links.latency_s.values(), *links.bytes_per_s.values()])
    assert links.fsdp_unit_s >= 0 and links.dtensor_op_s >= 0
    assert probe_links("cpu", 2, note=lines.append) == links  # read back, not measured again
    assert "read from the cache" in lines[-1]
    rates = with_links(_rates(), [TrainConfig("fp32", 2, 1, 0, device_split=2, split_mode="fsdp")], devices=2)
    assert rates.link(2) == links and rates.link(4) is None


def test_a_failed_probe_leaves_the_communication_out(monkeypatch, tmp_path):
    from autofit.probes import links as collectives

    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path))

    def fail(device_type, world_size):
        raise RuntimeError("the link probe of 2 cpu ranks failed: rank 1 process exited with 1")

    monkeypatch.setattr(collectives, "measure_links", fail)
    lines = []
    assert probe_links("cpu", 2, note=lines.append) is None
    assert "leaves the splits' communication out" in lines[-1]
    rates = _rates()
    assert with_links(rates, [TrainConfig("fp32", 2, 1, 0, device_split=2)], devices=2) is rates


def test_links_survive_the_rates_round_trip():
    rates = _rates(_link(bytes_per_s=1e9, unit_s=1e-3))
    back = DeviceRates.from_dict(rates.to_dict())
    assert back.link(2) == rates.link(2)
    assert dataclasses.replace(back, links=None).link(2) is None
