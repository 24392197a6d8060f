"""A decoder-only transformer family (GPT-2 and Llama shapes) and its built-in presets.

One short model in the style of nanoGPT. Shapes in comments: B batch, T sequence length,
C = n_embd, nh query heads, nkv key/value heads, hs = C // nh head size, V vocabulary.

Memory notes (why the code looks the way it does):

- Dropout is ``torch.native_dropout``, which returns a bool mask and saves only that for
  backward: 1 byte per element on every device, as CUDA's fused kernel and Korthikanti et al.
  2022 (arXiv 2205.05198) assume. ``F.dropout`` on the CPU keeps the mask in the input's dtype.
- ``attention="plain"`` saves what Korthikanti Eq. 1 counts and nothing more: the 1/sqrt(hs)
  scale multiplies by a Python float (saves nothing) and the causal mask is a bool buffer,
  sliced (a view, no new storage per step).
- ``attention="sdpa"`` with dropout on the CPU leaves the flash kernel for the math backend,
  which saves fp32 (T, T) scores, dropout mask and output per head (12·a·s²·b bytes, even under
  bf16); CUDA's flash/efficient kernels save none of them. Without dropout the CPU uses its flash
  kernel too (saves q, k, v, output and the log-sum-exp), like CUDA.
- Weight init uses in-place ``nn.init`` calls only, so a model builds on the ``meta`` device and
  under ``FakeTensorMode`` without allocating real weights.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autofit.core.errors import WorkloadError
from autofit.workloads.base import Workload

NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rotary")
MLPS = ("gelu", "swiglu")
ATTENTIONS = ("sdpa", "plain")


@dataclass(frozen=True)
class GPTConfig:
    """Hyper-parameters of :class:`GPT`. ``None`` fields take the defaults described below.

    - ``n_kv_head``: key/value heads (grouped-query attention); ``None`` means ``n_head``.
    - ``ffn_hidden``: MLP hidden width; ``None`` means 4·n_embd for gelu and, for swiglu,
      2/3 of that rounded up to a multiple of 256 (the Llama rule).
    - ``attention``: ``"sdpa"`` (``F.scaled_dot_product_attention``) or ``"plain"``
      (explicit q·kᵀ, scale, causal mask, softmax, dropout, ·v).

    Raises WorkloadError on an inconsistent combination.
    """

    vocab_size: int = 4096
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int | None = None
    n_embd: int = 256
    ffn_hidden: int | None = None
    norm: str = "layernorm"
    position: str = "learned"
    mlp: str = "gelu"
    attention: str = "sdpa"
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name, allowed in (("norm", NORMS), ("position", POSITIONS), ("mlp", MLPS), ("attention", ATTENTIONS)):
            if getattr(self, name) not in allowed:
                raise WorkloadError(f"GPTConfig.{name}={getattr(self, name)!r}: expected one of {', '.join(allowed)}")
        if self.n_embd % self.n_head:
            raise WorkloadError(f"GPTConfig: n_embd {self.n_embd} is not divisible by n_head {self.n_head}")
        if self.n_head % self.kv_heads:
            raise WorkloadError(f"GPTConfig: n_head {self.n_head} is not divisible by n_kv_head {self.kv_heads}")
        if self.position == "rotary" and self.head_size % 2:
            raise WorkloadError(f"GPTConfig: rotary positions need an even head size, got {self.head_size}")
        if not 0.0 <= self.dropout < 1.0:
            raise WorkloadError(f"GPTConfig.dropout={self.dropout!r}: expected 0 <= p < 1")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    @property
    def ffn_width(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        if self.mlp == "gelu":
            return 4 * self.n_embd
        return 256 * math.ceil(2 * 4 * self.n_embd / 3 / 256)


class Dropout(nn.Module):
    """Dropout that saves a 1-byte bool mask for backward on every device (see module doc)."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.p == 0.0 or not self.training:
            return x
        return torch.native_dropout(x, self.p, True)[0]

    def extra_repr(self) -> str:
        return f"p={self.p}"


def _norm(cfg: GPTConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps, bias=cfg.bias)


def _embedding(num: int, dim: int) -> nn.Embedding:
    # uninitialised: GPT._init_weights fills it (nn.Embedding's own init would run normal_ once more)
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    """Causal self-attention with optional grouped-query heads and rotary positions."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_size = cfg.n_head, cfg.kv_heads, cfg.head_size
        self.attention, self.dropout_p = cfg.attention, cfg.dropout
        # q, k and v in one matmul (nanoGPT's c_attn); with GQA k and v are narrower than q
        self.c_attn = nn.Linear(cfg.n_embd, (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_size, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.attn_dropout = Dropout(cfg.dropout)
        self.resid_dropout = Dropout(cfg.dropout)
        self.rotary = cfg.position == "rotary"
        # Buffers are left empty on the meta device: arange/triu there are slow Python decompositions
        on_meta = self.c_attn.weight.is_meta
        if self.rotary:
            # rotate-half RoPE tables for positions 0..seq_len-1, (T, hs); non-persistent: not in the state_dict
            self.register_buffer("rope_cos", torch.empty(cfg.seq_len, cfg.head_size), persistent=False)
            self.register_buffer("rope_sin", torch.empty(cfg.seq_len, cfg.head_size), persistent=False)
            if not on_meta:
                inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_size, 2, dtype=torch.float32) / cfg.head_size)
                angles = torch.outer(torch.arange(cfg.seq_len, dtype=torch.float32), inv_freq)
                angles = torch.cat((angles, angles), dim=-1)
                self.rope_cos.copy_(angles.cos())
                self.rope_sin.copy_(angles.sin())
        if cfg.attention == "plain":
            # True above the diagonal = masked; sliced per step so masked_fill saves a view, not a copy
            self.register_buffer("causal_mask", torch.empty(cfg.seq_len, cfg.seq_len, dtype=torch.bool),
                                 persistent=False)
            if not on_meta:
                self.causal_mask.copy_(torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool).triu(diagonal=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(
            [self.n_head * self.head_size, self.n_kv_head * self.head_size, self.n_kv_head * self.head_size], dim=2)
        q = q.view(B, T, self.n_head, self.head_size).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_kv_head, self.head_size).transpose(1, 2)  # (B, nkv, T, hs)
        v = v.view(B, T, self.n_kv_head, self.head_size).transpose(1, 2)  # (B, nkv, T, hs)
        if self.rotary:
            cos, sin = self.rope_cos[:T].to(q.dtype), self.rope_sin[:T].to(q.dtype)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout_p if self.training else 0.0, is_causal=True,
                enable_gqa=self.n_kv_head != self.n_head)
        else:
            if self.n_kv_head != self.n_head:  # each kv head serves n_head // n_kv_head query heads
                k = k.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
                v = v.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_size))  # (B, nh, T, T)
            att = att.masked_fill(self.causal_mask[:T, :T], float("-inf"))
            att = self.attn_dropout(F.softmax(att, dim=-1))
            y = att @ v  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """GeLU MLP (GPT-2) or SwiGLU (Llama: down(silu(gate(x)) * up(x)))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        self.c_fc = nn.Linear(cfg.n_embd, cfg.ffn_width, bias=cfg.bias)
        if self.swiglu:
            self.c_gate = nn.Linear(cfg.n_embd, cfg.ffn_width, bias=cfg.bias)
        else:
            self.gelu = nn.GELU()
        self.c_proj = nn.Linear(cfg.ffn_width, cfg.n_embd, bias=cfg.bias)
        self.dropout = Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.c_gate(x)) * self.c_fc(x) if self.swiglu else self.gelu(self.c_fc(x))
        return self.dropout(self.c_proj(h))


class Block(nn.Module):
    """Pre-norm transformer block: one tensor (B, T, C) in, one out."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = _norm(cfg)
        self.attn = Attention(cfg)
        self.ln_2 = _norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """Token ids (B, T) → logits (B, T, V)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = _embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = _embedding(cfg.seq_len, cfg.n_embd) if cfg.position == "learned" else None
        self.drop = Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = _norm(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        if not self.wte.weight.is_meta:  # nothing to fill on meta; normal_ there is a slow Python decomposition
            self.apply(self._init_weights)
            # GPT-2: residual projections scaled by 1/sqrt(2·n_layer)
            for block in self.blocks:
                for proj in (block.attn.c_proj, block.mlp.c_proj):
                    nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length {T} exceeds the model's seq_len {self.cfg.seq_len}")
        x = self.wte(idx)  # (B, T, C)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(T, device=idx.device))
        x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, V)


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _adamw(params) -> torch.optim.Optimizer:
    # nanoGPT: decay matrices and embeddings, not biases or norm gains
    params = [p for p in params if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=3e-4, betas=(0.9, 0.95))


def gpt_workload(cfg: GPTConfig, name: str, description: str = "") -> Workload:
    """A language-modelling Workload for :class:`GPT` with random token batches.

    ``batch(n)`` is ``(idx, targets)``, both int64 (n, seq_len), drawn with ``torch.randint``
    (no Generator, so it also works under ``FakeTensorMode``).
    """

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randint(cfg.vocab_size, (n, cfg.seq_len), dtype=torch.int64),
                torch.randint(cfg.vocab_size, (n, cfg.seq_len), dtype=torch.int64))

    return Workload(
        name=name, model=lambda: GPT(cfg), batch=batch, loss=_lm_loss, optimizer=_adamw,
        layers=lambda model: model.blocks, tokens_per_sample=cfg.seq_len, description=description,
        meta={"kind": "transformer", **dataclasses.asdict(cfg)},
    )


_GPT2 = dict(vocab_size=50257, seq_len=1024, norm="layernorm", position="learned", mlp="gelu",
             dropout=0.1, bias=True, tie_embeddings=True)
_LLAMA = dict(norm="rmsnorm", position="rotary", mlp="swiglu", dropout=0.0, bias=False)

# name -> (config, description). gpt-tiny and gpt-mini have no dropout: with dropout, CPU SDPA
# leaves its flash kernel for the math backend (fp32 s² tensors and masks saved), unlike CUDA.
PRESETS: dict[str, tuple[GPTConfig, str]] = {
    "gpt-tiny": (GPTConfig(vocab_size=4096, seq_len=128, n_layer=4, n_head=4, n_embd=192),
                 "4-layer GPT, d=192, seq 128, vocab 4096: about 0.1 s per fp32 step at micro-batch 8 on 2 CPU cores"),
    "gpt-mini": (GPTConfig(vocab_size=8192, seq_len=256, n_layer=8, n_head=6, n_embd=384),
                 "8-layer GPT, d=384, seq 256, vocab 8192"),
    "gpt2": (GPTConfig(n_layer=12, n_head=12, n_embd=768, **_GPT2),
             "GPT-2 small (124M): 12 layers, d=768, 12 heads, seq 1024, tied embeddings"),
    "gpt2-medium": (GPTConfig(n_layer=24, n_head=16, n_embd=1024, **_GPT2),
                    "GPT-2 medium (355M): 24 layers, d=1024, 16 heads, seq 1024, tied embeddings"),
    "llama-1b": (GPTConfig(vocab_size=128256, seq_len=2048, n_layer=16, n_head=32, n_kv_head=8, n_embd=2048,
                           ffn_hidden=8192, tie_embeddings=True, rope_theta=500000.0, **_LLAMA),
                 "Llama-3.2-1B shape: 16 layers, d=2048, 32 heads / 8 kv heads, SwiGLU 8192, seq 2048, tied"),
    # Llama-2 trained at 4096 tokens; 2048 here keeps activations of the default preset moderate
    "llama-7b": (GPTConfig(vocab_size=32000, seq_len=2048, n_layer=32, n_head=32, n_embd=4096,
                           ffn_hidden=11008, tie_embeddings=False, **_LLAMA),
                 "Llama-2-7B shape: 32 layers, d=4096, 32 heads, SwiGLU 11008, seq 2048 (not 4096), untied"),
}


def gpt_preset(name: str, **overrides) -> Workload:
    """The preset ``name`` (a key of :data:`PRESETS`), with GPTConfig fields overridden.

    Overrides are appended to the workload name so tables and caches tell them apart.
    Example: ``gpt_preset("gpt-tiny", attention="plain", dropout=0.1)``.
    Raises WorkloadError for an unknown preset or field.
    """
    if name not in PRESETS:
        raise WorkloadError(f"unknown GPT preset {name!r}: expected one of {', '.join(PRESETS)}")
    cfg, description = PRESETS[name]
    if overrides:
        fields = {f.name for f in dataclasses.fields(GPTConfig)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise WorkloadError(f"unknown GPTConfig field(s) {unknown}")
        cfg = dataclasses.replace(cfg, **overrides)
        name = name + "+" + ",".join(f"{k}={v}" for k, v in sorted(overrides.items()))
    return gpt_workload(cfg, name, description)


def _field_value(field: dataclasses.Field, text: str):
    """``text`` as the type of a GPTConfig field (``int | None`` takes ``none``)."""
    kind = str(field.type)
    if kind.endswith("| None") and text.lower() == "none":
        return None
    parse = {"bool": lambda t: {"true": True, "false": False}[t.lower()], "float": float, "str": str}.get(
        kind.split(" ")[0], int)
    try:
        return parse(text)
    except (KeyError, ValueError):
        raise WorkloadError(f"GPTConfig.{field.name}={text!r}: expected {kind}") from None


def preset_from_spec(spec: str) -> Workload:
    """``PRESET+field=value,field=value`` (what :func:`gpt_preset` names its overrides) as a Workload.

    Example: ``preset_from_spec("gpt2+n_layer=24,n_embd=1024,n_head=16")``; this is how a model
    of ``autofit size`` is handed to ``--model``. Raises WorkloadError naming the bad part.
    """
    name, _, rest = spec.partition("+")
    fields = {f.name: f for f in dataclasses.fields(GPTConfig)}
    overrides = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise WorkloadError(f"{spec!r}: invalid override {item!r}: expected field=value with a GPTConfig field "
                                f"({', '.join(fields)})")
        overrides[key] = _field_value(fields[key], value)
    return gpt_preset(name, **overrides)
