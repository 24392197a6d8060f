"""The offload lever's runtime: torchao's CPUOffloadOptimizer around the optimizer a config trains with."""

from __future__ import annotations

import pytest
import torch

from autofit.core.config import TrainConfig
from autofit.core.errors import WorkloadError
from autofit.runtime.offload import offload_optimizer
from autofit.trial.apply import TrainingPlan

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="offload=optimizer needs CUDA")


def test_an_optimizer_it_does_not_wrap_is_refused():
    model = torch.nn.Linear(64, 64)
    with pytest.raises(WorkloadError, match="offload=optimizer wraps only Adam, AdamW, Adafactor .*not torch.optim.sgd.SGD"):
        offload_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


@cuda
@pytest.mark.parametrize("kind", [torch.optim.AdamW, torch.optim.Adafactor])
def test_offloaded_steps_train_as_the_device_optimizer(kind):
    torch.manual_seed(0)
    # a 128x128 weight is offloaded; its 128-element bias stays on the device
    models = [torch.nn.Linear(128, 128).cuda() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    plain = kind(models[0].parameters(), lr=1e-2)
    offloaded = TrainingPlan(TrainConfig("fp32", 4, offload="optimizer"), "cuda").optimizer(
        kind(models[1].parameters(), lr=1e-2))
    x = torch.randn(4, 128, device="cuda")
    for _ in range(3):
        for model, optimizer in zip(models, (plain, offloaded)):
            optimizer.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            optimizer.step()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_offload_on_the_cpu_is_a_one_line_error_where_the_optimizer_is_made():
    model = torch.nn.Linear(64, 64)
    plan = TrainingPlan(TrainConfig("fp32", 4, offload="optimizer"), "cpu")
    with pytest.raises(WorkloadError, match="^offload=optimizer keeps the optimizer's state on the host: on device cpu"):
        plan.optimizer(torch.optim.AdamW(model.parameters()))
    # offload=none leaves the optimizer as it is
    optimizer = torch.optim.AdamW(model.parameters())
    assert TrainingPlan(TrainConfig("fp32", 4), "cpu").optimizer(optimizer) is optimizer
