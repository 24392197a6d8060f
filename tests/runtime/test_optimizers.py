"""The optimizer lever and selective checkpointing as autofit.runtime applies them to a real training step."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn
from trial_workloads import mlp_workload

from autofit.core.config import TrainConfig
from autofit.core.errors import WorkloadError
from autofit.runtime import optimizers
from autofit.runtime.optimizers import missing_library, refusal, replace_optimizer
from autofit.runtime.tracker import optimizer_state_bytes
from autofit.runtime.training import build_trainee, make_micro_batches, train_step
from autofit.trial.apply import TrainingPlan

needs_bnb = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                               reason="bitsandbytes is not installed (pip install 'autofit[optim]')")
WIDE = 128  # 128 x 128 = 16384 elements: over bitsandbytes' 4096, so its moments are 8-bit


def _groups_model():
    model = nn.Sequential(nn.Linear(WIDE, WIDE), nn.LayerNorm(WIDE))
    decay = [p for p in model.parameters() if p.dim() == 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    return model, [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]


@needs_bnb
@pytest.mark.parametrize("kind,expected", [(torch.optim.AdamW, "AdamW8bit"), (torch.optim.Adam, "Adam8bit")])
def test_adamw8bit_replaces_adam_and_adamw_keeping_groups_and_hyper_parameters(kind, expected):
    model, groups = _groups_model()
    base = kind(groups, lr=3e-4, betas=(0.8, 0.95), eps=1e-6)
    new = replace_optimizer("adamw8bit", base)
    assert type(new).__name__ == expected
    assert [[id(p) for p in g["params"]] for g in new.param_groups] == [[id(p) for p in g["params"]]
                                                                        for g in base.param_groups]
    for g in new.param_groups:
        assert (g["lr"], tuple(g["betas"]), g["eps"]) == (3e-4, (0.8, 0.95), 1e-6)
    assert [g["weight_decay"] for g in new.param_groups] == [0.1, 0.0]


def test_adafactor_keeps_learning_rates_and_weight_decay():
    model, groups = _groups_model()
    new = replace_optimizer("adafactor", torch.optim.AdamW(groups, lr=1e-3))
    assert isinstance(new, torch.optim.Adafactor)
    assert [(g["lr"], g["weight_decay"]) for g in new.param_groups] == [(1e-3, 0.1), (1e-3, 0.0)]
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    assert replace_optimizer("as-given", base) is base


@pytest.mark.parametrize("make,name", [
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), "SGD"),
    (lambda ps: torch.optim.RMSprop(ps), "RMSprop"),
])
def test_an_optimizer_the_lever_cannot_replace_is_refused_in_one_line(make, name):
    model, _ = _groups_model()
    with pytest.raises(WorkloadError, match=f"the workload's optimizer is {name}: optimizer=adafactor would change "
                                            "the training") as err:
        replace_optimizer("adafactor", make(model.parameters()))
    assert "\n" not in str(err.value)
    assert refusal("adamw8bit", "SGD") == ("the workload's optimizer is SGD: optimizer=adamw8bit would change the "
                                           "training (only torch.optim.Adam and torch.optim.AdamW are replaced)")
    assert refusal("adamw8bit", "AdamW") is None and refusal("as-given", "SGD") is None


def test_a_subclass_or_amsgrad_is_not_replaced():
    class MyAdamW(torch.optim.AdamW):
        pass

    model, _ = _groups_model()
    with pytest.raises(WorkloadError, match="optimizer=adafactor would change the training"):
        replace_optimizer("adafactor", MyAdamW(model.parameters()))
    with pytest.raises(WorkloadError, match="amsgrad=True, which optimizer=adafactor does not have"):
        replace_optimizer("adafactor", torch.optim.AdamW(model.parameters(), amsgrad=True))


def test_a_missing_library_says_how_to_install_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(optimizers.importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    assert missing_library("adamw8bit") == ("optimizer=adamw8bit needs bitsandbytes, which is not installed: "
                                            "pip install 'autofit[optim]'")
    assert missing_library("adafactor") is None
    model, _ = _groups_model()
    with pytest.raises(WorkloadError, match=r"pip install 'autofit\[optim\]'"):
        replace_optimizer("adamw8bit", torch.optim.AdamW(model.parameters()))


def _trained(config: TrainConfig, steps: int = 2):
    workload = mlp_workload(name="wide-mlp", dim=WIDE)
    trainee = build_trainee(workload, config)
    batches = make_micro_batches(workload, config, trainee.device)
    losses = [train_step(trainee, batches).item() for _ in range(steps)]
    return trainee, losses


def _layout_bytes(model: nn.Module, choice: str, dtype_bytes: int) -> int:
    """The documented state layouts (autofit.runtime.optimizers), summed by hand over the parameters."""
    total, qmaps = 0, 0
    for p in model.parameters():
        n = p.numel()
        if choice == "adamw8bit":
            if n >= 4096:  # two one-byte moments and an fp32 scale per block of 256 for each; two shared maps
                total += 2 * n + 2 * 4 * -(-n // 256)
                qmaps = 2 * 256 * 4
            else:  # fp32 moments
                total += 2 * 4 * n
        else:  # adafactor: row and column statistics of a matrix, the whole second moment of a vector
            total += (sum(p.shape) if p.dim() == 2 else n) * dtype_bytes + 4  # + its fp32 step count
    return total + qmaps


@pytest.mark.parametrize("precision,dtype_bytes", [("fp32", 4), ("bf16", 2)])
@pytest.mark.parametrize("choice", ["adafactor", pytest.param("adamw8bit", marks=needs_bnb)])
def test_the_lever_trains_and_its_state_has_the_documented_layout(choice, precision, dtype_bytes):
    trainee, losses = _trained(TrainConfig(precision=precision, micro_batch=4, optimizer=choice))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert optimizer_state_bytes(trainee.optimizer) == _layout_bytes(trainee.model, choice, dtype_bytes)
    adamw, _ = _trained(TrainConfig(precision=precision, micro_batch=4))
    # AdamW keeps 8 bytes per fp32 element (4 in bf16); bitsandbytes about 2 (its small tensors: 8), Adafactor far less
    assert optimizer_state_bytes(trainee.optimizer) < optimizer_state_bytes(adamw.optimizer) / (3 if dtype_bytes == 4
                                                                                                 else 1.5)


def test_training_plan_replaces_the_users_optimizer():
    model = nn.Sequential(nn.Linear(WIDE, WIDE))
    plan = TrainingPlan(TrainConfig(micro_batch=2, optimizer="adafactor"))
    mine = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with plan.run(model, mine) as run:
        assert isinstance(run.optimizer, torch.optim.Adafactor)
        run.train_step(torch.randn(2, WIDE), lambda m, x: m(x).pow(2).mean())
    assert len(run.optimizer.state) == 2 and not mine.state


@pytest.mark.parametrize("every", [1, 2, 3])
def test_selective_checkpointing_gives_the_reference_gradients(every):
    workload = mlp_workload()
    config = TrainConfig(micro_batch=8, checkpoint_every=every)
    grads = {}
    for policy in ("full", "selective"):
        torch.manual_seed(0)
        trainee = build_trainee(workload, TrainConfig(micro_batch=8, checkpoint_every=every, checkpoint_policy=policy))
        train_step(trainee, make_micro_batches(workload, config, trainee.device))
        grads[policy] = {n: p.grad.clone() for n, p in trainee.model.named_parameters()}
    reference = build_trainee(workload, TrainConfig(micro_batch=8))
    train_step(reference, make_micro_batches(workload, config, reference.device))
    for name, p in reference.model.named_parameters():
        torch.testing.assert_close(grads["selective"][name], p.grad, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(grads["full"][name], p.grad, rtol=1e-5, atol=1e-7)
