"""What autofit says when nothing fits: one test per kind of answer, on a small GPT whose
activations matter at micro_batch 1 (seq_len 512), from its real fake-tensor profile."""

from __future__ import annotations

import pytest

from autofit.core.budget import parse_budget
from autofit.core.config import Precision, TrainConfig
from autofit.estimator.advice import advise_workload
from autofit.estimator.memory_model import estimate
from autofit.profiling.profile import profile_workload
from autofit.workloads.load import load_workload

MODEL = "gpt-tiny+seq_len=512"


@pytest.fixture(scope="module")
def profile():
    return profile_workload(load_workload(MODEL), list(Precision), device_type="cpu")


def _peak(profile, text: str) -> int:
    return estimate(profile, TrainConfig.parse(text)).peak_bytes


def test_checkpoint_interval_answer(profile):
    # fp32 fits one device only with checkpointing: the advice names the interval
    budget = _peak(profile, "precision=fp32,checkpoint_every=1") + 2**20
    assert _peak(profile, "precision=fp32") > budget
    lines = advise_workload(MODEL, budget).lines
    assert "fits on one device: fp32 with checkpoint_every=1 at micro_batch=1" in "\n".join(lines)


def test_precision_answer(profile):
    # no fp32 or autocast config fits one device, pure bf16 does: the advice names the precision
    budget = _peak(profile, "precision=bf16") + 2**20
    assert min(_peak(profile, f"precision={p},checkpoint_every={k}") for p in ("fp32", "amp-bf16", "amp-fp16")
               for k in (0, 1, 2, 4)) > budget
    text = "\n".join(advise_workload(MODEL, budget).lines)
    assert "fits on one device: bf16 with checkpoint_every=0" in text
    assert "fits on one device: fp32" not in text and "fits on one device: amp-bf16" not in text
    assert "at fp32: " in text and "at amp-bf16: " in text  # every precision the advice rules out is named


def test_fewest_devices_answer(profile):
    # nothing fits one device at any precision; two pipeline stages of bf16 do
    budget = _peak(profile, "precision=bf16,checkpoint_every=1,device_split=2") + 2**20
    assert _peak(profile, "precision=bf16,checkpoint_every=2") > budget
    advice = advise_workload(MODEL, budget)
    text = "\n".join(advice.lines)
    assert "no single-device configuration fits" in text and "fewest devices: 2 x bf16" in text
    assert advice.smallest_fit.device_split == 2


def test_model_state_alone_answer():
    advice = advise_workload(MODEL, parse_budget("5MB"))
    text = "\n".join(advice.lines)
    assert "fp32: weights + gradients + optimizer state alone are" in text
    assert "nothing fits even split across 4 devices: use a smaller model or a larger budget" in text
    assert advice.smallest_fit is None


def test_lean_levers_answer_names_the_lever(profile):
    # nothing fits one device with the workload's own AdamW; with Adafactor's factored state bf16 does, and the
    # advice says which lever it takes
    from autofit.estimator.advice import advise

    lean = profile_workload(load_workload(MODEL), list(Precision), device_type="cpu", optimizers=["adafactor"])
    budget = _peak(lean, "precision=bf16,checkpoint_every=1,optimizer=adafactor") + 2**20
    assert _peak(lean, "precision=bf16,checkpoint_every=1") > budget
    plain = "\n".join(advise(lean, budget, [Precision.BF16]).lines)
    assert "no single-device configuration fits" in plain and "the lean space (--space lean)" in plain
    text = "\n".join(advise(lean, budget, [Precision.BF16], ["as-given", "adafactor"], ["full", "selective"]).lines)
    assert "fits on one device: bf16 with adafactor + checkpoint_every=" in text
    assert "the lean space" not in text
