"""Each technique of autofit.runtime.training against a plain fp32 reference step: the same gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from trial_workloads import mlp_workload

from autofit.core.config import TrainConfig
from autofit.core.errors import WorkloadError
from autofit.runtime.training import (
    apply_config,
    build_trainee,
    forward_backward,
    make_micro_batches,
    optimizer_step,
    train_step,
)
from autofit.workloads.base import Workload

BATCH = 8


def _grads(trainee) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().float().clone() for name, p in trainee.model.named_parameters()}


def _step(workload: Workload, config: TrainConfig, batches=None):
    """One optimizer step; returns (loss, gradients) -- train_step leaves the gradients in place."""
    trainee = build_trainee(workload, config)
    batches = batches if batches is not None else make_micro_batches(workload, config, trainee.device)
    loss = train_step(trainee, batches)
    return loss.item(), _grads(trainee)


def _reference(workload: Workload):
    return _step(workload, TrainConfig(micro_batch=BATCH))


def _assert_close(grads, reference, rtol, atol):
    assert grads.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(grads[name], reference[name], rtol=rtol, atol=atol, msg=name)


def _relative_error(grads, reference) -> float:
    return max(((grads[n] - reference[n]).norm() / reference[n].norm()).item() for n in reference)


def test_accumulation_equals_one_step_over_the_whole_batch():
    workload = mlp_workload()
    ref_loss, ref_grads = _reference(workload)
    inputs, targets = workload.batch(BATCH)  # the same 8 samples, as 4 micro-batches of 2
    micro = [(inputs[i:i + 2], targets[i:i + 2]) for i in range(0, BATCH, 2)]
    loss, grads = _step(workload, TrainConfig(micro_batch=2, grad_accum=4), micro)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    _assert_close(grads, ref_grads, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("every", [1, 2, 3])  # 3 of 4 layers: segments of 3 and 1
def test_checkpointing_equals_reference(every):
    workload = mlp_workload()
    ref_loss, ref_grads = _reference(workload)
    loss, grads = _step(workload, TrainConfig(micro_batch=BATCH, checkpoint_every=every))
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    _assert_close(grads, ref_grads, rtol=1e-5, atol=1e-7)


class ScaledBlock(nn.Module):
    """Takes an extra argument and returns a tuple: ``(x + scale * tanh(fc(x)), scale)``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x, scale):
        return x + scale * torch.tanh(self.fc(x)), scale


class ScaledNet(nn.Module):
    def __init__(self, dim: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ScaledBlock(dim) for _ in range(depth))
        self.head = nn.Linear(dim, 4)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x):
        scale = self.scale
        for layer in self.layers:
            x, scale = layer(x, scale)
        return self.head(x)


def _scaled_workload() -> Workload:
    def model():
        torch.manual_seed(0)
        return ScaledNet()

    def batch(n):
        g = torch.Generator().manual_seed(1)
        return torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)

    return Workload(name="scaled", model=model, batch=batch, loss=F.cross_entropy)


@pytest.mark.parametrize("every", [1, 2])
def test_checkpointing_layers_with_extra_arguments_and_tuple_outputs(every):
    workload = _scaled_workload()
    ref_loss, ref_grads = _reference(workload)
    loss, grads = _step(workload, TrainConfig(micro_batch=BATCH, checkpoint_every=every))
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    _assert_close(grads, ref_grads, rtol=1e-5, atol=1e-7)


class _StateNet(nn.Module):
    """Layers that return ``(output, final state)``, as ``nn.GRU`` does; the model keeps only the output."""

    def __init__(self, dim: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.GRU(dim, dim, batch_first=True) for _ in range(depth))
        self.states: list = []  # weak references to each layer's final state

    def forward(self, x):
        import weakref

        for layer in self.layers:
            x, state = layer(x)
            self.states.append(weakref.ref(state))
        return x.sum()


@pytest.mark.parametrize("every", [1, 2, 4])
def test_checkpointing_keeps_no_layer_output_the_model_let_go(every):
    """A checkpointed segment's other outputs (an RNN's final state) are handed to its pass-through layers and
    then let go: held past the forward, they are memory the user's own training would not hold, and the
    estimate does not count."""
    model = _StateNet()
    apply_config(model, TrainConfig(micro_batch=2, checkpoint_every=every), None, layers=model.layers,
                 make_optimizer=None, scaler=False)
    model(torch.randn(2, 5, 16)).backward()
    assert [ref() for ref in model.states] == [None] * len(model.layers)


@pytest.mark.parametrize("precision", ["amp-bf16", "bf16"])
def test_bfloat16_modes_are_close_to_reference(precision):
    workload = mlp_workload()
    ref_loss, ref_grads = _reference(workload)
    loss, grads = _step(workload, TrainConfig(precision=precision, micro_batch=BATCH))
    if precision == "bf16":  # weights, gradients and optimizer state in bfloat16 too
        trainee = build_trainee(workload, TrainConfig(precision=precision))
        assert all(p.dtype == torch.bfloat16 for p in trainee.model.parameters())
    assert loss == pytest.approx(ref_loss, rel=2e-2)
    assert _relative_error(grads, ref_grads) < 5e-2  # bf16 keeps 8 bits of mantissa: ~0.4% per rounding


def _tiny_workload() -> Workload:
    return mlp_workload(dim=8, depth=2)  # fp16 on this CPU runs ~1000x slower than bf16: keep it tiny


def test_amp_fp16_with_grad_scaler_is_close_to_reference():
    workload = _tiny_workload()
    ref_loss, ref_grads = _reference(workload)
    config = TrainConfig(precision="amp-fp16", micro_batch=BATCH)
    trainee = build_trainee(workload, config)
    assert trainee.scaler is not None
    loss = train_step(trainee, make_micro_batches(workload, config, trainee.device)).item()
    assert trainee.scaler.get_scale() == 2.0**16  # no inf/NaN: the step was taken, gradients unscaled
    assert loss == pytest.approx(ref_loss, rel=1e-2)
    assert _relative_error(_grads(trainee), ref_grads) < 1e-2


def test_grad_scaler_skips_a_step_with_an_inf_gradient():
    workload = _tiny_workload()
    config = TrainConfig(precision="amp-fp16", micro_batch=2)
    trainee = build_trainee(workload, config)
    (inputs, targets), = make_micro_batches(workload, config, trainee.device)
    trainee.optimizer.zero_grad(set_to_none=True)
    forward_backward(trainee, inputs, targets)
    before = {name: p.detach().clone() for name, p in trainee.model.named_parameters()}
    next(trainee.model.parameters()).grad[0, 0] = float("inf")
    optimizer_step(trainee)
    for name, p in trainee.model.named_parameters():
        assert torch.equal(p, before[name]), f"{name} changed in a step that should have been skipped"
    assert trainee.scaler.get_scale() == 2.0**15  # backed off by the default factor 0.5


class _UnchainedNet(nn.Module):
    """The residual add sits between the layers, so layer i+1 does not take layer i's output."""

    def __init__(self, dim: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))
        self.head = nn.Linear(dim, 4)

    def forward(self, x):
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return self.head(x)


def test_checkpointing_a_model_whose_layers_do_not_chain_fails_loudly():
    def model():
        torch.manual_seed(0)
        return _UnchainedNet()

    workload = Workload(name="unchained", model=model, batch=_scaled_workload().batch, loss=F.cross_entropy)
    ref_loss, _ = _reference(workload)
    with pytest.raises(WorkloadError, match="chain"):
        _step(workload, TrainConfig(micro_batch=BATCH, checkpoint_every=2))
    loss, _ = _step(workload, TrainConfig(micro_batch=BATCH, checkpoint_every=1))
    assert loss == pytest.approx(ref_loss, rel=1e-6)


def test_apply_config_applies_in_one_fixed_order_and_logs_each_step(caplog):
    workload = mlp_workload(depth=4)
    model = workload.model()
    config = TrainConfig(precision="amp-fp16", micro_batch=2, checkpoint_every=2)
    with caplog.at_level("DEBUG", logger="autofit.runtime.training"):
        applied = apply_config(model, config, "cpu", layers=workload.layers(model), make_optimizer=workload.optimizer)
    assert [line.split(":")[0] for line in applied.steps] == ["precision amp-fp16", "checkpoint", "optimizer",
                                                             "GradScaler for amp-fp16"]
    assert "autocast to torch.float16 in forward" in applied.steps[0]
    assert applied.steps[1] == "checkpoint: 4 layers in non-reentrant segments of 2"
    assert [r.getMessage() for r in caplog.records] == [f"apply {config.short()}: {line}" for line in applied.steps]
    assert isinstance(applied.scaler, torch.amp.GradScaler)
    assert applied.optimizer.param_groups[0]["params"] == list(model.parameters())


def test_apply_config_casts_before_the_optimizer_is_made():
    # The optimizer must hold the bf16 parameters (its state is made in their dtype).
    workload = mlp_workload()
    model = workload.model()
    applied = apply_config(model, TrainConfig(precision="bf16", micro_batch=2), None, layers=None,
                           make_optimizer=workload.optimizer)
    assert {p.dtype for group in applied.optimizer.param_groups for p in group["params"]} == {torch.bfloat16}
    assert applied.scaler is None and len(applied.steps) == 2


def test_apply_config_refuses_checkpointing_without_layers():
    workload = mlp_workload()
    with pytest.raises(WorkloadError, match="checkpoint_every > 0 needs the model's layer list"):
        apply_config(workload.model(), TrainConfig(micro_batch=2, checkpoint_every=1), None, layers=None,
                     make_optimizer=None)
