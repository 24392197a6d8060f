"""The accuracy suite's workloads and the configs measured on each: the two of the targets (a transformer
and a CNN), an RNN, tiny Hugging Face models and models written in a user's file; :func:`select_workloads`
picks some of them by parts of their names (``autofit bench --workloads``)."""

from __future__ import annotations

from autofit.core.config import CheckpointPolicy, Precision, TrainConfig
from autofit.core.errors import ConfigError

MAIN_WORKLOADS = ("gpt-tiny", "convnet-bn")
EXTRA_WORKLOADS = ("lstm-lm",)
# Tiny configs of seven Hugging Face families (six decoders, one vision encoder), built from their
# transformers config classes; the hf extra must be installed. Beside GPT-2, Llama and Qwen3: Phi
# (attention and MLP in parallel off one LayerNorm, rotary on half of each head, biased GELU MLP),
# Gemma (GeGLU, one key-value head, an embedding that scales itself, tied to the head) and Mixtral
# (a mixture of experts: top-2 of 4 SwiGLU experts per token, grouped-query attention).
HF_WORKLOADS = (
    "hf:gpt2?n_layer=4&n_embd=128&n_head=4&vocab_size=2048#seq_len=64",
    "hf:llama?num_hidden_layers=4&hidden_size=128&intermediate_size=344&num_attention_heads=4&num_key_value_heads=2"
    "&vocab_size=2048#seq_len=64",
    "hf:qwen3?num_hidden_layers=4&hidden_size=128&intermediate_size=344&num_attention_heads=4&num_key_value_heads=2"
    "&head_dim=32&vocab_size=2048#seq_len=64",
    "hf:phi?num_hidden_layers=4&hidden_size=128&intermediate_size=512&num_attention_heads=4&vocab_size=2048"
    "#seq_len=64",
    "hf:gemma?num_hidden_layers=4&hidden_size=128&intermediate_size=344&num_attention_heads=4&num_key_value_heads=1"
    "&head_dim=32&vocab_size=2048#seq_len=64",
    "hf:mixtral?num_hidden_layers=4&hidden_size=128&intermediate_size=256&num_attention_heads=4"
    "&num_key_value_heads=2&num_local_experts=4&num_experts_per_tok=2&vocab_size=2048#seq_len=64",
    "hf:vit?num_hidden_layers=4&hidden_size=128&num_attention_heads=4&intermediate_size=512&image_size=64&patch_size=8",
)
# Models written as a user would write them in a file (not built-ins), loaded by
# module path here so the tables name them the same on every machine; as files they load the
# same way (``--model path/to/vit.py:workload``).
USER_WORKLOADS = ("autofit.bench.user_models.vit:workload", "autofit.bench.user_models.mixer:workload",
                  "autofit.bench.user_models.resnet:workload")


def _c(precision: str, micro_batch: int, grad_accum: int = 1, checkpoint_every: int = 0,
       device_split: int = 1, split_mode: str = "pipeline", optimizer: str = "as-given",
       checkpoint_policy: str = "full") -> TrainConfig:
    return TrainConfig(Precision(precision), micro_batch, grad_accum, checkpoint_every, device_split, split_mode,
                       optimizer, checkpoint_policy)


def _lean(micro_batch: int) -> list[tuple]:
    """The lean levers (``--space lean``): each replacement optimizer alone and with accumulation and
    checkpointing, selective checkpointing at 1 and 2 layers a segment, both levers together, and a
    pipeline split of each. ``offload`` is not here: it means nothing on the CPU, where this suite runs."""
    half = max(1, micro_batch // 2)
    return [("fp32", micro_batch, 1, 0, 1, "pipeline", "adafactor"),
            ("bf16", micro_batch, 1, 0, 1, "pipeline", "adafactor"),
            ("amp-bf16", half, 2, 1, 1, "pipeline", "adafactor"),
            ("fp32", micro_batch, 1, 0, 1, "pipeline", "adamw8bit"),
            ("amp-bf16", micro_batch, 1, 0, 1, "pipeline", "adamw8bit"),
            ("bf16", half, 2, 2, 1, "pipeline", "adamw8bit"),
            ("fp32", micro_batch, 1, 1, 1, "pipeline", "as-given", "selective"),
            ("amp-bf16", micro_batch, 1, 2, 1, "pipeline", "as-given", "selective"),
            ("bf16", micro_batch, 1, 1, 1, "pipeline", "adamw8bit", "selective"),
            ("fp32", half, 2, 0, 2, "pipeline", "adafactor"),
            ("amp-bf16", half, 2, 1, 2, "pipeline", "adamw8bit", "selective")]


def _fsdp_cases(micro_batch: int) -> list[tuple]:
    """FSDP at 2 and 4 ranks, every precision, checkpointing off and on (amp-fp16 at micro-batch 1)."""
    return [(p, 1 if p == "amp-fp16" else micro_batch, 1, ckpt, ranks, "fsdp")
            for p in ("fp32", "amp-bf16", "bf16", "amp-fp16") for ranks in (2, 4) for ckpt in (0, 1)]


# (precision, micro_batch, grad_accum, checkpoint_every, device_split[, split_mode])
_CASES = {
    "gpt-tiny": [
        ("fp32", 1), ("fp32", 4), ("fp32", 8), ("fp32", 8, 1, 1), ("fp32", 8, 1, 2), ("fp32", 2, 4),
        ("fp32", 4, 2, 1),
        ("amp-bf16", 1), ("amp-bf16", 4), ("amp-bf16", 8), ("amp-bf16", 8, 1, 1), ("amp-bf16", 4, 3, 2),
        ("bf16", 2), ("bf16", 8), ("bf16", 8, 1, 1), ("bf16", 4, 2),
        ("amp-fp16", 1), ("amp-fp16", 1, 2), ("amp-fp16", 2, 1, 1),
        ("fp32", 4, 2, 0, 2), ("amp-bf16", 4, 2, 1, 2), ("bf16", 2, 2, 0, 2), ("amp-fp16", 1, 2, 0, 2),
        *_fsdp_cases(2),
    ],
    "convnet-bn": [
        ("fp32", 4), ("fp32", 16), ("fp32", 32), ("fp32", 32, 1, 1), ("fp32", 32, 1, 2), ("fp32", 8, 4),
        ("fp32", 16, 2, 1),
        ("amp-bf16", 4), ("amp-bf16", 16), ("amp-bf16", 32), ("amp-bf16", 32, 1, 1), ("amp-bf16", 16, 3, 2),
        ("bf16", 8), ("bf16", 32), ("bf16", 32, 1, 1), ("bf16", 16, 2),
        ("amp-fp16", 1), ("amp-fp16", 1, 2, 1),
        ("fp32", 16, 2, 0, 2), ("amp-bf16", 16, 2, 1, 2), ("bf16", 8, 2, 0, 2),
        *_fsdp_cases(8),
    ],
    "lstm-lm": [
        ("fp32", 4), ("fp32", 16), ("fp32", 16, 1, 1), ("fp32", 8, 2),
        ("amp-bf16", 16), ("amp-bf16", 16, 1, 1), ("bf16", 16), ("bf16", 8, 2, 1),
        ("amp-fp16", 2),
        ("fp32", 8, 2, 0, 2), ("amp-bf16", 8, 2, 0, 2),
    ],
}
_HF_DECODER_CASES = [
    ("fp32", 4), ("fp32", 4, 1, 1), ("fp32", 4, 1, 2), ("amp-bf16", 4), ("amp-bf16", 4, 1, 1), ("amp-bf16", 4, 2, 2),
    ("bf16", 4, 2), ("bf16", 4, 1, 2), ("amp-fp16", 2), ("amp-fp16", 2, 1, 1),
    # split 2: every precision, checkpointing at 1 and 2, 1F1B with k = p and k > p micro-batches
    ("fp32", 2, 2, 0, 2), ("amp-bf16", 2, 2, 1, 2), ("fp32", 2, 4, 2, 2), ("bf16", 2, 3, 0, 2),
    ("amp-fp16", 1, 2, 0, 2),
]
_HF_ENCODER_CASES = [("fp32", 8), ("fp32", 8, 1, 1), ("fp32", 8, 1, 2), ("amp-bf16", 8, 2), ("amp-bf16", 8, 1, 2),
                     ("bf16", 8), ("bf16", 8, 2, 1), ("amp-fp16", 4)]
_CASES.update({w: _HF_ENCODER_CASES if w.startswith("hf:vit") else _HF_DECODER_CASES for w in HF_WORKLOADS})
_USER_CASES = [("fp32", 16), ("fp32", 16, 1, 1), ("fp32", 16, 1, 2), ("fp32", 8, 2), ("amp-bf16", 16),
               ("amp-bf16", 16, 1, 1), ("bf16", 16), ("bf16", 8, 2, 2), ("amp-fp16", 4),
               ("fp32", 8, 2, 0, 2), ("amp-bf16", 8, 4, 1, 2), ("bf16", 8, 2, 2, 2), ("amp-fp16", 2, 2, 0, 2)]
_CASES.update({w: _USER_CASES for w in USER_WORKLOADS})
# The lean levers on a GPT built-in, a Llama-style hf: model and a model from a user's file (the ViT,
# whose optimizer is AdamW; the MLP-Mixer's RMSprop is one the optimizer lever does not replace).
LEAN_WORKLOADS = ("gpt-tiny", HF_WORKLOADS[1], USER_WORKLOADS[0])
for _w, _mb in zip(LEAN_WORKLOADS, (4, 4, 8)):
    _CASES[_w] = _CASES[_w] + _lean(_mb)

_QUICK_CASES = {
    "gpt-tiny": [("fp32", 4), ("amp-bf16", 4, 2, 1), ("bf16", 4), ("amp-fp16", 1), ("fp32", 2, 2, 0, 2),
                 ("bf16", 4, 1, 1, 1, "pipeline", "adamw8bit", "selective")],
    "convnet-bn": [("fp32", 16, 1, 1), ("amp-bf16", 16, 2), ("bf16", 16)],
    "lstm-lm": [("fp32", 8)],
    USER_WORKLOADS[1]: [("amp-bf16", 8, 2, 0, 2)],
}


def cases(quick: bool = False, workloads: tuple[str, ...] | None = None,
          lean_only: bool = False) -> dict[str, list[TrainConfig]]:
    """The configs measured per workload (``lean_only``: only those using a lean lever, on the workloads that have some)."""
    table = _QUICK_CASES if quick else _CASES
    names = workloads or tuple(w for w in table if not w.startswith("hf:") or _has_transformers())
    out = {w: [_c(*args) for args in table[w]] for w in names}
    if lean_only:
        out = {w: [c for c in configs if is_lean(c)] for w, configs in out.items()}
    return {w: configs for w, configs in out.items() if configs}


def is_lean(config: TrainConfig) -> bool:
    """Whether ``config`` uses a lean lever (another optimizer, selective checkpointing)."""
    return config.changes_optimizer or config.checkpoint_policy is CheckpointPolicy.SELECTIVE


def select_workloads(selectors: tuple[str, ...], quick: bool = False) -> tuple[str, ...]:
    """The suite's workloads whose name contains one of ``selectors`` (e.g. ``hf:``, ``user_models``).

    Raises ConfigError naming a selector that matches none, with the names it could match."""
    names = tuple(_QUICK_CASES if quick else _CASES)
    for sel in selectors:
        if not any(sel in w for w in names):
            raise ConfigError(f"--workloads {sel!r} matches none of the accuracy suite's workloads"
                              f"{' (--quick)' if quick else ''}: {', '.join(names)}")
    return tuple(w for w in names if any(sel in w for sel in selectors))


def _has_transformers() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformers") is not None
