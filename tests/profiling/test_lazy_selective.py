"""Profiles without the selective forwards (``profile_workload(..., selective=False)``): a search whose
space has no selectively checkpointed config skips tracing them; nothing estimates the selective policy
from such a profile, and the cache profiles the precision again when they are asked for."""

from __future__ import annotations

import json

import pytest

from autofit.core.config import TrainConfig
from autofit.core.errors import ProfileError, WorkloadError
from autofit.estimator.memory_model import estimate_table, needs_selective
from autofit.profiling import precision as profile_module
from autofit.profiling.profile import profile_workload
from autofit.runtime import forkserver
from autofit.workloads.load import load_workload

ONE = TrainConfig.parse("precision=fp32,micro_batch=2,grad_accum=2")
FULL = TrainConfig.parse("precision=fp32,micro_batch=2,checkpoint_every=1")
SELECTIVE = TrainConfig.parse("precision=fp32,micro_batch=2,checkpoint_every=1,checkpoint_policy=selective")


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """In-process profiling (no workers), each precision's whole profile counted by whether it traced
    the selective forwards."""
    monkeypatch.setenv("AUTOFIT_PROFILE_WORKERS", "1")
    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path))
    calls = {"lazy": 0, "full": 0}
    whole = profile_module.profile_precision

    def count(*args, **kwargs):
        selective = kwargs.get("selective", args[4] if len(args) > 4 else True)
        calls["full" if selective else "lazy"] += 1
        return whole(*args, **kwargs)

    monkeypatch.setattr(profile_module, "profile_precision", count)
    return calls


def _precisions(profile) -> dict:
    return json.loads(profile.to_json())["precisions"]


def _without_selective(profile) -> dict:
    """The profile's JSON with every selective field of its layers and its skip flag left out."""
    out = _precisions(profile)
    for pp in out.values():
        pp.pop("selective_skipped")
        pp["layers"] = [{k: v for k, v in layer.items() if not k.startswith("selective")} for layer in pp["layers"]]
    return out


def test_without_the_selective_policy_its_forwards_are_not_traced(counted, trial_workload_spec):
    workload = load_workload(trial_workload_spec("tiny_lm"))
    lazy = profile_workload(workload, ["fp32", "bf16"], use_cache=False, selective=False)
    assert counted == {"lazy": 2, "full": 0}
    assert all(pp.selective_skipped for pp in lazy.precisions.values())
    assert all(layer.selective_saved_flops == (0.0, 0.0) for layer in lazy.for_precision("fp32").layers)
    full = profile_workload(workload, ["fp32", "bf16"], use_cache=False)
    assert not any(pp.selective_skipped for pp in full.precisions.values())
    assert any(layer.selective_saved_flops != (0.0, 0.0) for layer in full.for_precision("fp32").layers)
    # everything else, the real check's corrections included, is the same profile
    assert _without_selective(lazy) == _without_selective(full)
    configs = [ONE, FULL]
    assert estimate_table(lazy, configs)["peak_bytes"].tolist() == estimate_table(full, configs)["peak_bytes"].tolist()


def test_the_selective_policy_of_a_profile_without_its_forwards_is_refused(counted, trial_workload_spec):
    workload = load_workload(trial_workload_spec("tiny_lm"))
    lazy = profile_workload(workload, ["fp32"], use_cache=False, selective=False)
    with pytest.raises(ProfileError, match=r"tiny-lm fp32: the selective checkpoint policy.*selective=True"):
        estimate_table(lazy, [ONE, SELECTIVE])


def test_a_cached_profile_without_them_is_profiled_again_when_they_are_asked_for(counted, trial_workload_spec, tmp_path):
    workload = load_workload(trial_workload_spec("tiny_lm"))
    profile_workload(workload, ["fp32"], selective=False)
    again = profile_workload(workload, ["fp32"], selective=False)  # served from the cache as it is
    assert counted == {"lazy": 1, "full": 0} and again.for_precision("fp32").selective_skipped
    completed = profile_workload(workload, ["fp32"])
    assert counted == {"lazy": 1, "full": 1} and not completed.for_precision("fp32").selective_skipped
    fresh = profile_workload(workload, ["fp32"], use_cache=False)
    assert _precisions(completed) == _precisions(fresh)
    counted.update(lazy=0, full=0)
    for selective in (False, True):  # the completed entry serves both requests
        assert _precisions(profile_workload(workload, ["fp32"], selective=selective)) == _precisions(completed)
    assert counted == {"lazy": 0, "full": 0}
    (entry,) = tmp_path.glob("tiny-lm-cpu-*.json")
    assert not json.loads(entry.read_text())["precisions"]["fp32"]["selective_skipped"]


def test_a_precision_profiled_again_keeps_its_cached_optimizer_choices(counted, trial_workload_spec):
    workload = load_workload(trial_workload_spec("tiny_lm"))
    lazy = profile_workload(workload, ["fp32"], selective=False, optimizers=["adafactor"])
    assert lazy.for_precision("fp32").optimizer_option("adafactor") is not None
    completed = profile_workload(workload, ["fp32"])  # asks for no optimizer choice: the cached one stays
    assert completed.for_precision("fp32").optimizer_option("adafactor") == lazy.for_precision("fp32").optimizer_option("adafactor")


def test_needs_selective_only_for_a_selectively_checkpointed_config():
    assert not needs_selective([ONE, FULL])
    assert needs_selective([ONE, SELECTIVE])
    assert not needs_selective([])


@pytest.mark.parametrize("policies, expected", [(["full"], False), (["full", "selective"], True)])
def test_the_search_profiles_the_selective_forwards_only_when_its_space_has_them(monkeypatch, tmp_path, trial_workload_spec,
                                                                                  policies, expected):
    from autofit.api import run_study as study_run

    asked = []

    def profiled(*args, selective=True, **kwargs):
        asked.append(selective)
        raise WorkloadError("stop after profiling")  # the flag is all this test needs

    monkeypatch.setattr(study_run, "profile_workload", profiled)
    space = {"precision": ["fp32"], "micro_batch": [2], "global_batch": 4, "checkpoint_every": [0, 1],
             "checkpoint_policy": policies}
    with pytest.raises(WorkloadError, match="stop after profiling"):
        study_run.search(trial_workload_spec("tiny_lm"), "64MB", space=space, out_dir=tmp_path / "s", device="cpu")
    assert asked == [expected]


def test_forked_workers_skip_them_as_this_process_does(forked_requests, monkeypatch, trial_workload_spec):
    workload = load_workload(trial_workload_spec("tiny_lm"))
    precisions = ["fp32", "bf16"]
    forkserver.ensure_server()  # up: one precision forked, the other profiled here beside it
    lazy = profile_workload(workload, precisions, selective=False)
    assert [r["selective"] for r in forked_requests] == [False]
    assert all(lazy.for_precision(p).selective_skipped for p in precisions)
    monkeypatch.setenv("AUTOFIT_PROFILE_WORKERS", "1")
    assert _precisions(lazy) == _precisions(profile_workload(workload, precisions, use_cache=False, selective=False))
