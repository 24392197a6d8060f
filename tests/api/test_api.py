"""The launcher API: the example the README quotes runs as written; estimate and measure wrappers; applying a config."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from trial_workloads import TINY_LM as TINY
from trial_workloads import TinyLM, tiny_lm_batch

import autofit
from autofit import api
from autofit.core.config import TrainConfig
from autofit.core.errors import ConfigError
from autofit.estimator.memory_model import MemoryEstimate
from autofit.trial.apply import TrainingPlan

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "launcher.py"


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")


@pytest.mark.slow
def test_the_launcher_example_runs_as_written(tmp_path):
    # exactly as the README says: python examples/launcher.py (here from a scratch directory)
    proc = subprocess.run([sys.executable, str(EXAMPLE)], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "best: " in proc.stdout and "step 2: loss" in proc.stdout
    out = tmp_path / "results" / "launcher-example"
    assert (out / "best.json").is_file() and (out / "trials.csv").is_file() and (out / "summary.md").is_file()
    # the example's budget decides: some configs are predicted over it, and the answer uses a third or more
    assert "over_budget" in set(pd.read_csv(out / "trials.csv").reason_kind.dropna())
    best = json.loads((out / "best.json").read_text())
    assert best["measured"]["peak_bytes"] >= best["budget_bytes"] / 3


def test_estimate_one_config_or_a_space():
    one = api.estimate(TINY, "precision=amp-bf16,micro_batch=4", budget="64MB", device="cpu")
    assert isinstance(one, MemoryEstimate) and one.fits and one.peak_bytes > 0
    table = api.estimate(TINY, {"precision": ["fp32"], "micro_batch": [2, 4], "checkpoint_every": [0, 1]},
                         budget="64MB", device="cpu")
    assert isinstance(table, pd.DataFrame) and len(table) == 4 and table["fits"].all()


@pytest.mark.slow
def test_measure_runs_one_isolated_trial():
    result = api.measure(TINY, "precision=fp32,micro_batch=4", budget="64MB", device="cpu", steps=1, timeout_s=120)
    assert result.ok and result.peak_bytes < 64_000_000 and result.samples_per_s > 0


# --- applying a config to your own loop -----------------------------------------------------------------


def _loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_accumulated_micro_batches_give_the_gradient_of_the_wholetiny_lm_batch():
    inputs, targets = tiny_lm_batch(8)
    plain = TinyLM()
    _loss(plain(inputs), targets).backward()
    model = TinyLM()
    plan = TrainingPlan(TrainConfig("fp32", 2, 4, checkpoint_every=2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with plan.run(model, optimizer) as run:
        assert "forward" in vars(model.blocks[0])  # checkpointed
        micro = run.micro_batches((inputs, targets))
        assert [m[0].shape[0] for m in micro] == [2, 2, 2, 2]
        for x, y in micro:
            with run.autocast():
                loss = _loss(model(x), y)
            run.backward(loss)
        for p_plain, p in zip(plain.parameters(), model.parameters()):
            torch.testing.assert_close(p.grad, p_plain.grad, rtol=1e-4, atol=1e-6)
        run.step()
        assert all(p.grad is None for p in model.parameters())
    assert "forward" not in vars(model.blocks[0])  # leaving the run removes the checkpointing


def test_plan_precisions():
    bf16 = TrainingPlan(TrainConfig("bf16", 2, 1))
    model = bf16.prepare(TinyLM())
    assert next(model.parameters()).dtype == torch.bfloat16
    (x, y), = bf16.micro_batches(tiny_lm_batch(2))
    assert x.dtype == torch.int64  # integer inputs are not cast
    floats = bf16.micro_batches((torch.ones(2, 3), torch.zeros(2)))
    assert floats[0][0].dtype == torch.bfloat16
    assert TrainingPlan(TrainConfig("amp-fp16", 1, 1)).grad_scaler() is not None
    assert TrainingPlan(TrainConfig("amp-bf16", 1, 1)).grad_scaler() is None
    with TrainingPlan(TrainConfig("amp-bf16", 1, 1)).autocast():
        assert torch.is_autocast_enabled("cpu")
    with pytest.raises(ConfigError, match="needs micro_batch 2 x grad_accum 2 = 4"):
        TrainingPlan(TrainConfig("fp32", 2, 2)).micro_batches(tiny_lm_batch(3))
    with pytest.raises(ConfigError, match="device_split 2"):
        TrainingPlan(TrainConfig("fp32", 1, 1, 0, 2)).prepare(TinyLM())


def test_train_step_helper_and_fp16_scaler():
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with TrainingPlan(TrainConfig("amp-fp16", 2, 2)).run(model, optimizer) as run:
        assert run.scaler is not None
        loss = run.train_step(tiny_lm_batch(4), lambda m, batch: _loss(m(batch[0]), batch[1]))
    assert loss > 0


def test_every_public_name_resolves():
    # the launcher API is imported lazily: a name in __all__ whose module moved would fail only here
    for name in autofit.__all__:
        assert getattr(autofit, name) is not None, name
    assert set(api.__all__) >= {"search", "estimate", "measure", "SearchResult", "TrainingPlan", "TrainingRun"}
    from autofit import study

    for name in study.__all__:
        assert getattr(study, name) is not None, name


def test_readme_api_excerpt_is_taken_from_the_launcher_example():
    # The README shows a few lines of examples/launcher.py (which the test above runs) and links it:
    # every line of its Python block is a line of the example, in the example's order.
    readme = (REPO / "README.md").read_text()
    assert "](examples/launcher.py)" in readme
    (block,) = [b.split("```", 1)[0] for b in readme.split("```python\n")[1:] if "autofit.search(" in b]
    example = [line.strip() for line in EXAMPLE.read_text().splitlines()]
    at = 0
    for line in filter(None, (line.strip() for line in block.splitlines())):
        assert line in example[at:], f"README line not in examples/launcher.py (in order): {line!r}"
        at = example.index(line, at) + 1
    assert at > 0


def test_search_prints_progress_by_default_and_is_silent_when_asked(tmp_path, capfd):
    space = {"precision": ["fp32"], "micro_batch": [2]}
    out = tmp_path / "study"
    result = autofit.search(TINY, "64MB", space=space, trials=1, out=out, device="cpu")
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("[")]
    assert result.n_real == 1 and lines, err[-2000:]  # the CLI's lines: "[    0s] profiling ...", each trial, the end
    assert lines[-1].endswith("done") and any("trial 1 " in line for line in lines), err
    assert any(f"study {result.study_name} in {out}" in line for line in lines), err
    # resumed (its one trial done: no new trial), silent
    for quiet in (False, None):
        autofit.search(TINY, "64MB", space=space, trials=1, out=out, device="cpu", progress=quiet)
        assert not [line for line in capfd.readouterr().err.splitlines() if line.startswith("[")]
    events = []
    autofit.search(TINY, "64MB", space=space, trials=1, out=out, device="cpu", progress=events.append)
    assert events and events[-1].done and not capfd.readouterr().err.strip()
    with pytest.raises(autofit.StudyError, match="progress must be True"):
        autofit.search(TINY, "64MB", space=space, trials=1, out=out, device="cpu", progress="yes")


class _Stop(Exception):
    pass


@pytest.mark.parametrize("runner, starts", [(None, True), ("injected", False)])
def test_a_cpu_search_starts_its_trials_fork_server_before_profiling(tmp_path, monkeypatch, runner, starts):
    """With the profile in the cache nothing else starts it early, so without this the first trial would
    wait for its imports; a search whose trials do not fork from it (an injected runner) starts none."""
    from autofit.api import run_study
    from autofit.runtime import forkserver

    calls = []
    monkeypatch.setattr(forkserver, "start_server_soon", lambda extra=None: calls.append("fork server"))

    def profiled(*args, **kwargs):
        calls.append("profile")
        raise _Stop

    monkeypatch.setattr(run_study, "profile_workload", profiled)
    with pytest.raises(_Stop):
        run_study.search(TINY, "64MB", space={"precision": ["fp32"], "micro_batch": [2], "global_batch": 2},
                         out_dir=tmp_path / "s", device="cpu", progress=lambda event: None,
                         trial_runner=None if runner is None else (lambda *a, **k: None))
    assert calls == (["fork server", "profile"] if starts else ["profile"])
