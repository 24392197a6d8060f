"""Apply a found config to your own training loop: precision, checkpointing, micro-batches, accumulation.

A :class:`TrainingPlan` is a config and a device type; it gives what a training loop needs:
the autocast context, a GradScaler for fp16, the parameter dtype, the model with its layers
checkpointed, and a global batch cut into ``grad_accum`` micro-batches. A :class:`TrainingRun`
binds a plan to one model and optimizer (``with plan.run(model, optimizer) as run``) and does
the bookkeeping of an accumulated step: the loss divided by ``grad_accum`` and scaled, the
optimizer stepped through the scaler, gradients cleared. The helpers are those of
:mod:`autofit.runtime.training`, the code the trials measured.

Example::

    plan = TrainingPlan(TrainConfig.parse("precision=amp-bf16,micro_batch=8,grad_accum=4"))
    with plan.run(model, optimizer) as run:
        for batch in loader:                        # 32 samples: micro_batch * grad_accum
            for inputs, targets in run.micro_batches(batch):
                with run.autocast():
                    loss = loss_fn(model(inputs), targets)
                run.backward(loss)
            run.step()

A config whose ``optimizer`` is not ``as-given`` trains with a replacement of your optimizer
(:func:`TrainingPlan.optimizer`, the same one the trials measured): ``run.optimizer`` is the one
stepped, so make a learning-rate scheduler on it, not on the optimizer you passed.

Known limitations: ``device_split > 1`` (pipeline stages in several processes) cannot be
applied to a model inside one loop: :meth:`TrainingPlan.prepare` raises ConfigError (see
:mod:`autofit.trial.pipeline` and ``scripts/run_split_torchrun.py``). Leaving a run removes the
checkpointing it added; the parameter dtype (bf16) stays.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from autofit.core.config import Precision, TrainConfig
from autofit.core.errors import ConfigError
from autofit.runtime.offload import apply_offload
from autofit.runtime.optimizers import replace_optimizer
from autofit.runtime.training import (
    apply_config,
    autocast_context,
    grad_scaler,
    param_dtype,
    to_device,
)
from autofit.workloads.base import largest_module_list

LayersArg = nn.ModuleList | Callable[[nn.Module], nn.ModuleList] | None


@dataclass(frozen=True)
class TrainingPlan:
    """How to train with ``config`` on ``device_type`` (``"cpu"`` or ``"cuda"``)."""

    config: TrainConfig
    device_type: str = "cpu"

    @property
    def micro_batch(self) -> int:
        return self.config.micro_batch

    @property
    def grad_accum(self) -> int:
        return self.config.grad_accum

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step."""
        return self.config.samples_per_step

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype of weights, gradients and optimizer state (bf16 only for ``precision=bf16``)."""
        return param_dtype(self.config.precision)

    def autocast(self) -> contextlib.AbstractContextManager:
        """``torch.autocast`` for the amp precisions, a null context otherwise. Wrap forward and loss only."""
        return autocast_context(self.config.precision, self.device_type)

    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """A new GradScaler for ``amp-fp16`` (fp16 gradients underflow without one), else None."""
        return grad_scaler(self.config.precision, self.device_type)

    def prepare(self, model: nn.Module, layers: LayersArg = None) -> nn.Module:
        """Cast ``model`` to the parameter dtype and checkpoint its layers; returns ``model`` (changed in place).

        ``layers``: the ``nn.ModuleList`` of repeated blocks, or a function of the model
        returning it (default: the largest ModuleList, as for a Workload). Casting keeps the
        Parameter objects, so an optimizer made before still holds them. Raises ConfigError for
        ``device_split > 1``; WorkloadError when checkpointing needs a layer list the model lacks.
        """
        if self.config.data_parallel > 1:
            raise ConfigError(f"device_split {self.config.device_split} with split_mode=fsdp: run the loop in each of "
                              f"{self.config.device_split} processes (torchrun) and shard the model with "
                              "autofit.trial.fsdp.shard_model(model, layers, config) after init_process_group")
        if self.config.device_split > 1:
            raise ConfigError(f"device_split {self.config.device_split}: pipeline stages run in separate processes "
                              "and cannot be applied inside one training loop; see autofit.trial.pipeline")
        # The trials' own apply_config: cast, then checkpoint; the optimizer and scaler are the run's.
        apply_config(model, self.config, None, make_optimizer=None, scaler=False,
                     layers=_layer_list(model, layers) if self.config.checkpoint_every else None)
        return model

    def optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer to train with: ``optimizer`` itself, or for a config whose ``optimizer`` lever is set
        (e.g. ``adamw8bit``) its replacement over the same parameter groups and hyper-parameters
        (:func:`autofit.runtime.optimizers.replace_optimizer`). Raises WorkloadError when ``optimizer``
        cannot be replaced (only torch.optim.Adam and AdamW are) or the replacement's library is missing.
        With ``offload=optimizer`` it is wrapped to keep its state and step on the host
        (:func:`autofit.runtime.offload.offload_optimizer`; CUDA only, else WorkloadError): make it after
        ``apply``."""
        return apply_offload(self.config, replace_optimizer(self.config.optimizer, optimizer), self.device_type)

    def micro_batches(self, batch: Any, device: torch.device | str | None = None) -> list:
        """Cut a global batch (tensors, tuples, lists or dicts of them, samples along dim 0) into
        ``grad_accum`` micro-batches of ``micro_batch`` samples; floating tensors become bf16 under
        ``precision=bf16``; moved to ``device`` when given.

        Raises ConfigError when the batch does not hold ``micro_batch * grad_accum`` samples.
        """
        size = _batch_size(batch)
        if size != self.global_batch:
            raise ConfigError(f"a batch of {size} samples: this plan needs micro_batch {self.micro_batch} x grad_accum "
                              f"{self.grad_accum} = {self.global_batch}")
        float_dtype = torch.bfloat16 if self.config.precision is Precision.BF16 else None
        chunks = [_slice(batch, i * self.micro_batch, (i + 1) * self.micro_batch) for i in range(self.grad_accum)]
        if device is None and float_dtype is None:
            return chunks
        target = torch.device(device) if device is not None else _first_device(batch)
        return [to_device(chunk, target, float_dtype) for chunk in chunks]

    def run(self, model: nn.Module, optimizer: torch.optim.Optimizer, layers: LayersArg = None) -> "TrainingRun":
        """A :class:`TrainingRun` of ``model`` and ``optimizer`` (replaced where the config's ``optimizer`` lever
        says: :meth:`optimizer`) under this plan (a context manager)."""
        return TrainingRun(self, model, optimizer, layers)


class TrainingRun:
    """A plan bound to a model and an optimizer; use as ``with plan.run(model, optimizer) as run:``.

    Entering prepares the model (:meth:`TrainingPlan.prepare`); leaving removes the checkpointing.
    Between them, per optimizer step: ``run.micro_batches(batch)``, then per micro-batch
    ``with run.autocast(): loss = ...`` and ``run.backward(loss)``, then ``run.step()``.
    """

    def __init__(self, plan: TrainingPlan, model: nn.Module, optimizer: torch.optim.Optimizer,
                 layers: LayersArg = None) -> None:
        self.plan = plan
        self.model = model
        self.optimizer = plan.optimizer(optimizer)  # the lever's replacement, or ``optimizer`` itself
        self.scaler = plan.grad_scaler()
        self._layers = layers
        self._patched: list[nn.Module] = []

    def __enter__(self) -> "TrainingRun":
        layers = _layer_list(self.model, self._layers) if self.plan.config.checkpoint_every else []
        before = [("forward" in vars(layer)) for layer in layers]
        self.plan.prepare(self.model, self._layers)
        patched = [layer for layer, had in zip(layers, before) if not had and "forward" in vars(layer)]
        self._patched = list({id(layer): layer for layer in patched}.values())  # a shared layer once
        self.optimizer.zero_grad(set_to_none=True)
        return self

    def __exit__(self, *exc) -> None:
        for layer in self._patched:  # checkpoint_layers set instance attributes; the class's forward returns
            del layer.forward
        self._patched = []

    def autocast(self) -> contextlib.AbstractContextManager:
        """The plan's autocast context; wrap the forward and the loss, not the backward."""
        return self.plan.autocast()

    def micro_batches(self, batch: Any) -> list:
        """The plan's micro-batches of ``batch``, on the model's device."""
        device = next((p.device for p in self.model.parameters()), None)
        return self.plan.micro_batches(batch, device)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss: divided by ``grad_accum`` (a mean over the global batch), scaled for fp16."""
        scaled = loss / self.plan.grad_accum
        if self.scaler is not None:
            scaled = self.scaler.scale(scaled)
        scaled.backward()

    def step(self) -> None:
        """The optimizer step after ``grad_accum`` backwards (through the GradScaler for fp16), then zero_grad."""
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def train_step(self, batch: Any, loss_fn: Callable[[nn.Module, Any], torch.Tensor]) -> float:
        """One optimizer step over a global batch: ``loss_fn(model, micro_batch)`` per micro-batch. Returns the mean loss."""
        total = 0.0
        for micro in self.micro_batches(batch):
            with self.autocast():
                loss = loss_fn(self.model, micro)
            self.backward(loss)
            total += float(loss.detach())
        self.step()
        return total / self.plan.grad_accum


def _layer_list(model: nn.Module, layers: LayersArg) -> nn.ModuleList:
    if layers is None:
        return largest_module_list(model)
    if isinstance(layers, nn.ModuleList):
        return layers
    return layers(model)


def _batch_size(batch: Any) -> int | None:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, (list, tuple)):
        sizes = [_batch_size(b) for b in batch]
    elif isinstance(batch, dict):
        sizes = [_batch_size(b) for b in batch.values()]
    else:
        return None
    sizes = [s for s in sizes if s is not None]
    return sizes[0] if sizes and all(s == sizes[0] for s in sizes) else None


def _slice(batch: Any, start: int, end: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[start:end]
    if isinstance(batch, (list, tuple)):
        return type(batch)(_slice(b, start, end) for b in batch)
    if isinstance(batch, dict):
        return {k: _slice(v, start, end) for k, v in batch.items()}
    return batch


def _first_device(batch: Any) -> torch.device:
    if isinstance(batch, torch.Tensor):
        return batch.device
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        if isinstance(item, (torch.Tensor, list, tuple, dict)):
            return _first_device(item)
    return torch.device("cpu")
