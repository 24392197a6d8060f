"""Profiles without split ends (``profile_workload(..., split_ends=False)``): a search whose space
has no pipeline split skips profiling the untied ends of a model with tied weights; nothing
estimates a pipeline split from such a profile, and the cache completes it when they are asked for."""

from __future__ import annotations

import json
import math

import pytest

from autofit.core.config import TrainConfig
from autofit.core.errors import ProfileError, WorkloadError
from autofit.estimator.memory_model import estimate_table, needs_split_ends
from autofit.estimator.memory_table import ENDS_NOT_PROFILED
from autofit.profiling import precision as profile_module
from autofit.profiling.profile import profile_workload
from autofit.runtime import forkserver
from autofit.workloads.load import load_workload


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """In-process profiling (no workers) with the whole profiles and the untied-ends profiles counted."""
    monkeypatch.setenv("AUTOFIT_PROFILE_WORKERS", "1")
    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path))
    calls = {"whole": 0, "ends": 0}
    whole, ends = profile_module.profile_precision, profile_module.profile_split_ends

    def count_whole(*args, **kwargs):
        calls["whole"] += 1
        return whole(*args, **kwargs)

    def count_ends(*args, **kwargs):
        calls["ends"] += 1
        return ends(*args, **kwargs)

    monkeypatch.setattr(profile_module, "profile_precision", count_whole)
    monkeypatch.setattr(profile_module, "profile_split_ends", count_ends)
    return calls


def _precisions(profile) -> dict:
    return json.loads(profile.to_json())["precisions"]


PIPELINE = TrainConfig.parse("precision=fp32,micro_batch=2,grad_accum=2,device_split=2")
FSDP = TrainConfig.parse("precision=fp32,micro_batch=2,device_split=2,split_mode=fsdp")
ONE = TrainConfig.parse("precision=fp32,micro_batch=2,grad_accum=2")


def test_without_split_ends_the_untied_model_is_not_profiled(counted, trial_workload_spec):
    workload = load_workload(trial_workload_spec("tiny_tied_lm"))
    lazy = profile_workload(workload, ["fp32"], use_cache=False, split_ends=False).for_precision("fp32")
    assert counted == {"whole": 1, "ends": 0}
    assert lazy.split_ends is None and lazy.split_ends_skipped
    full = profile_workload(workload, ["fp32"], use_cache=False).for_precision("fp32")
    assert counted == {"whole": 2, "ends": 1}
    assert full.split_ends is not None and not full.split_ends_skipped
    # everything but the ends is the same profile
    assert lazy == full.__class__(**{**full.__dict__, "split_ends": None, "split_ends_skipped": True})


def test_an_untied_model_is_profiled_alike_either_way(counted, trial_workload_spec):
    workload = load_workload(trial_workload_spec("tiny_lm"))
    lazy = profile_workload(workload, ["fp32"], use_cache=False, split_ends=False)
    full = profile_workload(workload, ["fp32"], use_cache=False)
    assert counted["ends"] == 0 and not lazy.for_precision("fp32").split_ends_skipped
    assert _precisions(lazy) == _precisions(full)
    assert estimate_table(lazy, [PIPELINE])["peak_bytes"].tolist() == estimate_table(full, [PIPELINE])["peak_bytes"].tolist()


def test_a_pipeline_split_of_a_profile_without_its_ends_is_refused(counted, trial_workload_spec):
    workload = load_workload(trial_workload_spec("tiny_tied_lm"))
    lazy = profile_workload(workload, ["fp32"], use_cache=False, split_ends=False)
    with pytest.raises(ProfileError, match=r"tiny-tied-lm fp32: device_split 2 \(pipeline\).*split_ends=True"):
        estimate_table(lazy, [ONE, PIPELINE])
    full = profile_workload(workload, ["fp32"], use_cache=False)
    # one device and FSDP ranks (the tied weight stays tied) need no ends: the same estimate
    for table in (estimate_table(lazy, [ONE, FSDP]), estimate_table(full, [ONE, FSDP])):
        assert table["valid"].all()
    assert (estimate_table(lazy, [ONE, FSDP])["peak_bytes"].tolist()
            == estimate_table(full, [ONE, FSDP])["peak_bytes"].tolist())


def test_a_cached_profile_without_ends_is_completed_when_they_are_asked_for(counted, trial_workload_spec, tmp_path):
    workload = load_workload(trial_workload_spec("tiny_tied_lm"))
    profile_workload(workload, ["fp32"], split_ends=False)
    assert counted == {"whole": 1, "ends": 0}
    again = profile_workload(workload, ["fp32"], split_ends=False)  # served from the cache as it is
    assert counted == {"whole": 1, "ends": 0} and again.for_precision("fp32").split_ends_skipped
    completed = profile_workload(workload, ["fp32"])  # only the ends are profiled
    assert counted == {"whole": 1, "ends": 1}
    assert _precisions(completed) == _precisions(profile_workload(workload, ["fp32"], use_cache=False))
    counted.update(whole=0, ends=0)
    # the completed cache entry serves both requests
    for split_ends in (False, True):
        cached = profile_workload(workload, ["fp32"], split_ends=split_ends)
        assert _precisions(cached) == _precisions(completed)
    assert counted == {"whole": 0, "ends": 0}
    (entry,) = tmp_path.glob("tiny-tied-lm-cpu-*.json")
    assert json.loads(entry.read_text())["precisions"]["fp32"]["split_ends"] is not None


def test_needs_split_ends_only_for_a_pipeline_split():
    assert not needs_split_ends([ONE, FSDP])
    assert needs_split_ends([ONE, PIPELINE])
    assert not needs_split_ends([])


def test_needs_split_ends_only_for_a_pipeline_split_a_worker_runs():
    assert not needs_split_ends([ONE, PIPELINE], devices=1)
    assert needs_split_ends([ONE, PIPELINE], devices=2)
    assert needs_split_ends([ONE, PIPELINE], devices=None)


def test_a_pipeline_split_without_its_ends_can_be_left_unestimated_instead(counted, trial_workload_spec):
    workload = load_workload(trial_workload_spec("tiny_tied_lm"))
    lazy = profile_workload(workload, ["fp32"], use_cache=False, split_ends=False)
    table = estimate_table(lazy, [ONE, PIPELINE, FSDP], unprofiled_ends_invalid=True)
    assert table["valid"].tolist() == [True, False, True]
    assert table["reason"].tolist()[1] == ENDS_NOT_PROFILED and math.isnan(table["peak_bytes"][1])
    assert (estimate_table(lazy, [ONE, FSDP])["peak_bytes"].tolist()
            == table["peak_bytes"][[0, 2]].tolist())


def test_a_one_device_search_leaves_a_pipeline_split_of_a_tied_model_unestimated(monkeypatch, tmp_path,
                                                                                 trial_workload_spec):
    """Its ends are not profiled for a split no worker runs; the split is pruned for its devices, saying so."""
    from autofit.api import run_study as study_run
    import pandas as pd

    from autofit.core.records import PruneReason

    counted_ends = []
    ends = profile_module.profile_split_ends
    monkeypatch.setattr(profile_module, "profile_split_ends", lambda *a, **k: counted_ends.append(1) or ends(*a, **k))
    monkeypatch.setenv("AUTOFIT_PROFILE_WORKERS", "1")
    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path / "cache"))
    space = {"precision": ["fp32"], "micro_batch": [2], "global_batch": 4, "device_split": [1, 2],
             "split_mode": ["pipeline", "fsdp"], "checkpoint_every": [0]}
    out = tmp_path / "s"
    study_run.search(trial_workload_spec("tiny_tied_lm"), "64MB", space=space, out_dir=out, device="cpu", devices=1,
                     trials=1, trial_runner=_one_mb_trial)
    assert counted_ends == []
    trials = pd.read_csv(out / "trials.csv")
    split = trials[trials.device_split == 2].set_index("split_mode")
    assert set(split.reason_kind) == {PruneReason.DEVICES.value}
    assert split.reason["pipeline"].endswith(ENDS_NOT_PROFILED) and pd.isna(split.predicted_peak_bytes["pipeline"])
    assert split.reason["fsdp"].endswith("estimated only") and split.predicted_peak_bytes["fsdp"] > 0


def _one_mb_trial(workload, config, *, device, budget_bytes, timeout_s, memory=True):
    from autofit.trial.run import TrialResult, TrialStatus

    return TrialResult("tiny-tied-lm", config, device, TrialStatus.OK, peak_bytes=10**6, per_device_peak_bytes=[10**6],
                       samples_per_s=10.0, step_time_s=0.4, wall_s=1.0, budget_bytes=budget_bytes)


class _Stop(Exception):
    pass


@pytest.mark.parametrize("split, modes, expected", [
    ([1], ["pipeline"], False), ([1, 2], ["pipeline"], True), ([1, 2], ["fsdp"], False), ([1, 2], ["pipeline", "fsdp"], True),
])
def test_the_search_profiles_split_ends_only_when_its_space_has_a_pipeline_split(monkeypatch, tmp_path, trial_workload_spec,
                                                                                  split, modes, expected):
    from autofit.api import run_study as study_run

    asked = []

    def profiled(*args, split_ends=True, **kwargs):
        asked.append(split_ends)
        raise WorkloadError("stop after profiling")  # the flag is all this test needs

    monkeypatch.setattr(study_run, "profile_workload", profiled)
    space = {"precision": ["fp32"], "micro_batch": [2], "global_batch": 4, "device_split": split, "split_mode": modes}
    with pytest.raises(WorkloadError, match="stop after profiling"):
        study_run.search(trial_workload_spec("tiny_tied_lm"), "64MB", space=space, out_dir=tmp_path / "s", device="cpu",
                         devices=max(split))
    assert asked == [expected]


def test_forked_workers_skip_and_complete_the_ends_as_this_process_does(forked_requests, monkeypatch,
                                                                          trial_workload_spec):
    workload = load_workload(trial_workload_spec("tiny_tied_lm"))
    precisions = ["fp32", "bf16"]
    forkserver.ensure_server()  # up: one precision forked, the other profiled here beside it
    lazy = profile_workload(workload, precisions, split_ends=False)
    completed = profile_workload(workload, precisions)
    assert [(r["split_ends"], r["ends_only"]) for r in forked_requests] == [(False, False), (True, True)]
    assert all(lazy.for_precision(p).split_ends_skipped for p in precisions)
    monkeypatch.setenv("AUTOFIT_PROFILE_WORKERS", "1")
    assert _precisions(completed) == _precisions(profile_workload(workload, precisions, use_cache=False))


@pytest.mark.parametrize("split, expected", [([1], False), ([1, 2], True)])
def test_a_worker_without_the_searchs_profile_profiles_as_the_search_does(monkeypatch, trial_workload_spec, split, expected):
    from autofit.study import worker
    from autofit.study.settings import StudySettings

    asked = []

    def profiled(*args, split_ends=True, **kwargs):
        asked.append(split_ends)
        raise WorkloadError("stop after profiling")

    monkeypatch.setattr(worker, "profile_workload", profiled)
    spec = trial_workload_spec("tiny_tied_lm")
    settings = StudySettings(workload_name="tiny-tied-lm", workload_source=spec, budget_bytes=64_000_000,
                             budget_text="64MB", space={"precision": ["fp32"], "micro_batch": [2], "device_split": split},
                             device_type="cpu", devices=2, study_name="s", out_dir="unused")
    with pytest.raises(WorkloadError, match="stop after profiling"):
        worker.run_worker(settings, load_workload(spec))
    assert asked == [expected]
