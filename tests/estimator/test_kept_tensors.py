"""Tensors a step keeps beyond autograd, in models written as users write them (tests/cache_workloads.py):
a key/value cache a transformers model returns with its default use_cache=True, a forward hook's stash, a
buffer replaced in forward. Each is estimated against a real measured step (fp32, micro-batch 2, CPU)."""

from __future__ import annotations

import pytest

from autofit.core.config import TrainConfig
from autofit.core.errors import ConfigError
from autofit.estimator.memory_model import estimate
from autofit.estimator.memory_table import estimate_table
from autofit.profiling.profile import profile_workload
from autofit.trial.measure import measure_trial
from autofit.workloads.load import load_workload

transformers = pytest.importorskip("transformers")

SPEC = "tests/cache_workloads.py:"


def _estimated_and_measured(name: str, every: int) -> tuple[int, int]:
    workload = load_workload(SPEC + name)
    config = TrainConfig("fp32", 2, 1, every, 1)
    profile = profile_workload(workload, ["fp32"], use_cache=False, split_ends=False)
    measured = measure_trial(workload, config, warmup_steps=2, measure_steps=1)
    assert measured["status"] == "ok", measured["error"]
    return estimate(profile, config).peak_bytes, measured["peak_bytes"]


@pytest.mark.parametrize("every", [0, 1, 2])
@pytest.mark.parametrize("name", ["hooked_mlp", "running_mlp"])
def test_a_stash_kept_from_step_to_step_is_counted(name, every, one_thread):
    predicted, measured = _estimated_and_measured(name, every)
    assert measured <= predicted <= measured * 1.03


@pytest.mark.parametrize("name", ["llama_lm", "gpt2_lm"])
def test_a_cache_without_checkpointing_is_exact(name, one_thread):
    predicted, measured = _estimated_and_measured(name, 0)
    # the step's detached loss (4 bytes) is not counted (autofit/estimator/memory_model.py says so)
    assert measured - 4 <= predicted <= measured * 1.01


@pytest.mark.parametrize("every", [1, 2])
@pytest.mark.parametrize("name", ["llama_lm", "gpt2_lm"])
def test_a_cache_with_checkpointing_is_refused_not_under_estimated(name, every):
    # the recomputation appends to the cache the forward filled and joins the first forward's graph to
    # the backward (measured 2.5-6.7% over the regions' estimate): invalid, naming the fix, never a false fit
    profile = profile_workload(load_workload(SPEC + name), ["fp32"], use_cache=False, split_ends=False)
    row = estimate_table(profile, [TrainConfig("fp32", 2, 1, every, 1)]).iloc[0]
    assert not row.valid and "use_cache=False" in row.reason and row.fits is not True
    assert estimate_table(profile, [TrainConfig("fp32", 2, 1, 0, 1)]).iloc[0].valid


def test_the_profile_sees_what_is_kept_and_says_so(caplog):
    llama = profile_workload(load_workload(SPEC + "llama_lm"), ["fp32"], use_cache=False, split_ends=False)
    layers = llama.for_precision("fp32").layers
    # the layer's keys and values (each one hidden state: 4 heads of 16) beside its own output
    assert all(layer.retained[1] == 2 * layer.output[1] > 0 for layer in layers)
    assert llama.for_precision("fp32").kept_bytes == (0.0, 0.0)  # dropped with the step's output
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("set use_cache=False" in line for line in warned), warned
    note = estimate(llama, TrainConfig("fp32", 2, 1, 0, 1)).notes
    assert any("use_cache=False" in line for line in note)
    with pytest.raises(ConfigError, match="use_cache=False"):  # checkpointed: refused
        estimate(llama, TrainConfig("fp32", 2, 1, 1, 1))
    hooked = profile_workload(load_workload(SPEC + "hooked_mlp"), ["fp32"], use_cache=False, split_ends=False)
    pp = hooked.for_precision("fp32")
    assert pp.kept_bytes[1] == sum(layer.output[1] for layer in pp.layers) > 0  # each block's output, stashed
    assert all(layer.retained == (0.0, 0.0) for layer in pp.layers)  # replaced, not grown
