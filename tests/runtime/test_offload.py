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


class _HookedOffloader:
    """The shape of torchao's CPUOffloadOptimizer that matters here (it needs CUDA to build): each large
    parameter gets a post-accumulate-grad hook whose closure holds the optimizer, which maps the parameter."""

    def __init__(self, params):
        self.param_d2h_map, self.optim_dict, self.queue = {}, {}, {}
        for p in params:
            p.register_post_accumulate_grad_hook(lambda _p: self.queue)
            self.param_d2h_map[p] = torch.empty_like(p)
            self.optim_dict[p] = None


def _dropped_after(release: bool) -> bool:
    import gc
    import weakref

    from autofit.runtime.offload import release_offloaded

    model = torch.nn.Linear(64, 64)
    optimizer = _HookedOffloader(list(model.parameters()))
    weight = weakref.ref(model.weight)
    if release:
        release_offloaded(optimizer)
    del model, optimizer
    gc.collect()
    return weight() is None


def test_an_offloaded_models_weights_are_freed_once_released():
    # the hook lives in C++ (the tensor's autograd metadata): the collector cannot break the cycle itself,
    # so a trial host's next trial would find the last offloaded trial's weights on the card
    assert not _dropped_after(release=False)
    assert _dropped_after(release=True)


def test_releasing_any_other_optimizer_changes_nothing():
    from autofit.runtime.offload import release_offloaded

    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([weight])
    weight.grad = torch.ones(3)
    optimizer.step()
    release_offloaded(optimizer)
    assert len(optimizer.state[weight]) == 3
