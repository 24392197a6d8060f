"""The workload contract: the one place user code enters autofit."""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from autofit.core.errors import WorkloadError


def largest_module_list(model: nn.Module) -> nn.ModuleList:
    """The ``nn.ModuleList`` with the most parameters: the default repeated-block list.

    Raises WorkloadError when the model has no ModuleList.
    """
    best, best_count = None, -1
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            count = sum(p.numel() for p in module.parameters())
            if count > best_count:
                best, best_count = module, count
    if best is None:
        raise WorkloadError(
            f"{type(model).__name__} has no nn.ModuleList of layers; pass layers=lambda m: m.<your blocks>, "
            "or layers=lambda m: nn.ModuleList([m]) for a model without repeated blocks (the whole model one layer)"
        )
    return best


@dataclass(frozen=True)
class Workload:
    """What autofit needs to train a model.

    - ``name``: a short identifier used in tables and cache keys.
    - ``model()``: a fresh ``nn.Module`` in fp32, on the CPU (autofit moves it).
    - ``batch(n)``: ``(inputs, targets)`` for ``n`` samples, on the CPU.
    - ``loss(outputs, targets)``: a scalar tensor.
    - ``optimizer(params)``: a ``torch.optim.Optimizer`` over ``params``.
    - ``layers(model)``: the ``nn.ModuleList`` of repeated blocks that checkpointing and
      device split act on (default: the largest ModuleList). The model must call them in
      order, each taking the previous one's output as its first argument.
    - ``tokens_per_sample``: optional, to report tokens/s.
    - ``preload``: optional, modules every trial imports that are slow to import (the library the
      model comes from, e.g. ``("timm",)``): on the CPU the trials' fork server imports them once,
      so that no trial does.

    Example::

        Workload(name="mlp", model=lambda: Net(), batch=make_batch, loss=F.cross_entropy,
                 optimizer=lambda ps: torch.optim.AdamW(ps), layers=lambda m: m.blocks)
    """

    name: str
    model: Callable[[], nn.Module]
    batch: Callable[[int], tuple[Any, Any]]
    loss: Callable[[Any, Any], torch.Tensor]
    optimizer: Callable[[Any], torch.optim.Optimizer] = field(default=lambda params: torch.optim.AdamW(params))
    layers: Callable[[nn.Module], nn.ModuleList] = largest_module_list
    tokens_per_sample: int | None = None
    description: str = ""
    # Extra facts for reports and cache keys (e.g. preset hyper-parameters); never read by the estimator.
    meta: dict = field(default_factory=dict)
    # How to rebuild this workload in another process (the --model spec); set by load_workload.
    source: str | None = None
    # Optional: cut the model by hand into pipeline stage ``rank`` of ``bounds`` (for models the
    # tracer cannot capture): ``split(model, bounds, rank, example_input) -> (stage_module, replicated)``
    # where ``replicated`` lists ``{rank: parameter name}`` for weights held on several stages. It may
    # have a ``refusal(model) -> str | None`` attribute: why the model cannot be cut, checked when
    # profiling so that splits are pruned with that reason before any trial.
    split: Callable | None = None
    preload: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise WorkloadError("Workload.name must be a non-empty string")
        if isinstance(self.model, nn.Module):  # callable too (its forward), so say it here
            raise WorkloadError(f"Workload.model must be a function returning a fresh nn.Module (model={type(self.model).__name__} "
                                f"or model=lambda: {type(self.model).__name__}(...)), got a {type(self.model).__name__} instance")
        if isinstance(self.optimizer, torch.optim.Optimizer):
            raise WorkloadError(f"Workload.optimizer must be a function of the parameters (e.g. optimizer=lambda params: "
                                f"torch.optim.{type(self.optimizer).__name__}(params, lr=...)), got a "
                                f"{type(self.optimizer).__name__} instance")
        for attr in ("model", "batch", "loss", "optimizer", "layers"):
            if not callable(getattr(self, attr)):
                raise WorkloadError(f"Workload.{attr} must be callable, got {type(getattr(self, attr)).__name__}")
        if not isinstance(self.preload, (tuple, list)) or not all(isinstance(m, str) and m for m in self.preload):
            raise WorkloadError(f"Workload.preload must be a tuple of module names (e.g. preload=('timm',)), "
                                f"got {self.preload!r}")
        object.__setattr__(self, "preload", tuple(self.preload))  # frozen: a list given is kept as a tuple
        if self.tokens_per_sample is not None and (not isinstance(self.tokens_per_sample, int) or self.tokens_per_sample < 1):
            raise WorkloadError(f"Workload.tokens_per_sample must be a positive integer, got {self.tokens_per_sample!r}")


_FAILURE_HINTS = (  # torch's words for the usual workload mistakes -> what the workload must do instead
    (("implicitly created only for scalar outputs",),
     "loss(outputs, targets) did not return a scalar; it must return one number (e.g. reduce it with .mean())"),
    (("does not require grad and does not have a grad_fn",),
     "the loss has no gradient: no parameter requires grad (all frozen?); unfreeze at least one "
     "(requires_grad=True), e.g. a LoRA adapter's"),
    (("must have same reduction dim", "mat1 and mat2 shapes", "size mismatch", "shape", "dimension", "size of tensor"),
     "batch(n)'s inputs or targets do not fit the model or the loss: batch(n) must return (inputs, targets) "
     "the model and loss accept"),
)


def explain_build_failure(workload: Workload, exc: BaseException) -> str:
    """One line on why building the model (and its layers) failed: a wrong return type named, else ``exc``."""
    generic = f"{workload.name}: cannot build the model on fake tensors ({type(exc).__name__}: {exc})"
    try:
        with torch.device("meta"):
            model = workload.model()
            if not isinstance(model, nn.Module):
                return f"{workload.name}: model() returned {type(model).__name__}; it must return a fresh nn.Module"
            layers = workload.layers(model)
    except Exception:  # the first failure is the one to report
        return generic
    if not isinstance(layers, nn.ModuleList):
        return (f"{workload.name}: layers(model) returned {type(layers).__name__}; it must return the nn.ModuleList "
                "of repeated blocks (e.g. m.blocks; for one block, nn.ModuleList([m.block]))")
    return generic


def checked_batch(workload: Workload, n: int) -> tuple:
    """``workload.batch(n)``, refused unless it is the pair ``(inputs, targets)``."""
    batch = workload.batch(n)
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        got = f"a {len(batch)}-tuple" if isinstance(batch, (tuple, list)) else type(batch).__name__
        raise WorkloadError(f"{workload.name}: batch({n}) returned {got}; it must return (inputs, targets), "
                            "e.g. (torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,)))")
    return tuple(batch)


def selective_caveat(name: str, model: nn.Module) -> str | None:
    """Why ``model`` cannot be checkpointed selectively, if it cannot: a transformers model that caches keys
    and values while it trains appends to its cache in each layer's forward, so a recomputation runs other
    operators than the forward did, which torch's selective checkpointing refuses (it raises in backward)."""
    if getattr(getattr(model, "config", None), "use_cache", None) is not True:
        return None
    return (f"{name}: config.use_cache is True, so each layer appends to a key/value cache as it runs and a "
            "recomputation runs other operators than the forward, which selective checkpointing refuses; set "
            "use_cache=False")


def _failing_optimizer(exc: BaseException) -> str | None:
    """The class name of the optimizer whose ``step`` raised ``exc``, if one did."""
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.optim.Optimizer):
            return type(owner).__name__
    return None


def explain_failure(name: str, exc: BaseException) -> str:
    """One line on why a workload failed to train a step, naming the mistake when torch's words show it."""
    text = " ".join(str(exc).split())
    optimizer = _failing_optimizer(exc)
    if optimizer is not None and "closure" in text:  # LBFGS: step(closure) evaluates the loss itself
        return (f"{name}: the optimizer's step ({optimizer}) needs a closure that re-evaluates the loss, and "
                f"autofit's training step calls optimizer.step() once after backward ({type(exc).__name__}: {text}); "
                "use one whose step takes no closure, e.g. torch.optim.AdamW, SGD, RMSprop, Adagrad")
    if optimizer is not None:  # not the model's fault: say so, and what a profiled optimizer must not do
        why = (" (it reads a tensor's value, e.g. .item(), which fake tensors do not have)"
               if "_local_scalar_dense" in text or "data-dependent" in text.lower() else "")
        return (f"{name}: the optimizer's step ({optimizer}) cannot run on fake tensors{why}, so autofit cannot "
                f"profile it ({type(exc).__name__}: {text}); use one that can, e.g. torch.optim.AdamW, Adafactor, SGD, RMSprop, "
                "Adagrad")
    if type(exc).__name__ in ("DynamicOutputShapeException", "DataDependentOutputException"):
        return (f"{name}: the step reads tensor values ({text}: an output size or a number that depends on data), "
                "which fake tensors do not have; autofit knows them only for a router's torch.topk (mixture of "
                "experts) and what is computed from its indices alone")
    for needles, hint in _FAILURE_HINTS:
        if any(n in text for n in needles):
            return f"{name}: {hint} ({type(exc).__name__}: {text})"
    return (f"{name}: profiling on fake tensors failed ({type(exc).__name__}: {text}); "
            "the model must build and train under torch FakeTensorMode")
