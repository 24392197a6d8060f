"""Planning a space with the lean levers: what is pruned and why, and stored trials from before them."""

from __future__ import annotations

import importlib.util

import pytest
from trial_workloads import TINY_LM

from autofit.core.config import TrainConfig
from autofit.core.records import PruneReason
from autofit.core.space import space_from_dict
from autofit.probes.device_rates import DeviceRates
from autofit.profiling.profile import profile_workload
from autofit.runtime import optimizers
from autofit.study import Planner, StudySettings, space_to_dict
from autofit.study.storage import config_of, distributions
from autofit.workloads.load import load_workload

SPACE = {"precision": ["fp32"], "micro_batch": [2, 4], "global_batch": 4, "checkpoint_every": [0, 1],
         "optimizer": ["as-given", "adafactor", "adamw8bit"], "checkpoint_policy": ["full", "selective"]}


@pytest.fixture(scope="module")
def rates():
    return DeviceRates("cpu", "test", 2, {"float32": 1e11, "bfloat16": 5e10, "float16": 1e9}, 1e10, 5e-6, 0.0, "x")


def _planner(rates, budget_bytes=10**9) -> Planner:
    space = space_from_dict(SPACE)
    settings = StudySettings(workload_name="tiny-lm", workload_source=TINY_LM, budget_bytes=budget_bytes,
                             budget_text=str(budget_bytes), space=space_to_dict(space), device_type="cpu", devices=1,
                             study_name="t", out_dir="/nonexistent")
    choices = [c for c in SPACE["optimizer"] if c != "as-given"]
    profile = profile_workload(load_workload(TINY_LM), ["fp32"], optimizers=choices)
    return Planner(settings, profile, rates)


def test_dominance_compares_checkpointing_within_one_optimizer(rates):
    planner = _planner(rates)
    step = planner.step([])
    dominated = {planner.configs[p.index]: p.text for p in step.prunes if p.reason is PruneReason.DOMINATED}
    assert dominated  # checkpointing the budget does not need is pruned...
    assert all(c.checkpoint_every > 0 for c in dominated)  # ...and only that: never another optimizer
    assert all("same precision, micro-batch, split and optimizer" in why for why in dominated.values())
    invalid = {planner.configs[p.index] for p in step.prunes if p.reason is PruneReason.INVALID}
    kept = set(planner.configs) - set(dominated) - invalid
    runnable = {o for o in SPACE["optimizer"] if optimizers.missing_library(o) is None}
    assert {c.optimizer.value for c in kept if c.checkpoint_every == 0} == runnable


def test_full_and_selective_checkpointing_do_not_dominate_each_other(rates):
    # 180,000 bytes: no config without checkpointing fits, both policies at interval 1 do. Their predicted
    # times are within 0.1% (full "as fast with less memory"), but selective's per-operator cost is not in the
    # time model, so which is faster is for trials and the time margins to say, not for dominance.
    planner = _planner(rates, budget_bytes=180_000)
    step = planner.step([])
    dominated = {planner.configs[p.index] for p in step.prunes if p.reason is PruneReason.DOMINATED}
    both = [c for c in planner.configs if c.optimizer.value == "as-given" and c.checkpoint_every == 1]
    assert {c.checkpoint_policy.value for c in both} == {"full", "selective"}
    assert not dominated & set(both)
    # without checkpointing, a config still dominates both policies where it fits
    roomy = _planner(rates)
    dominated = {roomy.configs[p.index] for p in roomy.step([]).prunes if p.reason is PruneReason.DOMINATED}
    assert set(both) <= dominated


def test_a_missing_library_prunes_its_configs_saying_how_to_install_it(rates, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(optimizers.importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    planner = _planner(rates)
    step = planner.step([])
    invalid = {planner.configs[p.index]: p.text for p in step.prunes if p.reason is PruneReason.INVALID}
    assert set(invalid) == {c for c in planner.configs if c.optimizer.value == "adamw8bit"}
    assert set(invalid.values()) == {"cannot run: optimizer=adamw8bit needs bitsandbytes, which is not installed: "
                                     "pip install 'autofit[optim]'"}


def test_trials_stored_before_the_lean_levers_read_as_configs():
    old = {"precision": "fp32", "micro_batch": 2, "grad_accum": 2, "checkpoint_every": 1, "device_split": 1}
    assert config_of(old) == TrainConfig("fp32", 2, 2, 1)
    assert config_of({**old, "optimizer": "adafactor", "checkpoint_policy": "selective"}) == TrainConfig(
        "fp32", 2, 2, 1, optimizer="adafactor", checkpoint_policy="selective")
    assert config_of({"precision": "fp32"}) is None  # not a config
    dists = distributions(space_from_dict(SPACE))
    assert list(dists["optimizer"].choices) == ["as-given", "adafactor", "adamw8bit"]
    assert list(dists["checkpoint_policy"].choices) == ["full", "selective"]


def test_offload_on_the_cpu_is_pruned_as_invalid_with_its_reason(rates):
    space = space_from_dict({"precision": ["fp32"], "micro_batch": [2, 4], "offload": ["none", "optimizer"]})
    settings = StudySettings(workload_name="tiny-lm", workload_source=TINY_LM, budget_bytes=10**9,
                             budget_text="1GB", space=space_to_dict(space), device_type="cpu", devices=1,
                             study_name="t", out_dir="/nonexistent")
    planner = Planner(settings, profile_workload(load_workload(TINY_LM), ["fp32"]), rates)
    invalid = {planner.configs[p.index]: p.text for p in planner.step([]).prunes if p.reason is PruneReason.INVALID}
    assert set(invalid) == {c for c in planner.configs if c.offload.value == "optimizer"}
    assert all(why.startswith("cannot run: offload=optimizer keeps the optimizer's state on the host: on device cpu")
               for why in invalid.values())
    assert config_of({"precision": "fp32", "micro_batch": 2, "grad_accum": 1, "checkpoint_every": 0,
                      "device_split": 1}).offload.value == "none"  # a trial stored before the lever
    assert distributions(space)["offload"].choices == ("none", "optimizer")
