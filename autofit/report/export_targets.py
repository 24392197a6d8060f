"""One builder per export target: the config in that trainer's own settings, with its notes and changes."""

from __future__ import annotations

import dataclasses
from typing import Any

from autofit.core.config import (
    CheckpointPolicy,
    Offload,
    OptimizerChoice,
    Precision,
    TrainConfig,
)
from autofit.core.errors import ConfigError
from autofit.report.export_notes import (
    _BF16_CODE,
    _HF_OPTIM,
    HF_OPTIM,
    TORCHRUN_SCRIPT,
    Change,
    Context,
    Note,
    _batch_change,
    _checkpointing_names,
    _ckpt_note,
    _fsdp,
    _launch_note,
    _offload_note,
    _optimizer_note,
    _precision_change,
    _split_note,
)


def _hf(config: TrainConfig, ctx: Context) -> tuple[Any, dict, list[Note], list[Change]]:
    p = config.precision
    kwargs: dict = {"per_device_train_batch_size": config.micro_batch,
                    "gradient_accumulation_steps": config.grad_accum,
                    # pure bf16 has no flag here: its nearest, autocast bf16 (a note gives the exact code)
                    "bf16": p in (Precision.AMP_BF16, Precision.BF16), "fp16": p is Precision.AMP_FP16}
    if ctx.device_type == "cpu":
        kwargs["use_cpu"] = True
    notes, changes = [], []
    if config.changes_optimizer:
        kwargs["optim"] = HF_OPTIM[config.optimizer]
        why = ("" if config.optimizer is OptimizerChoice.ADAMW8BIT else
               " (the Trainer's adafactor is transformers' Adafactor, relative_step=False and scale_parameter=False: "
               "the same factored state as torch.optim.Adafactor, which autofit measured; for that one exactly, pass "
               "Trainer(optimizers=(optimizer, None)))")
        notes += _optimizer_note(config, "the Trainer", f"optim={kwargs['optim']!r} says it", why)
    if p is Precision.BF16:
        notes.append(Note("precision=bf16", "TrainingArguments has no pure-bf16 mode (its bf16=True is autocast "
                          "over fp32 weights)", _BF16_CODE + ("# and set bf16=False: no autocast over bf16 weights",),
                          "bf16=True (precision=amp-bf16)", dataclasses.replace(config, precision=Precision.AMP_BF16)))
        changes.append(_precision_change(config, "amp-bf16", "TrainingArguments has no pure-bf16 mode (bf16=True is "
                                         "autocast over fp32 weights)",
                                         "model.to(torch.bfloat16) before the Trainer, and bf16=False"))
    notes += _offload_note(config, "TrainingArguments", "its deepspeed argument can offload too "
                           "(autofit export --to deepspeed: zero_optimization.offload_optimizer), with DeepSpeed's own "
                           "CPU Adam; for the one autofit measured, pass Trainer(optimizers=(optimizer, None))")
    optimizer = ctx.optimizer_name()
    if optimizer is not None and optimizer in _HF_OPTIM:
        if _HF_OPTIM[optimizer]:
            kwargs["optim"] = _HF_OPTIM[optimizer]
    elif optimizer is not None:
        changes.append(Change("optimizer", optimizer, "AdamW", "the Trainer makes its own optimizer from "
                              f"TrainingArguments.optim, which has no {optimizer}",
                              "Trainer(..., optimizers=(optimizer, None))  # yours, over model.parameters()"))
    every = config.checkpoint_every
    flag, flag_kwargs = _checkpointing_names()
    if every:
        kwargs[flag] = every == 1
        if every == 1:
            kwargs[flag_kwargs] = {"use_reentrant": False}
        if every == 1 and config.checkpoint_policy is CheckpointPolicy.SELECTIVE:
            notes.append(_ckpt_note(config, "TrainingArguments", 1,
                                    f"{flag}=True, {flag_kwargs}={{'use_reentrant': False}} (full checkpointing "
                                    "of every layer: more recomputation, less memory)"))
        elif every > 1:
            notes.append(_ckpt_note(config, "TrainingArguments", 1,
                                    f"{flag}=True, {flag_kwargs}={{'use_reentrant': False}} "
                                    "(every layer: checkpoint_every=1)"))
    else:
        kwargs[flag] = False
    if _fsdp(config):  # FSDP2 with every decoder layer its own unit, as autofit shards
        kwargs.update(fsdp=True, fsdp_config={"version": 2, "reshard_after_forward": True})
        notes.append(_launch_note(config, "torchrun --nproc-per-node {n} your_train.py"))
    elif config.device_split > 1:
        notes.append(_split_note(config, "the Trainer"))
    return kwargs, {}, notes, changes


def _accelerate(config: TrainConfig, ctx: Context) -> tuple[Any, dict, list[Note], list[Change]]:
    p = config.precision
    # pure bf16: its nearest, autocast bf16 (a note gives the exact code)
    mixed = {Precision.FP32: "no", Precision.AMP_FP16: "fp16", Precision.AMP_BF16: "bf16", Precision.BF16: "bf16"}[p]
    kwargs = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "NO", "mixed_precision": mixed,
              "num_processes": 1, "num_machines": 1, "machine_rank": 0, "use_cpu": ctx.device_type == "cpu",
              "debug": False}
    ga = config.grad_accum
    notes = _optimizer_note(config, "Accelerate") + [
             Note(f"micro_batch={config.micro_batch}", "an Accelerate config file has no batch size",
                  (f"DataLoader(dataset, batch_size={config.micro_batch})",))]
    changes = []
    if ga > 1:  # nowhere in the file (outside DeepSpeed): the script or the environment must say it
        changes.append(_batch_change(config, config.micro_batch * config.data_parallel,
                                     f"an Accelerate config file holds no gradient accumulation (grad_accum={ga} "
                                     "becomes 1)", f"Accelerator(gradient_accumulation_steps={ga}) and "
                                     "accelerator.accumulate(model) around each micro-batch, or "
                                     f"ACCELERATE_GRADIENT_ACCUMULATION_STEPS={ga} accelerate launch ..."))
        notes.append(Note(f"grad_accum={ga}", "an Accelerate config file holds gradient_accumulation_steps only "
                          "for DeepSpeed", (f"accelerator = Accelerator(gradient_accumulation_steps={ga})",
                                             "with accelerator.accumulate(model): ...  # around each micro-batch",
                                             f"# or: ACCELERATE_GRADIENT_ACCUMULATION_STEPS={ga} accelerate launch ..."),
                          "grad_accum=1", dataclasses.replace(config, grad_accum=1)))
    if p is Precision.BF16:
        notes.append(Note("precision=bf16", "Accelerate has no pure-bf16 mode (mixed_precision bf16 is autocast "
                          "over fp32 weights)", _BF16_CODE + ("# and set mixed_precision: no",),
                          "mixed_precision: bf16 (precision=amp-bf16)",
                          dataclasses.replace(config, precision=Precision.AMP_BF16)))
        changes.append(_precision_change(config, "amp-bf16", "Accelerate has no pure-bf16 mode (mixed_precision "
                                         "bf16 is autocast over fp32 weights)", "model.to(torch.bfloat16) before "
                                         "accelerator.prepare(...), and mixed_precision: no"))
    notes += _offload_note(config, "Accelerate", "outside DeepSpeed its config file offloads only FSDP's parameters "
                           "(fsdp_offload_params), not an optimizer's state alone")
    if config.checkpoint_every:
        notes.append(_ckpt_note(config, "Accelerate", 0, "no checkpointing"))
    if _fsdp(config):
        kwargs.update(distributed_type="FSDP", num_processes=config.device_split,
                      fsdp_config={"fsdp_version": 2, "fsdp_reshard_after_forward": True,
                                   "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                   "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_offload_params": False,
                                   "fsdp_cpu_ram_efficient_loading": False, "fsdp_activation_checkpointing": False})
    elif config.device_split > 1:
        notes.append(_split_note(config, "Accelerate"))
    return kwargs, {}, notes, changes


LIGHTNING_PRECISION = {Precision.FP32: "32-true", Precision.AMP_FP16: "16-mixed",
                       Precision.AMP_BF16: "bf16-mixed", Precision.BF16: "bf16-true"}


def _lightning(config: TrainConfig, ctx: Context) -> tuple[Any, dict, list[Note], list[Change]]:
    kwargs = {"precision": LIGHTNING_PRECISION[config.precision], "accumulate_grad_batches": config.grad_accum,
              "accelerator": "cpu" if ctx.device_type == "cpu" else "gpu", "devices": 1}
    changes = []
    notes = (_optimizer_note(config, "the Lightning Trainer (configure_optimizers)")
             + _offload_note(config, "the Lightning Trainer", "return the wrapped optimizer from configure_optimizers"))
    if ctx.device_type == "cpu" and config.precision is Precision.AMP_FP16:
        changes.append(_precision_change(config, "amp-bf16", "on the CPU Lightning replaces precision '16-mixed' "
                                         "by 'bf16-mixed'", "Trainer(plugins=[MixedPrecision('16-mixed', 'cpu', "
                                         "torch.amp.GradScaler('cpu'))]) instead of precision"))
        notes.append(Note("precision=amp-fp16", "on the CPU Lightning replaces 16-mixed by bf16-mixed",
                          ("from lightning.pytorch.plugins import MixedPrecision",
                           "Trainer(plugins=[MixedPrecision('16-mixed', 'cpu', torch.amp.GradScaler('cpu'))], ...)"
                           "  # instead of precision='16-mixed'"),
                          "bf16-mixed (precision=amp-bf16)", dataclasses.replace(config, precision=Precision.AMP_BF16)))
    if config.checkpoint_every:
        notes.append(_ckpt_note(config, "the Lightning Trainer", 0, "no checkpointing"))
    if _fsdp(config) and ctx.device_type == "cpu":
        kwargs.update(strategy="ddp", devices=config.device_split)
        notes.append(Note("split_mode=fsdp", "Lightning's fsdp strategy needs GPUs", (
            "# on GPUs: Trainer(strategy='fsdp', accelerator='gpu', devices=N, ...)",), "ddp: no sharding",
            dataclasses.replace(config, device_split=1)))
    elif _fsdp(config):
        kwargs.update(strategy="fsdp", devices=config.device_split)
        notes.append(Note("split_mode=fsdp", "Lightning's 'fsdp' strategy is FSDP1 (FullyShardedDataParallel), "
                          "autofit measured FSDP2 (fully_shard): the same sharding of weights, gradients and state",
                          ("from lightning.pytorch.strategies import ModelParallelStrategy  # FSDP2",
                           "Trainer(strategy=ModelParallelStrategy(), ...) and in configure_model(): "
                           "fully_shard(layer) for each layer, then fully_shard(self.model)"),
                          "strategy='fsdp'", config))
    elif config.device_split > 1:
        notes.append(_split_note(config, "Lightning"))
    return kwargs, {"datamodule": {"batch_size": config.micro_batch}}, notes, changes


def _deepspeed(config: TrainConfig, ctx: Context) -> tuple[Any, dict, list[Note], list[Change]]:
    p = config.precision
    ds: dict = {"train_micro_batch_size_per_gpu": config.micro_batch,
                "gradient_accumulation_steps": config.grad_accum}
    changes = []
    notes = _optimizer_note(config, "DeepSpeed (deepspeed.initialize(model=model, optimizer=optimizer, ...))")
    if p.is_amp:  # torch.autocast over fp32 weights, a GradScaler for fp16: what autofit measured
        ds["torch_autocast"] = {"enabled": True, "dtype": "bfloat16" if p is Precision.AMP_BF16 else "float16"}
    if p is Precision.BF16:
        ds["bf16"] = {"enabled": True}
        notes.append(Note("precision=bf16", "DeepSpeed's bf16 mode keeps fp32 master weights and gradients beside "
                          "the bf16 weights (about 2 more bytes per parameter than amp-bf16's weights, gradients "
                          "and Adam state)",
                          ('"bf16": {"enabled": true, "bf16_master_weights_and_grads": true, '
                           '"bf16_optimizer_states": true}, "zero_optimization": {"stage": 1}  # all in bf16 (ZeRO)',),
                          "bf16 enabled (close to precision=amp-bf16's model state)",
                          dataclasses.replace(config, precision=Precision.AMP_BF16)))
        changes.append(_precision_change(config, "bf16 with fp32 master weights", "DeepSpeed's bf16 mode updates "
                                         "fp32 master weights and gradients (the model computes in bf16)",
                                         '"bf16_master_weights_and_grads": true, "bf16_optimizer_states": true '
                                         'and "zero_optimization": {"stage": 1}'))
    every = config.checkpoint_every
    if config.offload is Offload.OPTIMIZER:
        # ZeRO-Offload needs a ZeRO stage: stage 1 on one GPU shards nothing
        ds["zero_optimization"] = {"stage": 1, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
        notes += _offload_note(config, "DeepSpeed", "zero_optimization.offload_optimizer says it, stepped by "
                               "DeepSpeed's own CPU Adam (DeepSpeedCPUAdam, a compiled extension) over all parameters")
    if _fsdp(config):
        ds["zero_optimization"] = {**ds.get("zero_optimization", {}), "stage": 3}
        notes.append(Note("split_mode=fsdp", "DeepSpeed shards with its own ZeRO stage 3 (weights, gradients and "
                          "optimizer state over the ranks, as FSDP2's fully_shard does), not FSDP2",
                          (f"deepspeed --num_gpus {config.device_split} your_train.py  # micro_batch is per rank",),
                          "zero_optimization stage 3", config))
    if config.device_split > 1 and not _fsdp(config):
        ds["pipeline"] = {"stages": config.device_split, "activation_checkpoint_interval": every}
        notes.append(Note(f"device_split={config.device_split}", "DeepSpeed takes the stage count and checkpoint "
                          "interval from PipelineModule in code; the 'pipeline' section alone does not split",
                          (f"model = PipelineModule(layers=[...], num_stages={config.device_split}, "
                           f"activation_checkpoint_interval={every}, loss_fn=loss_fn)",
                           "engine, *_ = deepspeed.initialize(model=model, config='ds_config.json', ...)")))
    if every and not (config.device_split > 1 and not _fsdp(config)):
        ds["activation_checkpointing"] = {"partition_activations": False, "cpu_checkpointing": False,
                                          "contiguous_memory_optimization": False}
        notes.append(_ckpt_note(config, "DeepSpeed", 0, "no checkpointing",
                                " (its activation_checkpointing section only configures deepspeed.checkpointing "
                                "calls made by the model)"))
    return ds, {}, notes, changes


def _torchrun(config: TrainConfig, ctx: Context) -> tuple[Any, dict, list[Note], list[Change]]:
    if config.device_split < 2:
        raise ConfigError(f"--to torchrun: {config.short()} does not split over devices (device_split=1); "
                          "torchrun runs autofit's pipeline runner for device_split >= 2: use --to hf, accelerate, "
                          "lightning or deepspeed")
    if _fsdp(config):
        raise ConfigError(f"--to torchrun: autofit's torchrun runner ({TORCHRUN_SCRIPT}) runs pipeline splits; for "
                          "split_mode=fsdp use --to hf, accelerate or deepspeed")
    if not ctx.model_spec:
        raise ConfigError("--to torchrun needs the workload as a --model spec (built-in name, path/to/file.py:function "
                          "or package.module:function)")
    # --standalone: a free local rendezvous port, not the fixed 29500 another job may hold
    argv = ["torchrun", "--standalone", "--nproc-per-node", str(config.device_split), TORCHRUN_SCRIPT, "--model", ctx.model_spec,
            "--config", config.to_text(), "--device", ctx.device_type]
    if ctx.budget_bytes:
        argv += ["--budget", f"{ctx.budget_bytes}B"]
    return argv + ["--json"], {}, [], []  # autofit's own runner: the config as measured


def _json(config: TrainConfig, ctx: Context) -> tuple[Any, dict, list[Note], list[Change]]:
    record = {"config": config.to_dict(), "short": config.short(), "device": ctx.device_type,
              "budget_bytes": ctx.budget_bytes, "model": ctx.model_spec, **ctx.extra}
    return record, {}, (_optimizer_note(config, "autofit", "its TrainingPlan (and autofit's runners) replaces it")
                        + _offload_note(config, "autofit", "its TrainingPlan.optimizer (and autofit's runners) "
                                        "wraps it")), []

