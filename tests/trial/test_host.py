"""The trial host: one process runs trials one after another, and ends after any that is not ok."""

from __future__ import annotations

import pytest

from autofit.core.config import TrainConfig
from autofit.core.procstat import GONE_STATES, stat_fields
from autofit.runtime import forkserver
from autofit.trial import host
from autofit.trial.run import TrialStatus, run_trial


def _pids(pidfile) -> list[int]:
    return [int(line) for line in pidfile.read_text().split()] if pidfile.exists() else []


def _alive(pid: int) -> bool:
    fields = stat_fields(pid)
    return fields is not None and fields[0] not in GONE_STATES


@pytest.fixture
def hosted(tmp_path, monkeypatch):
    """Trials run in a host on the CPU; each loaded workload appends its process id to the returned file."""
    monkeypatch.setenv("AUTOFIT_TRIAL_HOST", "1")
    path = tmp_path / "pids"
    monkeypatch.setenv("AUTOFIT_TEST_PIDFILE", str(path))
    yield path
    host.release()
    forkserver.stop_server()
    assert not [pid for pid in _pids(path) if _alive(pid)], "a host outlived its release"


def test_trials_in_one_host_measure_what_separate_processes_measure(trial_workload_spec, hosted, monkeypatch):
    spec = trial_workload_spec("tiny")
    configs = [TrainConfig(micro_batch=8), TrainConfig(micro_batch=4, grad_accum=2), TrainConfig(micro_batch=8)]
    in_host = [run_trial(spec, c, timeout_s=120) for c in configs]
    assert [r.status for r in in_host] == [TrialStatus.OK] * 3
    assert len(set(_pids(hosted))) == 1, "the trials did not share one host"
    monkeypatch.setenv("AUTOFIT_TRIAL_HOST", "0")
    alone = [run_trial(spec, c, timeout_s=120) for c in configs]
    assert len(set(_pids(hosted))) == 4  # one fresh process per trial
    # The peak is the trial's own: nothing of the trial before it stays on the host.
    assert [r.peak_bytes for r in in_host] == [r.peak_bytes for r in alone]
    assert [r.breakdown for r in in_host] == [r.breakdown for r in alone]


def test_a_trial_that_is_not_ok_ends_its_host(trial_workload_spec, hosted):
    spec = trial_workload_spec("tiny")
    assert run_trial(spec, TrainConfig(micro_batch=8), timeout_s=120).ok
    over = run_trial(spec, TrainConfig(micro_batch=8), budget_bytes=1000, timeout_s=120)
    assert over.status is TrialStatus.OOM
    first = _pids(hosted)[0]
    assert not _alive(first), "the host that ran out of memory was kept"
    assert run_trial(spec, TrainConfig(micro_batch=8), timeout_s=120).ok
    assert len(set(_pids(hosted))) == 2


def test_a_crash_or_a_hang_in_a_host_is_a_result_and_the_next_trial_gets_a_fresh_host(trial_workload_spec, hosted):
    spec = trial_workload_spec("picky")
    assert run_trial(spec, TrainConfig(micro_batch=8), timeout_s=120).ok
    crashed = run_trial(spec, TrainConfig(micro_batch=3), timeout_s=120)
    assert (crashed.status, crashed.error) == (TrialStatus.ERROR, "killed by signal SIGSEGV")
    assert run_trial(spec, TrainConfig(micro_batch=8), timeout_s=120).ok
    hung = run_trial(spec, TrainConfig(micro_batch=5), timeout_s=8)
    assert (hung.status, hung.error) == (TrialStatus.TIMEOUT, "exceeded the wall-clock limit of 8 s")
    assert run_trial(spec, TrainConfig(micro_batch=8), timeout_s=120).ok
    pids = _pids(hosted)
    assert len(set(pids)) == 3  # a host per run of ok trials
    assert not [pid for pid in pids[:-1] if _alive(pid)]


def test_a_host_that_died_between_trials_is_replaced(trial_workload_spec, hosted):
    spec = trial_workload_spec("tiny")
    assert run_trial(spec, TrainConfig(micro_batch=8), timeout_s=120).ok
    (only,) = host._hosts.values()
    only.child.kill()  # e.g. the kernel's OOM killer, between two trials
    assert run_trial(spec, TrainConfig(micro_batch=8), timeout_s=120).ok
    assert len(set(_pids(hosted))) == 2


def test_which_trials_run_in_a_host(monkeypatch):
    monkeypatch.delenv("AUTOFIT_TRIAL_HOST", raising=False)
    assert host.enabled("cuda") and host.enabled("cuda:1") and not host.enabled("cpu")
    monkeypatch.setenv("AUTOFIT_TRIAL_HOST", "0")
    assert not host.enabled("cuda")
    monkeypatch.setenv("AUTOFIT_TRIAL_HOST", "1")
    assert host.enabled("cpu")
    one = TrainConfig(micro_batch=8).to_dict()
    split = TrainConfig(micro_batch=8, device_split=2).to_dict()
    assert host.hosts_request({"source": "gpt-tiny", "config": one})
    assert host.hosts_request({"source": "gpt-tiny", "configs": [one, one]})
    assert not host.hosts_request({"source": "gpt-tiny", "config": split})  # its ranks are processes of their own
    assert not host.hosts_request({"source": None, "config": one})  # only a forked child can inherit it


def test_a_search_starts_its_host_before_profiling_and_ends_it(tmp_path, monkeypatch, hosted):
    from trial_workloads import TINY_LM

    from autofit.api.run_study import search

    started = []
    real_init = host.TrialHost.__init__

    def counted(self, *args, **kwargs):
        started.append(args)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(host.TrialHost, "__init__", counted)
    space = {"precision": ["fp32"], "micro_batch": [2, 4], "global_batch": 4, "checkpoint_every": [0]}
    result = search(TINY_LM, "64MB", space=space, out_dir=tmp_path / "s", device="cpu", patience=10)
    assert result.n_real >= 2 and result.best is not None
    assert len(started) == 1, "the trials did not run in the host started before profiling"
    assert host._hosts == {}, "the search left its host running"


def test_workers_sharing_a_gpu_start_a_process_per_trial(monkeypatch):
    from autofit.study.launcher import _shares_gpus, worker_env
    from autofit.study.settings import StudySettings

    assert not _shares_gpus([["0", "1"], ["2", "3"]], 0)
    assert _shares_gpus([["0"], ["1"], ["0"]], 2) and _shares_gpus([["0"], ["1"], ["0"]], 0)
    assert not _shares_gpus([["0"], ["1"], ["0"]], 1) and not _shares_gpus([], 0)
    settings = StudySettings(workload_name="w", workload_source="gpt-tiny", budget_bytes=1 << 30, budget_text="1GB",
                             space={}, device_type="cuda", devices=1, study_name="s", out_dir="o")
    monkeypatch.delenv("AUTOFIT_TRIAL_HOST", raising=False)
    assert worker_env(settings, 3, ["0"], shared=True)["AUTOFIT_TRIAL_HOST"] == "0"
    assert "AUTOFIT_TRIAL_HOST" not in worker_env(settings, 2, ["0"], shared=False)


def test_ready_within_waits_for_the_host_start_soon_started(trial_workload_spec, hosted):
    assert not host.ready_within(0.1), "no host was started"
    host.start_soon(trial_workload_spec("tiny"), "cpu")
    assert host.ready_within(120)
    host.release()
    assert not host.ready_within(0.1)
