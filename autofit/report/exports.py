"""Hand a config to the trainer people use: Transformers, Accelerate, Lightning, DeepSpeed, torchrun.

``export(config, target)`` turns a :class:`TrainConfig` into what the target takes as it is:

- ``hf``: keyword arguments of ``transformers.TrainingArguments``;
- ``accelerate``: an Accelerate config file (YAML, for ``accelerate launch --config_file``);
- ``lightning``: keyword arguments of ``lightning.Trainer`` plus the data module's batch size;
- ``deepspeed``: a DeepSpeed config (JSON);
- ``torchrun``: the ``torchrun`` command that runs autofit's own pipeline runner
  (``scripts/run_split_torchrun.py``) for a config split over devices;
- ``json``: autofit's own config record.

A target that cannot say a setting exactly (checkpointing every k layers in the Trainer, pure
bf16 weights in Accelerate, a pipeline split in Lightning) gets a :class:`Note`: what it cannot
say, the nearest setting it can, that nearest setting's estimated peak (when the workload is
known), and the few lines of code that do it exactly. Notes travel in the export's ``comment``
field (``#`` lines in YAML and shell) so that nothing is dropped silently. A config whose
``optimizer`` lever replaces the workload's optimizer changes the training: its note comes first,
in every target (the Trainer's ``optim`` says it where it can: ``adamw_bnb_8bit``, ``adafactor``).

Example::

    exp = autofit.export("precision=amp-bf16,micro_batch=8,grad_accum=4,checkpoint_every=1", "hf")
    args = transformers.TrainingArguments(**exp.kwargs)
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from autofit.core.budget import format_budget, format_bytes, parse_budget
from autofit.core.config import (
    FIELDS,
    CheckpointPolicy,
    OptimizerChoice,
    Precision,
    SplitMode,
    TrainConfig,
)
from autofit.core.errors import AutofitError, ConfigError

TARGETS = ("hf", "accelerate", "lightning", "deepspeed", "torchrun", "json")
TORCHRUN_SCRIPT = "scripts/run_split_torchrun.py"  # autofit's runner of one process per pipeline stage

# The exact way to checkpoint runs of k layers (what autofit measured), for targets without it.
_CKPT_CODE = ("from autofit.runtime.training import checkpoint_layers  # non-reentrant torch.utils.checkpoint",
              "checkpoint_layers(model.model.layers, {k}{policy})  # your nn.ModuleList of repeated blocks")
# The optimizer lever's replacements, made as autofit made them (the same groups and hyper-parameters).
_OPTIMIZER_CODE = {
    OptimizerChoice.ADAMW8BIT: ("import bitsandbytes as bnb  # pip install bitsandbytes",
                                "optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=lr, betas=betas, eps=eps, "
                                "weight_decay=weight_decay)  # your AdamW's settings"),
    OptimizerChoice.ADAFACTOR: ("optimizer = torch.optim.Adafactor(model.parameters(), lr=lr, "
                                "weight_decay=weight_decay)  # lr: the relative step size cap",),
}
_OPTIMIZER_WORDS = {OptimizerChoice.ADAMW8BIT: "bitsandbytes' 8-bit AdamW (one byte per moment and element, "
                                               "fp32 scales per block of 256)",
                    OptimizerChoice.ADAFACTOR: "torch.optim.Adafactor (factored second moments, no first moment)"}
# Hugging Face TrainingArguments' ``optim`` for each choice.
HF_OPTIM = {OptimizerChoice.ADAMW8BIT: "adamw_bnb_8bit", OptimizerChoice.ADAFACTOR: "adafactor"}
_BF16_CODE = ("model.to(torch.bfloat16)  # before the optimizer is made: weights, gradients and its state in bf16",)


@dataclass(frozen=True)
class Note:
    """One setting the target cannot express exactly (or that belongs in the training script).

    ``nearest_config`` is the config the target's own settings give without ``code``;
    ``nearest_peak_bytes`` its estimated peak per device (None when no workload was given).
    """

    setting: str
    why: str
    code: tuple[str, ...] = ()
    nearest: str | None = None
    nearest_config: TrainConfig | None = None
    nearest_peak_bytes: int | None = None
    budget_bytes: int | None = None
    no_peak_reason: str = "no workload given"

    def text(self) -> str:
        """One paragraph: the setting, why, the nearest setting and its peak, the exact code."""
        out = f"{self.setting}: {self.why}"
        if self.nearest:
            out += f"; nearest: {self.nearest}"
            if self.nearest_peak_bytes is not None:
                out += f", estimated peak {format_bytes(self.nearest_peak_bytes)} per device"
                if self.budget_bytes:
                    verdict = "fits" if self.nearest_peak_bytes <= self.budget_bytes else "over"
                    out += f" ({verdict} the {format_budget(self.budget_bytes)} budget)"
            elif self.nearest_config is not None:
                out += f" (peak not estimated: {self.no_peak_reason})"
        if self.code:
            out += "; exactly: " + " | ".join(self.code)
        return out

    def to_dict(self) -> dict:
        return {"setting": self.setting, "why": self.why, "nearest": self.nearest,
                "nearest_config": self.nearest_config.to_dict() if self.nearest_config else None,
                "nearest_peak_bytes": self.nearest_peak_bytes, "code": list(self.code)}


@dataclass(frozen=True)
class Export:
    """A config in a target's own form.

    - ``kwargs``: what the target takes (``TrainingArguments(**kwargs)``, ``Trainer(**kwargs)``,
      the DeepSpeed dict, the Accelerate config dict, torchrun's argv, autofit's record);
    - ``extra``: what goes beside it (Lightning: ``{"datamodule": {"batch_size": ...}}``);
    - ``notes``: what the target cannot say exactly; ``text``: the file or command as printed.
    """

    target: str
    config: TrainConfig
    kwargs: Any
    extra: dict
    notes: tuple[Note, ...]
    text: str

    def comment(self) -> list[str]:
        """The notes as lines (the export's ``comment`` field)."""
        return [note.text() for note in self.notes]

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.text)
        return path


@dataclass(frozen=True)
class Context:
    """What an export knows beyond the config: where it runs and, to estimate peaks, the workload."""

    device_type: str = "cuda"
    budget_bytes: int | None = None
    model_spec: str | None = None          # a --model spec (for torchrun and the peaks)
    workload: Any = None                   # a Workload, or None to load model_spec
    profile: Any = None                    # the workload's Profile when known (a study's): no profiling
    extra: dict = dataclasses.field(default_factory=dict)  # json target: predicted/measured, study


# --- per target: (kwargs, extra, notes without peaks) ---------------------------------------------


def _ckpt_note(config: TrainConfig, target: str, nearest_every: int, nearest_text: str, why: str = "") -> Note:
    k = config.checkpoint_every
    selective = config.checkpoint_policy is CheckpointPolicy.SELECTIVE
    layers = "every layer" if k == 1 else f"runs of {k} layers"
    what = f"selectively (matmul and attention outputs kept) in {layers}" if selective else \
        f"runs of {k} layers as one segment"
    return Note(f"checkpoint_every={k}" + (",checkpoint_policy=selective" if selective else ""),
                f"{target} cannot checkpoint {what}{why}",
                tuple(line.format(k=k, policy=', "selective"' if selective else "") for line in _CKPT_CODE)
                + (f"# and leave {target}'s own checkpointing off",),
                nearest_text, dataclasses.replace(config, checkpoint_every=nearest_every,
                                                  checkpoint_policy=CheckpointPolicy.FULL))


def _optimizer_note(config: TrainConfig, target: str, in_target: str | None = None, why: str = "") -> list[Note]:
    """What a config that replaces the workload's optimizer says first: that this changes the training, what
    replaces it, and how (``in_target``: the target's own setting for it, which makes it exact)."""
    if not config.changes_optimizer:
        return []
    choice = config.optimizer
    head = (f"this config changes the training: it replaces your Adam/AdamW with {_OPTIMIZER_WORDS[choice]}"
            + (f"; {in_target}" if in_target else f"; {target} takes the optimizer from your code"))
    code = () if in_target and not why else _OPTIMIZER_CODE[choice] + (
        "# or, from the optimizer you have: from autofit.runtime.optimizers import replace_optimizer; "
        f"optimizer = replace_optimizer({choice.value!r}, optimizer)",)
    nearest = None if in_target and not why else "your own optimizer (optimizer=as-given)"
    return [Note(f"optimizer={choice.value}", head + why, code, nearest,
                 None if nearest is None else dataclasses.replace(config, optimizer=OptimizerChoice.AS_GIVEN))]


def _split_note(config: TrainConfig, target: str) -> Note:
    p = config.device_split
    return Note(f"device_split={p}", f"{target} has no pipeline split of the layers over {p} devices",
                (f"autofit export DIR --to torchrun  # one process per stage: torchrun --nproc-per-node {p} "
                 f"{TORCHRUN_SCRIPT} ...",
                 "# or torch.distributed.pipelining: pipeline(model, mb_args, split_spec={'<layers>.<i>': "
                 "SplitPoint.BEGINNING}) and Schedule1F1B(stage, n_microbatches=grad_accum, loss_fn=...)"),
                "no split (one device)", dataclasses.replace(config, device_split=1))


def _fsdp(config: TrainConfig) -> bool:
    return config.device_split > 1 and config.split_mode is SplitMode.FSDP


def _launch_note(config: TrainConfig, launcher: str) -> Note:
    """FSDP ranks are processes: the launcher, not the arguments, says how many."""
    n = config.device_split
    return Note(f"device_split={n},split_mode=fsdp", f"the number of ranks is set by the launcher, not here "
                f"(micro_batch={config.micro_batch} is per rank: {config.samples_per_step} samples per step)",
                (f"{launcher.format(n=n)}",))


@functools.cache
def _checkpointing_names() -> tuple[str, str]:
    """TrainingArguments' names for checkpointing in the installed transformers: 5.x renamed
    ``gradient_checkpointing(_kwargs)`` to ``activation_checkpointing(_kwargs)`` (the old names warn,
    and go in v6); older versions, or none installed, get the old names. Read from the installed
    source, not imported: importing transformers costs seconds (and torch._dynamo) per export."""
    old = ("gradient_checkpointing", "gradient_checkpointing_kwargs")
    try:
        source = importlib.metadata.distribution("transformers").locate_file("transformers/training_args.py")
        text = Path(str(source)).read_text(encoding="utf-8")
    except (importlib.metadata.PackageNotFoundError, OSError, UnicodeDecodeError):
        return old
    if re.search(r"^\s+activation_checkpointing\s*:", text, re.M):
        return ("activation_checkpointing", "activation_checkpointing_kwargs")
    return old


def _hf(config: TrainConfig, ctx: Context) -> tuple[Any, dict, list[Note]]:
    p = config.precision
    kwargs: dict = {"per_device_train_batch_size": config.micro_batch,
                    "gradient_accumulation_steps": config.grad_accum,
                    # pure bf16 has no flag here: its nearest, autocast bf16 (a note gives the exact code)
                    "bf16": p in (Precision.AMP_BF16, Precision.BF16), "fp16": p is Precision.AMP_FP16}
    if ctx.device_type == "cpu":
        kwargs["use_cpu"] = True
    notes = []
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
    return kwargs, {}, notes


def _accelerate(config: TrainConfig, ctx: Context) -> tuple[Any, dict, list[Note]]:
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
    if ga > 1:
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
    return kwargs, {}, notes


LIGHTNING_PRECISION = {Precision.FP32: "32-true", Precision.AMP_FP16: "16-mixed",
                       Precision.AMP_BF16: "bf16-mixed", Precision.BF16: "bf16-true"}


def _lightning(config: TrainConfig, ctx: Context) -> tuple[Any, dict, list[Note]]:
    kwargs = {"precision": LIGHTNING_PRECISION[config.precision], "accumulate_grad_batches": config.grad_accum,
              "accelerator": "cpu" if ctx.device_type == "cpu" else "gpu", "devices": 1}
    notes = _optimizer_note(config, "the Lightning Trainer (configure_optimizers)")
    if ctx.device_type == "cpu" and config.precision is Precision.AMP_FP16:
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
    return kwargs, {"datamodule": {"batch_size": config.micro_batch}}, notes


def _deepspeed(config: TrainConfig, ctx: Context) -> tuple[Any, dict, list[Note]]:
    p = config.precision
    ds: dict = {"train_micro_batch_size_per_gpu": config.micro_batch,
                "gradient_accumulation_steps": config.grad_accum}
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
    every = config.checkpoint_every
    if _fsdp(config):
        ds["zero_optimization"] = {"stage": 3}
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
    return ds, {}, notes


def _torchrun(config: TrainConfig, ctx: Context) -> tuple[Any, dict, list[Note]]:
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
    return argv + ["--json"], {}, []


def _json(config: TrainConfig, ctx: Context) -> tuple[Any, dict, list[Note]]:
    record = {"config": config.to_dict(), "short": config.short(), "device": ctx.device_type,
              "budget_bytes": ctx.budget_bytes, "model": ctx.model_spec, **ctx.extra}
    return record, {}, _optimizer_note(config, "autofit", "its TrainingPlan (and autofit's runners) replaces it")


_BUILDERS: dict[str, Callable[[TrainConfig, Context], tuple[Any, dict, list[Note]]]] = {
    "hf": _hf, "accelerate": _accelerate, "lightning": _lightning, "deepspeed": _deepspeed,
    "torchrun": _torchrun, "json": _json,
}


# --- rendering ----------------------------------------------------------------------------------


def _yaml(data: dict, indent: int = 0) -> str:
    """Flat-ish YAML without a YAML library: JSON scalars are valid YAML."""
    lines = []
    for key, value in data.items():
        if isinstance(value, dict):
            lines.append(" " * indent + f"{key}:")
            lines.append(_yaml(value, indent + 2).rstrip("\n"))
        else:
            lines.append(" " * indent + f"{key}: {json.dumps(value)}")
    return "\n".join(lines) + "\n"


def _render(target: str, kwargs: Any, extra: dict, comment: list[str]) -> str:
    if target == "accelerate":
        return "".join(f"# {line}\n" for line in comment) + _yaml(kwargs)
    if target == "torchrun":
        return "".join(f"# {line}\n" for line in comment) + shlex.join(kwargs) + "\n"
    if target == "hf":
        body = {"comment": comment, "training_arguments": kwargs}
    elif target == "lightning":
        body = {"comment": comment, "trainer": kwargs, **extra}
    else:  # deepspeed ignores unknown top-level keys; json is autofit's own record
        body = {"comment": comment, **kwargs}
    return json.dumps(body, indent=2) + "\n"


# --- entry points ---------------------------------------------------------------------------------


def _together(config: TrainConfig, notes: list[Note]) -> list[Note]:
    """With two or more inexact settings: the config the target's own settings give with none of
    the notes' code, all nearest settings at once (its peak is what running the export as-is risks)."""
    nearest = [n.nearest_config for n in notes if n.nearest_config is not None and n.nearest_config != config]
    if len(nearest) < 2:
        return []
    changes: dict = {}
    for other in nearest:
        changes.update({f: getattr(other, f) for f in FIELDS if getattr(other, f) != getattr(config, f)})
    combined = dataclasses.replace(config, **changes)
    return [Note("all together", "the export as it is, without the code of the notes above",
                 nearest=combined.short(), nearest_config=combined)]


def _peaks(notes: list[Note], ctx: Context) -> list[Note]:
    """Fill each note's nearest-setting peak from autofit's estimate (one profile for all)."""
    wanted = [n.nearest_config for n in notes if n.nearest_config is not None]
    if not wanted or (ctx.workload is None and not ctx.model_spec and ctx.profile is None):
        return [dataclasses.replace(n, budget_bytes=ctx.budget_bytes) for n in notes]
    from autofit.estimator.memory_model import needs_split_ends, optimizer_choices
    from autofit.estimator.memory_table import estimate_table
    from autofit.profiling.profile import profile_workload
    from autofit.workloads.load import load_workload

    precisions = sorted({c.precision for c in wanted}, key=str)
    split_ends = needs_split_ends(wanted)  # only where a note's config needs them (a search without splits skips them)
    optimizers = optimizer_choices(wanted)
    try:
        profile = (ctx.profile if profile_covers(ctx.profile, precisions, split_ends, ctx.device_type, optimizers)
                   else None)
        if profile is None:
            if ctx.workload is None and not ctx.model_spec:
                raise ConfigError(f"the profile given lacks {', '.join(p.value for p in precisions)} on {ctx.device_type} "
                                  "and no workload was given to profile")
            workload = ctx.workload if ctx.workload is not None else load_workload(ctx.model_spec)
            profile = profile_workload(workload, precisions, device_type=ctx.device_type, split_ends=split_ends,
                                       optimizers=optimizers)
    except AutofitError as exc:  # e.g. a cuda export on a CPU-only torch: the export itself still holds
        return [dataclasses.replace(n, budget_bytes=ctx.budget_bytes, no_peak_reason=str(exc)) for n in notes]
    table = estimate_table(profile, wanted, ctx.budget_bytes)
    peaks = iter(None if not row.valid else int(round(row.peak_bytes)) for row in table.itertuples())
    return [dataclasses.replace(n, budget_bytes=ctx.budget_bytes,
                                nearest_peak_bytes=next(peaks) if n.nearest_config is not None else None)
            for n in notes]


def profile_covers(profile: Any, precisions: list, split_ends: bool, device_type: str,
                   optimizers: list[str] = ()) -> bool:
    """Whether ``profile`` (a Profile or None) estimates every one of ``precisions`` (with the untied
    ends a pipeline split needs when ``split_ends``, and the ``optimizer`` lever's ``optimizers``) on
    ``device_type``."""
    if profile is None or profile.device_type != device_type:
        return False
    held = [profile.precisions.get(Precision(p).value) for p in precisions]
    return all(pp is not None and not (split_ends and pp.split_ends_skipped)
               and all(pp.optimizer_option(o) is not None for o in optimizers) for pp in held)


def export(config: TrainConfig | str | dict, target: str, *, workload: Any = None, budget: str | int | None = None,
           device: str | None = None, extra: dict | None = None, profile: Any = None) -> Export:
    """``config`` in ``target``'s own form (one of :data:`TARGETS`).

    ``workload`` (a Workload or a ``--model`` spec) lets notes give the estimated peak of the
    nearest setting a target can express; ``budget`` says whether it fits; ``device`` is where
    training runs (``cuda`` or ``cpu``; default cuda when this torch sees a GPU). ``profile``: the
    workload's :class:`autofit.profiling.data.Profile` on that device when known (a study's,
    :func:`autofit.profiling.cache.study_profile`): the peaks come from it when it holds their
    precisions, without profiling the workload. Raises ConfigError for an unknown target or config,
    or a torchrun export of a config that does not split.
    """
    if target not in TARGETS:
        raise ConfigError(f"unknown export target {target!r}: expected one of {', '.join(TARGETS)}")
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cuda", "cpu"):
        raise ConfigError(f"invalid device {device!r}: expected cuda or cpu")
    if isinstance(config, str):
        config = TrainConfig.parse(config)
    elif isinstance(config, dict):
        config = TrainConfig.from_dict(config)
    spec = workload if isinstance(workload, str) else getattr(workload, "source", None)
    ctx = Context(device_type=device, budget_bytes=parse_budget(budget) if budget is not None else None,
                  model_spec=spec, workload=None if isinstance(workload, str) else workload, extra=extra or {},
                  profile=profile)
    kwargs, extra_out, notes = _BUILDERS[target](config, ctx)
    notes = _peaks(notes + _together(config, notes), ctx)
    comment = [n.text() for n in notes]
    return Export(target, config, kwargs, extra_out, tuple(notes), _render(target, kwargs, extra_out, comment))


def export_study(out_dir: str | Path, target: str, *, storage: str | None = None,
                 override: str | None = None) -> Export:
    """The best config of the study in ``out_dir`` in ``target``'s form (see :func:`export`).

    ``override`` (``"micro_batch=4"``) changes fields of the best config. The workload, device
    and budget come from the study. Raises StudyError when the study has no best config yet.
    """
    from autofit.core.errors import StudyError
    from autofit.profiling.cache import study_profile
    from autofit.report.tables import best_record
    from autofit.study import load_snapshot

    study = load_snapshot(out_dir, storage=storage)
    best = best_record(study)
    settings = study.settings
    if best.get("config") is None and override is None:
        raise StudyError(f"study {study.study_name}: no config ran under the budget yet; nothing to export "
                         "(pass --config to export one anyway)")
    base = TrainConfig.from_dict(best["config"]) if best.get("config") else TrainConfig()
    config = TrainConfig.parse(override, base=base) if override else base
    extra = {"study": study.study_name}
    if best.get("config") and config == base:  # what was measured belongs only to the config that ran
        extra.update(trial=best.get("trial"), measured=best.get("measured"), predicted=best.get("predicted"))
    return export(config, target, workload=settings.get("workload_source"), budget=settings.get("budget_bytes"),
                  device=settings.get("device_type"), extra=extra, profile=study_profile(study))
