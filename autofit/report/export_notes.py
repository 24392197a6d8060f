"""What an export says beside its target's settings: notes (a setting the target cannot hold, with the
code that keeps it), changes (where the target trains differently, and by how much), the context.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autofit.core.budget import format_budget, format_bytes
from autofit.core.config import (
    CheckpointPolicy,
    Offload,
    OptimizerChoice,
    SplitMode,
    TrainConfig,
)

# The exact way to checkpoint runs of k layers (what autofit measured), for targets without it.
TORCHRUN_SCRIPT = "scripts/run_split_torchrun.py"  # autofit's runner of one process per pipeline stage
_BF16_CODE = ("model.to(torch.bfloat16)  # before the optimizer is made: weights, gradients and its state in bf16",)
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
class Change:
    """How the export as it is trains differently from the config: ``what`` (``global batch``,
    ``precision``, ``optimizer``) goes from ``before`` to ``after`` (``factor``: after/before for a
    number); ``why`` the target cannot say it, and ``keep``: the code that keeps it, if any."""

    what: str
    before: str
    after: str
    why: str
    keep: str = ""
    factor: float | None = None

    def text(self) -> str:
        """``global batch 64 -> 8 (x0.125): why; to keep it: code``."""
        out = f"{self.what} {self.before} -> {self.after}"
        if self.factor is not None:
            out += f" (x{self.factor:.4g})"
        out += f": {self.why}"
        if self.keep:
            out += f"; to keep {self.before}: {self.keep}"
        return out

    def to_dict(self) -> dict:
        return {"what": self.what, "before": self.before, "after": self.after, "factor": self.factor,
                "why": self.why, "keep": self.keep}


def _batch_change(config: TrainConfig, after: int, why: str, keep: str = "") -> Change:
    before = config.samples_per_step
    return Change("global batch", str(before), str(after), why, keep, after / before)


def _precision_change(config: TrainConfig, after: str, why: str, keep: str = "") -> Change:
    return Change("precision", config.precision.value, after, why, keep)


@dataclass(frozen=True)
class Export:
    """A config in a target's own form.

    - ``kwargs``: what the target takes (``TrainingArguments(**kwargs)``, ``Trainer(**kwargs)``,
      the DeepSpeed dict, the Accelerate config dict, torchrun's argv, autofit's record);
    - ``extra``: what goes beside it (Lightning: ``{"datamodule": {"batch_size": ...}}``);
    - ``notes``: what the target cannot say exactly; ``text``: the file or command as printed;
    - ``changes``: how the export as it is trains differently (global batch, precision, optimizer),
      said first in ``text`` (empty when it trains as measured).
    """

    target: str
    config: TrainConfig
    kwargs: Any
    extra: dict
    notes: tuple[Note, ...]
    text: str
    changes: tuple[Change, ...] = ()

    def comment(self) -> list[str]:
        """The notes as lines (the export's ``comment`` field)."""
        return [note.text() for note in self.notes]

    def warnings(self) -> list[str]:
        """The changes as lines (the export's ``changes`` field, first in the file)."""
        return [change.text() for change in self.changes]

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

    def optimizer_name(self) -> str | None:
        """The class name of the workload's optimizer (``AdamW``), from the profile or the workload;
        None when no workload is known (or it cannot be loaded)."""
        if self.profile is not None and getattr(self.profile, "optimizer", None):
            return self.profile.optimizer
        if self.workload is None and not self.model_spec:
            return None
        try:
            import torch

            from autofit.workloads.load import load_workload

            workload = self.workload if self.workload is not None else load_workload(self.model_spec)
            return type(workload.optimizer([torch.nn.Parameter(torch.zeros(1))])).__name__
        except Exception:  # noqa: BLE001 -- an optimizer that cannot be made here is not the export's concern
            return None


# --- per target: (kwargs, extra, notes without peaks, changes) -------------------------------------

# The Trainer's TrainingArguments.optim for a workload's optimizer class: None, its default (AdamW;
# Adam is AdamW without weight decay, the Trainer's default weight_decay=0.0); absent: it has none.
_HF_OPTIM = {"AdamW": None, "Adam": None, "SGD": "sgd", "Adagrad": "adagrad", "RMSprop": "rmsprop"}


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


# offload=optimizer as autofit runs it: torchao's CPUOffloadOptimizer over the optimizer's class and settings.
_OFFLOAD_CODE = ("from torchao.optim import CPUOffloadOptimizer  # pip install torchao",
                 "optimizer = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=lr, "
                 "weight_decay=weight_decay)  # your optimizer's class and settings",
                 "# or, from the optimizer you have: from autofit.runtime.offload import offload_optimizer; "
                 "optimizer = offload_optimizer(optimizer)")


def _offload_note(config: TrainConfig, target: str, in_target: str | None = None) -> list[Note]:
    """What a config with ``offload=optimizer`` says: where the state goes, and how the target gets it
    (``in_target``: the target's own setting, which is close but not the same optimizer)."""
    if config.offload is Offload.NONE:
        return []
    what = ("offload=optimizer: autofit measured torchao's CPUOffloadOptimizer (the state of parameters of "
            "4096 elements or more, and their step, on the host; pinned copies of them and their gradients)")
    why = f"; {in_target}" if in_target else f"; {target} has no such setting: make the optimizer in your code"
    return [Note("offload=optimizer", what + why, _OFFLOAD_CODE, "no offload (offload=none)",
                 dataclasses.replace(config, offload=Offload.NONE))]


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

