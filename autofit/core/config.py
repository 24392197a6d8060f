"""The training configuration autofit searches over: a frozen, validated dataclass."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from autofit.core.errors import ConfigError


class Precision(str, enum.Enum):
    """How a training step uses floating point.

    ``amp-*`` is ``torch.autocast`` over fp32 weights, gradients and optimizer state
    (plus a ``GradScaler`` for fp16); ``bf16`` keeps all of them in bfloat16.
    """

    FP32 = "fp32"
    AMP_FP16 = "amp-fp16"
    AMP_BF16 = "amp-bf16"
    BF16 = "bf16"

    def __str__(self) -> str:
        return self.value

    @property
    def is_amp(self) -> bool:
        return self in (Precision.AMP_FP16, Precision.AMP_BF16)


class SplitMode(str, enum.Enum):
    """How ``device_split`` devices share the model.

    ``pipeline``: the layers cut into contiguous stages, one per device, micro-batches flowing
    through them (:mod:`autofit.trial.pipeline`); ``fsdp``: every device runs the whole model on its
    own ``micro_batch`` samples (data parallel) with weights, gradients and optimizer state
    sharded over the devices by ``torch.distributed.fsdp.fully_shard`` (:mod:`autofit.trial.fsdp`).
    """

    PIPELINE = "pipeline"
    FSDP = "fsdp"

    def __str__(self) -> str:
        return self.value


class PipelineSchedule(str, enum.Enum):
    """How a device split runs its micro-batches. 1F1B holds at most ``p - i`` micro-batches'
    activations on stage ``i``; GPipe holds all ``grad_accum`` of them (Narayanan et al. SC'21,
    docs/facts.md#pipeline-schedules).

    Any case is accepted (``"1F1B"``, ``"GPipe"``).
    """

    ONE_F_ONE_B = "1f1b"
    GPIPE = "gpipe"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def _missing_(cls, value):
        if isinstance(value, str):
            for member in cls:
                if member.value == value.lower():
                    return member
        return None


class OptimizerChoice(str, enum.Enum):
    """Which optimizer a config trains with (the ``optimizer`` lever).

    ``as-given`` is the workload's own optimizer, whatever it is. The others replace it, so they
    change the training and are opt-in (the ``lean`` space): ``adafactor`` is
    ``torch.optim.Adafactor`` (factored second moments: a row and a column statistic per matrix);
    ``adamw8bit`` is bitsandbytes' 8-bit blockwise Adam (``bnb.optim.AdamW8bit`` for an AdamW,
    ``Adam8bit`` for an Adam; ``pip install 'autofit[optim]'``). Only a workload whose optimizer is
    ``torch.optim.Adam`` or ``AdamW`` can be replaced (:mod:`autofit.runtime.optimizers`).
    """

    AS_GIVEN = "as-given"
    ADAFACTOR = "adafactor"
    ADAMW8BIT = "adamw8bit"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def _missing_(cls, value):
        if isinstance(value, str):
            for member in cls:
                if member.value == value.lower().replace("_", "-"):
                    return member
        return None


class CheckpointPolicy(str, enum.Enum):
    """What a checkpointed segment keeps for backward (with ``checkpoint_every`` >= 1).

    ``full`` keeps only the segment's input and recomputes its whole forward; ``selective`` also
    keeps the outputs of the matrix multiplications and attention (torch's selective activation
    checkpointing, ``create_selective_checkpoint_contexts``) and recomputes only the cheap
    operators between them.
    """

    FULL = "full"
    SELECTIVE = "selective"

    def __str__(self) -> str:
        return self.value


class Offload(str, enum.Enum):
    """Where the optimizer's state lives (the ``offload`` lever, CUDA only).

    ``none`` keeps it on the device; ``optimizer`` keeps the state of every parameter of 4096 elements
    or more on the host, where its step runs, with pinned host copies of those parameters and their
    gradients (torchao's ``CPUOffloadOptimizer``; :mod:`autofit.runtime.offload`). The device keeps
    the weights, the gradients, and the smaller parameters' state.
    """

    NONE = "none"
    OPTIMIZER = "optimizer"

    def __str__(self) -> str:
        return self.value


FIELDS = ("precision", "micro_batch", "grad_accum", "checkpoint_every", "device_split", "split_mode",
          "optimizer", "checkpoint_policy", "offload")
# Fields holding enums: parsed by value, written as strings.
# Fields added later, with their defaults: left out of the text form where they hold them.
_LATER_DEFAULTS = {"optimizer": OptimizerChoice.AS_GIVEN.value, "checkpoint_policy": CheckpointPolicy.FULL.value,
                   "offload": Offload.NONE.value}
_ENUM_FIELDS = {"precision": Precision, "split_mode": SplitMode, "optimizer": OptimizerChoice,
                "checkpoint_policy": CheckpointPolicy, "offload": Offload}


@dataclass(frozen=True)
class TrainConfig:
    """One point of the search space. Field names are a public contract (also in JSON).

    - ``precision``: a :class:`Precision` (strings such as ``"amp-bf16"`` are accepted).
    - ``micro_batch`` >= 1: samples per forward/backward.
    - ``grad_accum`` >= 1: micro-batches per optimizer step.
    - ``checkpoint_every`` >= 0: 0 is off; k makes each run of k consecutive layers one
      checkpointed segment (``torch.utils.checkpoint``, non-reentrant).
    - ``device_split`` >= 1: the number of devices; with ``split_mode`` ``pipeline`` the layers
      are cut into that many contiguous stages, with ``fsdp`` that many data-parallel ranks
      shard the model.
    - ``split_mode``: a :class:`SplitMode` (default ``pipeline``; JSON written before the
      field existed loads as ``pipeline``).
    - ``optimizer``: an :class:`OptimizerChoice` (default ``as-given``, the workload's own; JSON
      written before the field existed loads as ``as-given``).
    - ``checkpoint_policy``: a :class:`CheckpointPolicy` (default ``full``; JSON written before the
      field existed loads as ``full``). Without checkpointing (``checkpoint_every`` 0) there is no
      segment to apply it to: it is always ``full`` there.
    - ``offload``: an :class:`Offload` (default ``none``; JSON written before the field existed loads
      as ``none``).

    Raises ConfigError on a bad value.
    """

    precision: Precision = Precision.FP32
    micro_batch: int = 1
    grad_accum: int = 1
    checkpoint_every: int = 0
    device_split: int = 1
    split_mode: SplitMode = SplitMode.PIPELINE
    optimizer: OptimizerChoice = OptimizerChoice.AS_GIVEN
    checkpoint_policy: CheckpointPolicy = CheckpointPolicy.FULL
    offload: Offload = Offload.NONE

    def __post_init__(self) -> None:
        for name, kind in _ENUM_FIELDS.items():
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, kind(str(value.value if isinstance(value, kind) else value).lower()))
            except ValueError:
                raise ConfigError(
                    f"invalid {name} {str(value)!r}: expected one of " + ", ".join(m.value for m in kind)
                ) from None
        for name, minimum in (("micro_batch", 1), ("grad_accum", 1), ("checkpoint_every", 0), ("device_split", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ConfigError(f"invalid {name} {value!r}: expected an integer >= {minimum}")
        if self.checkpoint_every == 0:  # nothing is checkpointed: one config, not two
            object.__setattr__(self, "checkpoint_policy", CheckpointPolicy.FULL)

    @property
    def changes_optimizer(self) -> bool:
        """Whether this config trains with another optimizer than the workload's own."""
        return self.optimizer is not OptimizerChoice.AS_GIVEN

    @property
    def build(self) -> tuple | None:
        """What building this config's model and optimizer depends on: precision, checkpointing, optimizer
        and offload. Configs with the same build differ only in batch shape and accumulation, so one
        process can time them all on one model (:mod:`autofit.trial.head_to_head`). None for a device
        split, whose stages are processes of their own."""
        if self.device_split != 1:
            return None
        return (self.precision, self.checkpoint_every, self.checkpoint_policy, self.optimizer, self.offload)

    @property
    def data_parallel(self) -> int:
        """Ranks that each run ``micro_batch`` samples per micro-step: ``device_split`` under fsdp, else 1."""
        return self.device_split if self.split_mode is SplitMode.FSDP else 1

    @property
    def samples_per_step(self) -> int:
        """Samples per optimizer step of the whole job: ``micro_batch × grad_accum`` (× the ranks under fsdp)."""
        return self.micro_batch * self.grad_accum * self.data_parallel

    def to_dict(self) -> dict:
        """The public fields, JSON-ready (enums as their string values)."""
        return {f: (v.value if isinstance(v, enum.Enum) else v) for f in FIELDS for v in (getattr(self, f),)}

    def to_text(self) -> str:
        """The ``k=v,...`` form :meth:`parse` reads (``--config``), e.g. for a command that reproduces it; the
        optimizer, checkpoint policy and offload only where they are not the defaults, so such a command reads
        as it did before they existed."""
        return ",".join(f"{k}={v}" for k, v in self.to_dict().items() if _LATER_DEFAULTS.get(k) != v)

    @classmethod
    def from_dict(cls, data: dict) -> "TrainConfig":
        """Build from a mapping of the public field names; unknown keys raise ConfigError. A field
        missing from the mapping (JSON written before it existed) takes its default."""
        unknown = set(data) - set(FIELDS)
        if unknown:
            raise ConfigError(f"unknown config key(s) {sorted(unknown)}: expected {', '.join(FIELDS)}")
        return cls(**data)

    @classmethod
    def from_row(cls, row) -> "TrainConfig":
        """From a table row (a mapping or a pandas Series) holding the field columns it has (a table
        from before a field existed lacks it: the default), numpy scalars as Python values."""
        return cls.from_dict({f: getattr(row[f], "item", lambda f=f: row[f])() for f in FIELDS if f in row})

    @classmethod
    def parse(cls, text: str, base: "TrainConfig | None" = None) -> "TrainConfig":
        """Parse ``"precision=amp-bf16,micro_batch=8"`` over ``base`` (default: the defaults).

        Raises ConfigError naming the bad part.
        """
        values: dict = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            key = key.strip().replace("-", "_")
            if not sep or not value.strip():
                raise ConfigError(f"invalid config item {part!r}: expected key=value, e.g. micro_batch=8")
            if key not in FIELDS:
                raise ConfigError(f"unknown config key {key!r}: expected one of {', '.join(FIELDS)}")
            value = value.strip()
            if key not in _ENUM_FIELDS:
                try:
                    value = int(value)
                except ValueError:
                    raise ConfigError(f"invalid {key} {value!r}: expected an integer") from None
            values[key] = value
        base = base or cls()
        policy = str(values.get("checkpoint_policy", "full")).lower()
        if policy != "full" and not values.get("checkpoint_every", base.checkpoint_every):
            raise ConfigError(f"checkpoint_policy={policy} needs checkpoint_every >= 1 (the layers per "
                              "checkpointed segment), e.g. checkpoint_every=1")
        return dataclasses.replace(base, **values)

    def short(self) -> str:
        """Compact one-line form, e.g. ``amp-bf16 mb=8 ga=4 ckpt=2 split=1`` (``fsdp=2`` for 2 FSDP ranks).

        The defaults of the later levers add nothing, so a config that uses none of them reads as it
        always did; otherwise ``ckpt=2/sel`` for selective checkpointing, then ``opt=adamw8bit`` and
        ``offload=opt`` at the end.
        """
        split = f"fsdp={self.device_split}" if self.split_mode is SplitMode.FSDP else f"split={self.device_split}"
        policy = "/sel" if self.checkpoint_policy is CheckpointPolicy.SELECTIVE else ""
        optimizer = f" opt={self.optimizer.value}" if self.changes_optimizer else ""
        offload = " offload=opt" if self.offload is Offload.OPTIMIZER else ""
        return (f"{self.precision.value} mb={self.micro_batch} ga={self.grad_accum} "
                f"ckpt={self.checkpoint_every}{policy} {split}{optimizer}{offload}")


def stage_bounds(n_layers: int, device_split: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` layer ranges, one per stage: ``stage_bounds(5, 2) == [(0, 3), (3, 5)]``.

    Balanced; the earlier stages take the extra layers, because the last stage also runs the
    final norm, the head and the loss (for a large vocabulary, as much compute as several
    layers), and the slowest stage sets a pipeline's pace. The pipeline runner and the memory
    and time models all use these bounds. Raises ConfigError when there are more stages than layers.
    """
    if isinstance(device_split, bool) or not isinstance(device_split, int) or device_split < 1:
        raise ConfigError(f"invalid device_split {device_split!r}: expected an integer >= 1")
    if device_split > n_layers:
        raise ConfigError(f"device_split={device_split} is more than the model's {n_layers} layers: "
                          "each pipeline stage needs at least one layer")
    base, extra = divmod(n_layers, device_split)
    bounds, start = [], 0
    for s in range(device_split):
        end = start + base + (1 if s < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds
