"""A Hugging Face ``transformers`` model as an autofit Workload, from its config alone.

The model is the ``transformers`` class as it is (``LlamaForCausalLM``, ``ViTForImageClassification``…),
built with random initialisation from the config (on fake tensors when profiling); no weights
are ever read. Tasks:

- ``causal-lm`` (default for decoders): random token ids of ``seq_len``, labels = inputs, the
  model class's own loss (``ForCausalLMLoss``: shift, fp32 upcast, cross-entropy);
- ``seq-cls`` (default for encoders such as BERT): token ids, one class label per sample;
- ``image-cls`` (default for vision models such as ViT): random pixels, one label per sample.

The optimizer is AdamW over the trainable parameters. ``lora="r=8"`` wraps the model with a
``peft`` LoRA adapter (base weights frozen); see :func:`parse_lora`.
"""

from __future__ import annotations

import contextlib
import copy
import re
from dataclasses import dataclass
from typing import Any

import torch

from autofit.core.errors import WorkloadError
from autofit.workloads.base import Workload
from autofit.workloads.hf.spec import (
    PREFIX,
    parse_value,
    require_transformers,
    resolve_config,
    split_source,
)
from autofit.workloads.hf.stages import cut_stage

TASKS = ("causal-lm", "seq-cls", "image-cls")
DEFAULT_SEQ_LEN = 512
# Config fields that bound the sequence length, in the order families name them.
_MAX_POSITIONS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")
_LORA_KEYS = {"r": int, "alpha": int, "dropout": float, "target": str}


def _mappings():
    from transformers.models.auto import modeling_auto as m

    return {"causal-lm": m.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
            "seq-cls": m.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
            "image-cls": m.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
            "masked-lm": m.MODEL_FOR_MASKED_LM_MAPPING_NAMES}


def default_task(config) -> str:
    """Causal LM for decoders; sequence classification for encoders (they have a masked-LM
    head); image classification for vision models."""
    maps, model_type = _mappings(), config.model_type
    if model_type in maps["causal-lm"] and model_type not in maps["masked-lm"]:
        return "causal-lm"
    for task in ("seq-cls", "image-cls", "causal-lm"):
        if model_type in maps[task]:
            return task
    raise WorkloadError(f"hf: model_type {model_type!r} has no causal-LM, sequence- or image-classification "
                        "class in transformers")


def default_seq_len(config) -> int:
    for name in _MAX_POSITIONS:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return DEFAULT_SEQ_LEN


def parse_lora(text: str | None) -> dict | None:
    """``"r=8"`` or ``"r=8,alpha=16,dropout=0.05,target=q_proj+v_proj"`` -> keyword arguments of
    ``peft.LoraConfig``. ``target`` defaults to peft's own choice for the model type."""
    if text is None or text == "":
        return None
    values: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in str(text).split(","))):
        key, sep, value = item.partition("=")
        if key not in _LORA_KEYS or not sep:
            raise WorkloadError(f"invalid --lora item {item!r}: expected r=N[,alpha=N][,dropout=X][,target=a+b]")
        try:
            values[key] = _LORA_KEYS[key](value)
        except ValueError:
            raise WorkloadError(f"invalid --lora {key} {value!r}: expected {_LORA_KEYS[key].__name__}") from None
    if values.get("r", 0) < 1:
        raise WorkloadError(f"invalid --lora {text!r}: r must be a positive integer, e.g. --lora r=8")
    return {"r": values["r"], "lora_alpha": values.get("alpha", 2 * values["r"]),
            "lora_dropout": values.get("dropout", 0.0),
            "target_modules": values["target"].split("+") if "target" in values else None}


@dataclass(frozen=True)
class HFModel:
    """Builds the model: picklable (a trial process may rebuild it) and cheap to call."""

    config: Any
    task: str
    lora: dict | None = None

    def __call__(self) -> torch.nn.Module:
        transformers = require_transformers()
        auto = {"causal-lm": transformers.AutoModelForCausalLM,
                "seq-cls": transformers.AutoModelForSequenceClassification,
                "image-cls": transformers.AutoModelForImageClassification}[self.task]
        # from_config builds in torch's default dtype, which autofit sets (fp32 or bf16). On fake
        # tensors (profiling) initial values do not exist, and some initialisers (ViT's
        # trunc_normal_) read values: skip initialisation there.
        from torch._guards import detect_fake_mode
        from transformers.initialization import no_init_weights

        skip_init = no_init_weights() if detect_fake_mode() is not None else contextlib.nullcontext()
        with skip_init:
            model = auto.from_config(copy.deepcopy(self.config), dtype=torch.get_default_dtype())
        if detect_fake_mode() is not None:
            # no_init_weights also skips the tying that init_weights does: without it the fake
            # model's head (tie_word_embeddings) is a second weight the real model does not have.
            model.tie_weights(recompute_mapping=False)
        masks_as_on_real_tensors(model)
        if self.lora is not None:
            model = _with_lora(model, self.lora, self.task)
        return model


def _with_lora(model, lora: dict, task: str):
    try:
        import peft
    except ImportError:
        raise WorkloadError("--lora needs peft: pip install 'autofit[hf]'") from None
    task_type = {"causal-lm": "CAUSAL_LM", "seq-cls": "SEQ_CLS", "image-cls": None}[task]
    config = peft.LoraConfig(task_type=task_type, **lora)
    if task == "image-cls":  # peft has no task type for it: train the new classifier head too
        config.modules_to_save = ["classifier"]
    try:
        with _adapters_stay_put(model):
            return peft.get_peft_model(model, config)
    except ValueError as exc:
        raise WorkloadError(f"--lora: peft cannot adapt {type(model).__name__}: {exc}") from None


def masks_as_on_real_tensors(model: torch.nn.Module) -> None:
    """Make the model build its attention mask on fake tensors as it does on real ones.

    ``transformers`` treats a fake tensor as tracing, and while tracing it cannot rule out packed
    sequences (a data-dependent check on ``position_ids``), so it materialises a
    (batch, 1, seq, seq) mask and hands it to attention, where real tensors pass none (SDPA's
    ``is_causal``). The profile would then see memory the real step never allocates (measured:
    +14% on a 2-layer Llama at sequence 32). autofit's batches pass no ``position_ids`` (the model
    makes them with ``arange``: never packed), so during a forward on fake tensors the packed-
    sequence check answers what it answers on the real ones: not packed."""
    try:
        from transformers import masking_utils
    except ImportError:
        return
    if not hasattr(masking_utils, "find_packed_sequence_indices"):
        return
    from torch._subclasses.fake_tensor import FakeTensor

    saved: list = []

    def before(module, args, kwargs):
        first = args[0] if args else next(iter(kwargs.values()), None)
        if isinstance(first, FakeTensor):
            saved.append(masking_utils.find_packed_sequence_indices)
            masking_utils.find_packed_sequence_indices = lambda position_ids: None

    def after(module, args, kwargs, output):
        if saved:
            masking_utils.find_packed_sequence_indices = saved.pop()

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True, always_call=True)


@contextlib.contextmanager
def _adapters_stay_put(model):
    """peft moves each new adapter to its base layer's device and dtype with ``Module.to``; on
    fake tensors (profiling) ``Module.to`` cannot swap parameters and raises, even when nothing
    would change. The adapters are created under the model's default device and dtype, so the
    move is a no-op there: while peft wraps a fake model, ``Module.to`` returns a module that is
    already on the target device and dtype unchanged."""
    from torch._subclasses.fake_tensor import FakeTensor

    if not any(isinstance(p, FakeTensor) for p in model.parameters()):
        yield
        return
    original = torch.nn.Module.to

    def to_if_needed(self, *args, **kwargs):
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        tensors = list(self.parameters()) + list(self.buffers())
        if all((device is None or t.device == device) and (dtype is None or t.dtype == dtype or not t.is_floating_point())
               for t in tensors):
            return self
        return original(self, *args, **kwargs)

    torch.nn.Module.to = to_if_needed
    try:
        yield
    finally:
        torch.nn.Module.to = original


@dataclass(frozen=True)
class HFBatch:
    """Random inputs and labels for ``n`` samples (token ids, or pixels for vision)."""

    config: Any
    task: str
    seq_len: int

    def __call__(self, n: int):
        c = self.config
        if self.task == "image-cls":
            size = c.image_size if isinstance(c.image_size, int) else c.image_size[0]
            return torch.randn(n, c.num_channels, size, size), torch.randint(0, c.num_labels, (n,))
        ids = torch.randint(0, c.vocab_size, (n, self.seq_len))
        if self.task == "causal-lm":
            return ids, ids  # labels = inputs; the loss shifts them
        return ids, torch.randint(0, c.num_labels, (n,))


@dataclass(frozen=True)
class HFLoss:
    """The loss the model class computes when given labels (``transformers.loss.LOSS_MAPPING``)."""

    config: Any
    task: str

    def __call__(self, outputs, labels) -> torch.Tensor:
        from transformers.loss.loss_utils import LOSS_MAPPING

        logits = getattr(outputs, "logits", outputs)
        if self.task == "causal-lm":
            return LOSS_MAPPING["ForCausalLM"](logits, labels, vocab_size=self.config.vocab_size)
        return LOSS_MAPPING["ForSequenceClassification"](labels, logits, self.config)


def trainable_adamw(params) -> torch.optim.Optimizer:
    """AdamW over the parameters that train: frozen ones (LoRA's base) get no state."""
    return torch.optim.AdamW([p for p in params if p.requires_grad])


def trial_modules(config, lora: bool) -> tuple[str, ...]:
    """What a trial of this model imports, slowest first: transformers' model machinery (seconds: it
    brings in its quantizer integrations, torchao's among them when installed), the model type's
    own modelling module (named after its configuration module, transformers' layout) and peft."""
    modeling = type(config).__module__.replace(".configuration_", ".modeling_")
    return ("transformers", "transformers.modeling_utils",
            *((modeling,) if modeling.startswith("transformers.models.") else ()), *(("peft",) if lora else ()))


def _prepare_config(config, task: str):
    config = copy.deepcopy(config)
    config.use_cache = False  # training: no KV cache kept alongside the activations
    if task == "seq-cls":
        config.problem_type = "single_label_classification"
        if getattr(config, "pad_token_id", None) is None:
            config.pad_token_id = 0  # decoders pool at the last non-pad token; ids are random anyway
    if task == "image-cls":
        config.problem_type = "single_label_classification"
    return config


def hf_workload(spec: str, *, seq_len: int | None = None, task: str | None = None,
                lora: str | dict | None = None) -> Workload:
    """A Workload for a Hugging Face model (see :mod:`autofit.workloads.hf.spec` for ``spec``).

    >>> w = hf_workload("gpt2?n_layer=4&n_embd=256&n_head=4", seq_len=128)   # doctest: +SKIP
    >>> w = hf_workload("llama", lora="r=8")                                 # doctest: +SKIP

    ``spec`` may start with ``hf:``. ``seq_len`` defaults to the config's maximum positions
    (else 512). ``task``: one of ``causal-lm``, ``seq-cls``, ``image-cls`` (default from the
    model type). ``lora``: ``"r=8[,alpha=16][,dropout=0.05][,target=q_proj+v_proj]"``.
    Raises WorkloadError with a one-line reason.
    """
    spec = spec[len(PREFIX):] if spec.startswith(PREFIX) else spec
    config = resolve_config(spec)
    task = task or default_task(config)
    if task not in TASKS:
        raise WorkloadError(f"invalid task {task!r}: expected one of {', '.join(TASKS)}")
    if task != "image-cls" and not hasattr(config, "vocab_size"):
        raise WorkloadError(f"hf:{spec}: task {task} needs a text model (the config has no vocab_size)")
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1):
        raise WorkloadError(f"invalid seq_len {seq_len!r}: expected a positive integer")
    seq_len = seq_len or default_seq_len(config)
    lora_text = lora if isinstance(lora, str) or lora is None else ",".join(f"{k}={v}" for k, v in lora.items())
    lora_kwargs = parse_lora(lora_text)
    config = _prepare_config(config, task)
    options = {"seq_len": seq_len, "task": task, **({"lora": lora_text} if lora_kwargs else {})}
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", spec.partition("?")[0].rstrip("/").split("/")[-1]) or "model"
    return Workload(
        name=f"hf-{base}" + ("-lora" if lora_kwargs else ""),
        model=HFModel(config, task, lora_kwargs),
        batch=HFBatch(config, task, seq_len),
        loss=HFLoss(config, task),
        optimizer=trainable_adamw,
        tokens_per_sample=None if task == "image-cls" else seq_len,
        description=f"{type(config).__name__} {task}" + (f" seq {seq_len}" if task != "image-cls" else "")
        + (f", LoRA {lora_text}" if lora_kwargs else ""),
        meta={"kind": "huggingface", "task": task, "model_type": config.model_type,
              "seq_len": seq_len, "lora": lora_text},
        source=PREFIX + spec + "".join(f"#{k}={v}" for k, v in options.items()),
        split=cut_stage,  # refuses, with the reason, what it cannot cut (encoders, adapters, other layouts)
        preload=trial_modules(config, bool(lora_kwargs)),
    )


def load_hf_source(source: str) -> Workload:
    """Rebuild a workload from its ``source`` (``hf:SPEC#seq_len=128#task=causal-lm#lora=r=8``)."""
    model, options = split_source(source if source.startswith(PREFIX) else PREFIX + source)
    values: dict[str, Any] = {k: parse_value(v) if k == "seq_len" else v for k, v in options.items()}
    return hf_workload(model, **values)


__all__ = ["TASKS", "HFBatch", "HFLoss", "HFModel", "default_seq_len", "default_task", "hf_workload",
           "load_hf_source", "parse_lora", "trainable_adamw"]
