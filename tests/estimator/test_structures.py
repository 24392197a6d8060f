"""Layer structures a new user writes by hand, and frozen parameters: estimated right, not refused.

- an MLP whose first repeated block takes the raw input (no stem: the first layer's input
  needs no gradient, so backward ends inside it);
- weight sharing, ``nn.ModuleList([block] * 4)``: one module applied four times (its weights
  counted once; ``checkpoint_every=2`` segments of the same module);
- frozen parameters (``requires_grad=False``): no gradient and no optimizer state.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autofit import TrainConfig, Workload
from autofit.core.errors import ConfigError
from autofit.estimator.memory_model import estimate
from autofit.profiling.profile import profile_workload
from autofit.trial.measure import measure_trial

WIDTH = 128


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return torch.relu(self.fc(x)) + x


class NoStem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(WIDTH, 10)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList([Block()] * 4)
        self.head = nn.Linear(WIDTH, 10)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class FrozenStem(Shared):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.stem.requires_grad_(False)
        self.blocks[0].requires_grad_(False)


def _batch(n):
    return torch.randn(n, WIDTH), torch.randint(0, 10, (n,))


def _workload(name, cls):
    return Workload(name=name, model=cls, batch=_batch, loss=F.cross_entropy)


def _error(workload, text):
    config = TrainConfig.parse(text)
    predicted = estimate(profile_workload(workload, [config.precision], use_cache=False), config).peak_bytes
    measured = measure_trial(workload, config, measure_steps=1)
    assert measured["status"] == "ok", measured["error"]
    return (predicted - measured["peak_bytes"]) / measured["peak_bytes"]


@pytest.mark.parametrize("config", ["precision=fp32,micro_batch=64", "precision=fp32,micro_batch=64,checkpoint_every=2",
                                    "precision=bf16,micro_batch=32,grad_accum=2,checkpoint_every=1"])
def test_first_block_fed_the_raw_input(config):
    assert abs(_error(_workload("mlp-no-stem", NoStem), config)) <= 0.02


# Known residuals, within the 8% bound but not 2%: at micro_batch 64 with checkpointing the shared
# block's estimate is 4.4% low (its weight-gradient temporaries set the peak; from 128 samples on
# it is within 0.1%); under autocast each checkpointed segment's recomputation casts the shared
# weights again, which the profile saw only at the block's first use (3.2% low).
@pytest.mark.parametrize("config", ["precision=fp32,micro_batch=64", "precision=fp32,micro_batch=256,checkpoint_every=2",
                                    "precision=amp-bf16,micro_batch=256,checkpoint_every=2",
                                    "precision=fp32,micro_batch=64,checkpoint_every=1"])
def test_one_block_applied_four_times(config):
    bound = 0.02 if config.startswith("precision=fp32") and "micro_batch=256" in config or "every" not in config else 0.08
    assert abs(_error(_workload("mlp-shared", Shared), config)) <= bound


def test_shared_weights_count_once():
    profile = profile_workload(_workload("mlp-shared", Shared), ["fp32"], use_cache=False)
    pp = profile.for_precision("fp32")
    block_bytes = 4 * (WIDTH * WIDTH + WIDTH)
    assert [layer.param_bytes for layer in pp.layers] == [block_bytes, 0, 0, 0]
    assert pp.static_param_bytes == 4 * profile.param_count == 4 * (2 * (WIDTH * WIDTH + WIDTH) + WIDTH * 10 + 10)


def test_frozen_parameters_have_no_gradient_or_optimizer_state():
    workload = _workload("mlp-frozen", FrozenStem)
    pp = profile_workload(workload, ["fp32"], use_cache=False).for_precision("fp32")
    model = FrozenStem()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert pp.grad_bytes == 4 * trainable < pp.static_param_bytes
    assert pp.optimizer_bytes == 8 * trainable + 4 * sum(p.requires_grad for p in model.parameters())  # + AdamW steps
    assert abs(_error(workload, "precision=fp32,micro_batch=64,checkpoint_every=2")) <= 0.02


class FrozenPrefix(Shared):
    """A fine-tune that freezes its first blocks: their inputs need no gradient, so nothing keeps
    a frozen block's input once the next block has it (the model frees it between the layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(6))
        self.stem.requires_grad_(False)
        for block in self.blocks[:4]:
            block.requires_grad_(False)


@pytest.mark.parametrize("config", ["precision=fp32,micro_batch=256", "precision=amp-bf16,micro_batch=256"])
def test_frozen_prefix_frees_inputs_between_layers(config):
    assert abs(_error(_workload("mlp-frozen-prefix", FrozenPrefix), config)) <= 0.02


def test_an_optimizer_over_some_parameters_only():
    """A factory may pick what it optimizes (only matrices, as for Muon): autofit hands it the model's
    own parameters, never a stand-in it would filter down to nothing."""
    workload = Workload(name="mlp-matrices-only", model=NoStem, batch=_batch, loss=F.cross_entropy,
                        optimizer=lambda ps: torch.optim.SGD([p for p in ps if p.dim() == 2], lr=0.1, momentum=0.9))
    profile = profile_workload(workload, ["fp32"], use_cache=False)
    assert profile.optimizer == "SGD"
    assert profile.for_precision("fp32").optimizer_bytes == 4 * (4 * WIDTH * WIDTH + 10 * WIDTH)  # momentum of the matrices


class Unsaved(nn.Module):
    """A block whose backward keeps nothing of its input (``x * 0.5``; relu keeps its output)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x * 0.5 + self.fc(torch.relu(x))


class UnsavedInputs(Shared):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Unsaved() for _ in range(4))


@pytest.mark.parametrize("config", ["precision=fp32,micro_batch=256", "precision=fp32,micro_batch=256,checkpoint_every=4"])
def test_inputs_no_backward_keeps_are_freed_between_layers_but_not_a_segments_own(config):
    # the whole model checkpointed in one segment: its recomputation frees what the layers after
    # the first free, never the segment's input (measured exact)
    assert abs(_error(_workload("mlp-unsaved-inputs", UnsavedInputs), config)) <= 0.02


class DictInputs(NoStem):
    """Inputs as a dict, as a Hugging Face model takes them (``{"input_ids": ..., "labels": ...}``)."""

    def forward(self, batch):
        return super().forward(batch["x"] * batch["scale"])


def _dict_batch(n):
    return {"x": torch.randn(n, WIDTH), "scale": torch.ones(n, 1)}, torch.randint(0, 10, (n,))


def test_inputs_nested_in_a_dict_are_profiled_fake():
    workload = Workload(name="mlp-dict-inputs", model=DictInputs, batch=_dict_batch, loss=F.cross_entropy)
    assert abs(_error(workload, "precision=fp32,micro_batch=64")) <= 0.02


def test_a_pipeline_split_of_inputs_not_one_tensor_is_refused_before_any_trial():
    # the traced pipeline stages take tensors only: the trial failed with PipeliningMetadataError
    workload = Workload(name="mlp-dict-inputs", model=DictInputs, batch=_dict_batch, loss=F.cross_entropy)
    profile = profile_workload(workload, ["fp32"], use_cache=False)
    with pytest.raises(ConfigError, match="one tensor.*dict.*split_mode=fsdp"):
        estimate(profile, TrainConfig.parse("micro_batch=8,device_split=2"))
    assert estimate(profile, TrainConfig.parse("micro_batch=8,device_split=2,split_mode=fsdp")).peak_bytes > 0
    assert profile_workload(_workload("mlp-no-stem", NoStem), ["fp32"], use_cache=False).split_refusal is None


class ClonedLayers(nn.Module):
    """``nn.TransformerEncoder`` deep-copies its layer (``_get_clones``), as ``nn.Transformer`` does."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.encoder(x).mean(1))


def _sequence_batch(n):
    return torch.randn(n, 8, 32), torch.randint(0, 10, (n,))


def test_layers_deep_copied_under_fake_tensors_are_distinct_weights():
    workload = Workload(name="encoder-clones", model=ClonedLayers, batch=_sequence_batch, loss=F.cross_entropy)
    profile = profile_workload(workload, ["fp32"], use_cache=False)
    assert profile.param_count == sum(p.numel() for p in ClonedLayers().parameters())  # the clones are not tied
    assert abs(_error(workload, "precision=fp32,micro_batch=16")) <= 0.02


# Short segments: each keeps its input until its backward is done (then frees it, though no
# layer saved it), its recomputation stops at the last tensor saved, before the output, and its
# first forward keeps nothing it saves (relu(x) dies inside the block). Before: +6.2% (every 1),
# +16.3% (every 2), +8.4% and +9.6% (amp-bf16, every 1 and 2); -2.0% (every 1 with accumulation,
# the last layer's input freed too early); now all measured exact.
@pytest.mark.parametrize("config", ["precision=fp32,micro_batch=256,checkpoint_every=1",
                                    "precision=fp32,micro_batch=256,checkpoint_every=2",
                                    "precision=amp-bf16,micro_batch=256,checkpoint_every=1",
                                    "precision=amp-bf16,micro_batch=256,checkpoint_every=2",
                                    "precision=fp32,micro_batch=64,grad_accum=2,checkpoint_every=1"])
def test_short_segments_free_inputs_no_backward_keeps(config):
    assert -0.01 <= _error(_workload("mlp-unsaved-inputs", UnsavedInputs), config) <= 0.01
