"""MemoryTracker against hand-computed bytes (fp32: 4 bytes a value)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autofit.runtime.tracker import (
    CATEGORIES,
    MemoryTracker,
    _BudgetExceeded,
    optimizer_state_bytes,
)


def _adamw_step(model, optimizer, x, loss_fn):
    optimizer.zero_grad(set_to_none=True)
    loss_fn(model(x)).backward()
    optimizer.step()


class _OffloadWrapper:
    """What a trial's breakdown sees of torchao's CPUOffloadOptimizer: no ``state``, the device's optimizer
    of the small parameters as ``d_opt`` (None when every parameter went to the host)."""

    def __init__(self, d_opt):
        self.d_opt = d_opt


def test_optimizer_state_bytes_of_an_offload_wrapper_counts_its_device_optimizer_only():
    small = nn.Linear(4, 2)  # 10 values: exp_avg and exp_avg_sq of 40 B each, and a 4 B step per tensor
    d_opt = torch.optim.AdamW(small.parameters())
    small(torch.randn(1, 4)).sum().backward()
    d_opt.step()
    assert optimizer_state_bytes(_OffloadWrapper(d_opt)) == optimizer_state_bytes(d_opt) == 2 * 40 + 2 * 4
    assert optimizer_state_bytes(_OffloadWrapper(None)) == 0


def test_linear_adamw_peak_breakdown_by_hand():
    torch.manual_seed(0)
    model = nn.Linear(64, 32)  # W: 32*64*4 = 8192 B, b: 32*4 = 128 B
    optimizer = torch.optim.AdamW(model.parameters())  # CPU: the single-tensor (for-loop) implementation
    x = torch.randn(8, 64)
    loss_fn = lambda out: out.pow(2).mean()  # noqa: E731
    with MemoryTracker(model, optimizer, inputs=[x]) as tracker:
        for _ in range(2):  # warm-up: optimizer state exists afterwards
            _adamw_step(model, optimizer, x, loss_fn)
        tracker.reset_peak()
        for _ in range(2):
            _adamw_step(model, optimizer, x, loss_fn)
    params = 8192 + 128
    breakdown = tracker.peak_breakdown()
    assert set(breakdown) == set(CATEGORIES)
    assert breakdown["params_bytes"] == params
    assert breakdown["grads_bytes"] == params
    # exp_avg + exp_avg_sq per parameter, plus a float32 ``step`` scalar per parameter tensor.
    assert breakdown["optimizer_bytes"] == 2 * params + 2 * 4 == optimizer_state_bytes(optimizer)
    # The peak is W's update: denom = exp_avg_sq.sqrt() / bias_correction2_sqrt holds two W-sized
    # transients at once; the activations (1 KiB) are gone by then.
    assert breakdown["temporary_bytes"] == 2 * 8192
    assert breakdown["activations_bytes"] == 0
    assert breakdown["overhead_bytes"] == 0  # the input batch is the data loader's, never counted
    assert tracker.peak_bytes == sum(breakdown.values()) == 4 * params + 8 + 2 * 8192


def test_known_activations_at_the_forward_peak():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 1024, bias=False), nn.ReLU())  # W: 16*1024*4 = 64 KiB
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(64, 16)
    loss_fn = lambda out: out.sum()  # noqa: E731 -- saves nothing for backward
    for _ in range(2):
        _adamw_step(model, optimizer, x, loss_fn)
    act = 64 * 1024 * 4  # one (64, 1024) fp32 tensor: 256 KiB
    with MemoryTracker(model, optimizer, inputs=[x]) as tracker:
        tracker.reset_peak()
        out = model(x)  # the Linear output is freed once ReLU has run; ReLU saves its output
        assert tracker.live_breakdown()["activations_bytes"] == act
        del out
        tracker.step_boundary()
        tracker.reset_peak()
        _adamw_step(model, optimizer, x, loss_fn)
    # Forward holds the Linear output and ReLU's output at once: 2 * act. Backward holds ReLU's
    # saved output with its input gradient (threshold_backward), also 2 * act, plus the loss and
    # its seed gradient (4 B each, both made outside backward): 8 B more, so the peak is there.
    # No parameter gradient exists yet (zero_grad set them to None).
    assert tracker.peak_breakdown() == {
        "params_bytes": 64 * 1024, "grads_bytes": 0, "optimizer_bytes": 2 * 64 * 1024 + 4,
        "activations_bytes": act + 8, "temporary_bytes": act, "overhead_bytes": 0,
    }


def test_views_of_inputs_are_not_counted_and_leftovers_are_overhead():
    class Flatten(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(64, 4)
            self.cache = None

        def forward(self, x):  # x: (B, 8, 8), a view of the data loader's batch is made here
            self.cache = torch.ones(100)  # 400 B kept from one step to the next
            return self.fc(x.view(x.shape[0], 64))

    model = Flatten()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # no state
    x = torch.randn(256, 8, 8)  # 64 KiB, larger than everything else
    with MemoryTracker(model, optimizer, inputs=[x]) as tracker:
        for _ in range(2):
            _adamw_step(model, optimizer, x, lambda out: out.sum())
        tracker.reset_peak()
        assert tracker.live_breakdown()["overhead_bytes"] == 400
        _adamw_step(model, optimizer, x, lambda out: out.sum())
    breakdown = tracker.peak_breakdown()
    assert tracker.input_bytes == 256 * 64 * 4
    assert tracker.peak_bytes < 64 * 256  # nothing input-sized counted
    assert breakdown["optimizer_bytes"] == 0


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_budget_exceeded_raises_inside_the_step(where):
    model = nn.Sequential(nn.Linear(16, 1024, bias=False), nn.ReLU())
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(64, 16)
    params, act = 64 * 1024, 64 * 1024 * 4
    # The first forward peaks at params + 2 activations (ReLU's input and output); its backward
    # holds more (pow's and ReLU's gradients). A budget just above the forward peak stops backward.
    budget = params + 1024 if where == "forward" else params + 2 * act + 4096
    tracker = MemoryTracker(model, optimizer, inputs=[x], budget_bytes=budget)
    with pytest.raises(_BudgetExceeded) as excinfo, tracker:
        for _ in range(3):
            _adamw_step(model, optimizer, x, lambda out: out.pow(2).sum())
    assert tracker.exceeded_bytes is not None and tracker.exceeded_bytes > budget
    in_backward = any(entry.name == "backward" for entry in excinfo.traceback)
    assert in_backward == (where == "backward")


class LossModuleInForward(nn.Module):
    """Builds a loss module inside forward (as transformers' T5 does): gone before backward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return nn.CrossEntropyLoss()(self.fc(x), torch.zeros(len(x), dtype=torch.long))


def test_a_module_gone_before_backward_raises_no_warning():
    import warnings

    model = LossModuleInForward()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with MemoryTracker(model, optimizer, inputs=[x]) as tracker:
            _adamw_step(model, optimizer, x, lambda loss: loss)
        warnings.warn("after the tracker", UserWarning)  # the tracker's filter ends with it
    assert [str(w.message) for w in caught] == ["after the tracker"]
    assert tracker.peak_bytes > 0
