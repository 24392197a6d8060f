"""Hand-computed golden values for the memory model on a toy model, independent of any real run.

The toy: a stem ``Linear(D_IN, H)``, ``L`` layers ``Linear(H, H)`` (the blocks autofit
checkpoints), a head ``Linear(H, D_OUT)``; loss ``mean((out - y)**2)``; AdamW. Every expected
byte below is written out from the shapes: which tensors exist, which ones autograd saves, and
which temporaries one operator's backward makes, in the order PyTorch 2.13 runs them on the CPU
(live tensor storages, the quantity autofit measures; the micro-batch itself is the data
loader's and not counted on the CPU). The estimate is fitted from profiles at micro-batches 2
and 4; the golden values are at 64, where the peak sits in a different operator than at 2 or 4.
"""

import pytest
import torch
from torch import nn

from autofit.core.config import Precision, TrainConfig
from autofit.estimator.memory_model import estimate
from autofit.profiling.profile import profile_workload
from autofit.workloads.base import Workload

D_IN, H, D_OUT, L = 12, 16, 4, 3
FP32, BF16 = 4, 2          # bytes per element
SCALAR = 4                 # a 0-dim fp32 tensor (a loss, autograd's seed gradient, AdamW's `step`)


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(D_IN, H)
        self.layers = nn.ModuleList(nn.Linear(H, H) for _ in range(L))
        self.head = nn.Linear(H, D_OUT)

    def forward(self, x):
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _batch(n):
    return torch.randn(n, D_IN), torch.randn(n, D_OUT)


def _loss(out, y):
    return (out - y).square().mean()


TOY = Workload(name="golden-linear-stack", model=Stack, batch=_batch, loss=_loss,
               optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3), layers=lambda m: m.layers)


def linear_bytes(n_in: int, n_out: int, itemsize: int) -> int:
    """A Linear's weight (n_out x n_in) plus bias (n_out)."""
    return (n_in * n_out + n_out) * itemsize


# Model states: fp32 weights in both precisions (autocast keeps them fp32).
WEIGHTS = linear_bytes(D_IN, H, FP32) + L * linear_bytes(H, H, FP32) + linear_bytes(H, D_OUT, FP32)  # 4,368
GRADS = WEIGHTS                                    # one fp32 gradient per parameter
N_TENSORS = 2 * (L + 2)                            # a weight and a bias per Linear
ADAM = 2 * WEIGHTS + N_TENSORS * SCALAR            # exp_avg + exp_avg_sq, and a 0-dim fp32 `step` per tensor
STATIC = WEIGHTS + ADAM


def held_after_forward(precision: str, every: int, b: int) -> int:
    """Activations alive when the forward ends (what the backward needs, plus the loop's references)."""
    loss_scalars = 2 * SCALAR                   # the loss and loss / grad_accum
    diff = b * D_OUT * FP32                     # out - y (fp32: y is fp32), saved by square()
    head_out = b * D_OUT * (FP32 if precision == "fp32" else BF16)  # referenced until the micro-step ends
    if precision == "fp32":
        # Each Linear saves its input (its weight is a parameter, not new memory): the stem's
        # output and every layer's output, L + 1 tensors of b x H. Checkpointing a Linear
        # saves nothing more than its segment input, the same tensor: `every` changes nothing.
        return (L + 1) * b * H * FP32 + head_out + diff + loss_scalars
    # autocast bf16: each Linear casts its input, weight and bias to bf16. The stem's input
    # cast is saved (for the weight's gradient); its weight copy is not (the batch needs no
    # gradient) and goes when autocast exits, as do all bias copies. A layer saves its bf16
    # weight copy (for its input's gradient) and its bf16 input (the previous output).
    stem = b * D_IN * BF16 + b * H * BF16
    layer_weight_copies = 0 if every else L * H * H * BF16  # checkpointed: freed with the cache
    layers = L * b * H * BF16 + layer_weight_copies
    head_weight_copy = H * D_OUT * BF16
    return stem + layers + head_weight_copy + head_out + diff + loss_scalars


def moments(precision: str, every: int, b: int, later: bool, accum: int) -> dict[str, tuple[int, int, int]]:
    """Candidate peaks of one micro-step as (peak, gradients there, activations at the region's start).

    ``later``: an accumulation micro-step after the first (the last: ``accum - 1`` before it), when
    every gradient already exists and new ones are temporaries added in place.
    """
    # the training loop keeps each micro-step's (detached) loss until the step returns their mean
    held = held_after_forward(precision, every, b) + ((accum - 1) * SCALAR if later else 0)
    seed = SCALAR                                  # backward()'s ones_like seed, held by its caller
    diff = b * D_OUT * FP32
    grads_before = GRADS if later else 0
    head_grads = linear_bytes(H, D_OUT, FP32)
    layer_grads = linear_bytes(H, H, FP32)
    out = {}
    # (a) the loss's backward: mean's gradient (b x D_OUT, fp32), then square's: diff**1,
    # 2 * that, and grad * that: four fp32 b x D_OUT tensors alive together. The model counts
    # the gradients its region makes (the head's) as alive at the region's peak, an upper bound.
    out["loss backward"] = (STATIC + grads_before + held + seed + 4 * diff,
                            GRADS if later else head_grads, held)
    if precision == "fp32":
        # (b) the head's backward: diff is freed; the gradient of the head's output (b x D_OUT),
        # of its input (b x H) and the head's own gradients (new, or temporaries if later).
        out["head backward"] = (STATIC + grads_before + held - diff + seed + diff + b * H * FP32 + head_grads,
                                GRADS if later else head_grads, held)
        # (c) the last layer's backward: the head freed its saved input (b x H); the incoming
        # gradient (b x H), the input's gradient (b x H) and the layer's weight and bias gradients.
        start = held - diff - b * H * FP32 + seed + b * H * FP32
        out["last layer backward"] = (STATIC + (GRADS if later else head_grads) + start + b * H * FP32 + layer_grads,
                                      GRADS if later else head_grads + layer_grads, start)
    # (d) AdamW's step, one tensor at a time: sqrt(exp_avg_sq) and its quotient for the largest
    # tensor (an H x H weight), while the previous tensor's `denom` (a bias, H) is still bound.
    out["optimizer"] = (STATIC + GRADS + 2 * H * H * FP32 + H * FP32 + accum * SCALAR, GRADS, 0)
    return out


def expected(precision: str, every: int, accum: int, b: int) -> tuple[int, int, int]:
    candidates = dict(moments(precision, every, b, later=False, accum=accum))
    if accum > 1:
        candidates.update({f"later {k}": v for k, v in moments(precision, every, b, later=True, accum=accum).items()})
    return max(candidates.values())


@pytest.fixture(scope="module")
def toy_profile():
    return profile_workload(TOY, [Precision.FP32, Precision.AMP_BF16])


def test_model_states_are_exact(toy_profile):
    assert WEIGHTS == 4368 and ADAM == 8776  # the arithmetic above, spelled out once
    for precision in ("fp32", "amp-bf16"):
        est = estimate(toy_profile, TrainConfig(precision, 64))
        assert est.params_bytes == WEIGHTS
        assert est.optimizer_bytes == ADAM
        assert est.model_state_bytes == WEIGHTS + GRADS + ADAM
        assert est.param_count == WEIGHTS // FP32


@pytest.mark.parametrize("precision", ["fp32", "amp-bf16"])
def test_each_layer_saves_what_the_shapes_say(toy_profile, precision):
    """Per layer, per sample: its output (the next one's saved input); per layer, fixed: its
    saved bf16 weight copy and the bias copy the autocast cache holds until the forward ends."""
    pp = toy_profile.for_precision(precision)
    itemsize = FP32 if precision == "fp32" else BF16
    fixed = 0 if precision == "fp32" else linear_bytes(H, H, BF16)
    for layer in pp.layers:
        assert layer.output == (0.0, H * itemsize)
        assert layer.forward.delta == (fixed, H * itemsize)
        assert layer.param_bytes == linear_bytes(H, H, FP32) == layer.grad_bytes


@pytest.mark.parametrize("precision", ["fp32", "amp-bf16"])
@pytest.mark.parametrize("every", [0, 1])
@pytest.mark.parametrize("accum", [1, 2])
def test_peak_and_breakdown_match_hand_arithmetic(toy_profile, precision, every, accum):
    b = 64
    peak, grads, activations = expected(precision, every, accum, b)
    est = estimate(toy_profile, TrainConfig(precision, b, accum, every))
    assert est.peak_bytes == peak
    assert est.grads_bytes == grads
    assert est.activations_bytes == activations
    assert est.temporary_bytes == peak - WEIGHTS - ADAM - grads - activations


def test_checkpointing_a_linear_stack_saves_only_autocast_weight_copies(toy_profile):
    for accum in (1, 2):
        fp32 = [estimate(toy_profile, TrainConfig("fp32", 64, accum, every)).peak_bytes for every in (0, 1)]
        amp = [estimate(toy_profile, TrainConfig("amp-bf16", 64, accum, every)).peak_bytes for every in (0, 1)]
        assert fp32[0] == fp32[1]
        assert amp[0] - amp[1] == L * H * H * BF16


def test_small_batch_peaks_in_the_optimizer_step(toy_profile):
    peak, _, _ = expected("fp32", 0, 1, 1)
    est = estimate(toy_profile, TrainConfig("fp32", 1))
    assert est.peak_phase == "optimizer"
    assert est.peak_bytes == peak == STATIC + GRADS + 2 * H * H * FP32 + H * FP32 + SCALAR  # and the loss


@pytest.mark.parametrize("config", ["precision=amp-fp16,micro_batch=8,grad_accum=2", "precision=amp-fp16,micro_batch=1",
                                    "precision=fp32,micro_batch=1,grad_accum=3"])
def test_the_steps_scalars_are_counted_to_the_byte(config):
    # Beside the profiled micro-step, the training loop keeps each micro-batch's loss until the step
    # returns their mean, and amp-fp16's GradScaler keeps its scale and growth tracker (and, through
    # the optimizer step, its inf check): 4 bytes each here; left out, the estimate was 12-16 bytes
    # under the measured peak.
    from autofit.trial.measure import measure_trial

    config = TrainConfig.parse(config)
    predicted = estimate(profile_workload(TOY, [config.precision], use_cache=False), config)
    measured = measure_trial(TOY, config, device="cpu", warmup_steps=1, measure_steps=2)
    assert measured["status"] == "ok", measured["error"]
    assert predicted.peak_bytes == measured["peak_bytes"]
