"""On a GPU the device probe runs in a thread while the search profiles (autofit.api.run_study); the CUDA
probe itself cannot run here, so a stand-in takes its place."""

from __future__ import annotations

import threading

import pytest

from autofit.api import run_study
from autofit.core.space import space_from_dict

SPACE = space_from_dict({"precision": ["fp32"], "micro_batch": [1, 2], "global_batch": 2, "device_split": [1]})


def test_on_the_cpu_the_probe_waits_for_the_profiling(monkeypatch):
    # its rates are CPU time: timed beside the profiling they would be the profiling's
    monkeypatch.setattr(run_study.os, "cpu_count", lambda: 64)
    assert run_study.probe_beside_profiling("cpu", SPACE.precision) is None


def test_on_a_small_gpu_machine_too(monkeypatch):
    monkeypatch.setattr(run_study.os, "cpu_count", lambda: run_study.PROBE_BESIDE_PROFILING_CPUS - 1)
    assert run_study.probe_beside_profiling("cuda", SPACE.precision) is None


def test_on_a_gpu_the_probe_runs_while_this_thread_goes_on(monkeypatch):
    monkeypatch.setattr(run_study.os, "cpu_count", lambda: 16)
    started, release, seen = threading.Event(), threading.Event(), {}

    def probe(device, use_cache=True, note=None, precisions=None):
        seen.update(device=device, precisions=list(precisions), thread=threading.current_thread().name)
        started.set()
        assert release.wait(10)
        return "rates"

    monkeypatch.setattr(run_study, "probe_rates", probe)
    early = run_study.probe_beside_profiling("cuda", SPACE.precision)
    assert started.wait(10) and not early.done()  # the caller is free meanwhile: it profiles
    release.set()
    assert early.result(timeout=10) == "rates"
    assert seen["device"] == "cuda" and seen["thread"] == "autofit-probe"
    assert [p.value for p in seen["precisions"]] == ["fp32"]


def test_a_probe_that_fails_fails_where_its_rates_are_read(monkeypatch):
    monkeypatch.setattr(run_study.os, "cpu_count", lambda: 16)

    def probe(device, use_cache=True, note=None, precisions=None):
        raise RuntimeError("the cuda rate probe failed: no device")

    monkeypatch.setattr(run_study, "probe_rates", probe)
    early = run_study.probe_beside_profiling("cuda", SPACE.precision)
    with pytest.raises(RuntimeError, match="the cuda rate probe failed: no device"):
        early.result(timeout=10)


def test_rates_probed_already_are_not_probed_again(monkeypatch):
    calls = []
    monkeypatch.setattr(run_study, "probe_rates", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(run_study, "with_links", lambda rates, configs, devices, note=None: rates)
    monkeypatch.setattr(run_study, "workload_prior", lambda *a, **k: "prior")
    assert run_study.device_prior(None, None, "cuda", SPACE, probed="probed") == ("probed", "prior")
    assert calls == []
