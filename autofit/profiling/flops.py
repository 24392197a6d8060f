"""The FLOP counter of a profile: torch's ``FlopCounterMode``, with autofit's own formulas for attention.

Grouped-query attention (GQA: Llama 2/3 and most recent decoders) gives the fused attention
kernels a key and a value with ``h_kv`` heads, fewer than the query's ``h_q`` (``enable_gqa=True``,
or a model that calls the kernel with its key/value heads as they are). Each query head still
multiplies against its group's key and value, so the work is that of ``h_q`` heads. torch's stock
``sdpa_flop_count`` asserted that the three have the same heads in torch 2.11 (the H200 run of
``results/benchmarks/gpu/README.md``: ``hf:llama`` failed to profile for CUDA), and counts GQA in
torch 2.13; the formulas here count it in any version, with the same arithmetic as torch's
(``torch/utils/flop_counter.py``: two matmuls forward, five backward, the recomputed scores
included). A model that expands its key and value to ``h_q`` heads itself (transformers'
``repeat_kv``) reaches the kernel with equal heads and gets the same count.

Like torch's, the count is that of full attention: a causal mask's skipped half is counted.

An operator torch has no formula for, but a decomposition of (``silu_backward``: a sigmoid and four
products), torch's counter runs *as* its decomposition, to count the parts' FLOPs. The real step runs
it whole, so a memory timeline below the counter would see tensors that never exist (a user's conv,
GroupNorm and SiLU net, counted at micro-batch 4 only, was estimated 5.6-7.3% under its measured peak at
micro-batch 1 and 59-86% over at 8). :func:`flop_counter` therefore runs the decomposition aside (``aside()``: a context
in which the timeline does not count), for its FLOPs only, and then the operator whole.
"""

from __future__ import annotations

from typing import Callable, ContextManager

import torch
from torch.utils import flop_counter as _torch_flops
from torch.utils.flop_counter import FlopCounterMode


def _heads(query_shape, key_shape, value_shape) -> tuple[int, int, int, int, int, int]:
    """(batch, query heads, query length, key length, query/key head size, value head size); raises
    ValueError for shapes no attention kernel takes."""
    b, h_q, s_q, d_q = query_shape
    b_k, h_kv, s_k, d_k = key_shape
    b_v, h_v, s_v, d_v = value_shape
    if not (b == b_k == b_v and h_kv == h_v and s_k == s_v and d_q == d_k) or h_kv < 1 or h_q % h_kv:
        raise ValueError(f"attention shapes do not match: query {tuple(query_shape)}, key {tuple(key_shape)}, "
                         f"value {tuple(value_shape)} (query heads must be a multiple of key/value heads)")
    return b, h_q, s_q, s_k, d_q, d_v


def attention_forward_flops(query_shape, key_shape, value_shape) -> int:
    """Scores (query × keyᵀ) and output (scores × value) for every query head: 2·b·h_q·s_q·s_k·(d_qk + d_v)."""
    b, h_q, s_q, s_k, d_q, d_v = _heads(query_shape, key_shape, value_shape)
    return 2 * b * h_q * s_q * s_k * (d_q + d_v)


def attention_backward_flops(grad_out_shape, query_shape, key_shape, value_shape) -> int:
    """The scores again, then the gradients of the scores, value, query and key: 2·b·h_q·s_q·s_k·(3·d_qk + 2·d_v)."""
    b, h_q, s_q, s_k, d_q, d_v = _heads(query_shape, key_shape, value_shape)
    if tuple(grad_out_shape) != (b, h_q, s_q, d_v):
        raise ValueError(f"attention gradient {tuple(grad_out_shape)} is not the output's shape {(b, h_q, s_q, d_v)}")
    return 2 * b * h_q * s_q * s_k * (3 * d_q + 2 * d_v)


def _forward_formula(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return attention_forward_flops(query_shape, key_shape, value_shape)


def _backward_formula(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return attention_backward_flops(grad_out_shape, query_shape, key_shape, value_shape)


def _ops(names: tuple[str, ...]) -> list:
    return [getattr(torch.ops.aten, n) for n in names if hasattr(torch.ops.aten, n)]  # cudnn's is newer


# The fused kernels' operators, as FlopCounterMode's ``custom_mapping`` takes them (shapes in, FLOPs out).
FORMULAS = {
    **dict.fromkeys(_ops(("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                          "_scaled_dot_product_cudnn_attention")), _forward_formula),
    **dict.fromkeys(_ops(("_scaled_dot_product_flash_attention_backward",
                          "_scaled_dot_product_efficient_attention_backward",
                          "_scaled_dot_product_cudnn_attention_backward")), _backward_formula),
}


def _makes_tensors(func) -> bool:
    """Whether ``func`` returns tensors and leaves its arguments alone: one worth running aside (torch's
    counter returns early for the queries that return sizes and flags; a mutating operator run twice
    would apply twice)."""
    if not isinstance(func, torch._ops.OpOverload) or func._schema.is_mutable:
        return False
    return any(str(r.type).startswith("Tensor") for r in func._schema.returns)


# Whether each operator seen has a decomposition: most have none, and trying costs a mode switch per call.
_DECOMPOSES: dict = {}


class _AsideMode(getattr(_torch_flops, "_FlopCounterMode", object)):
    """torch's dispatch mode of the counter, but an operator it would decompose is decomposed under
    ``aside()`` (its FLOPs counted, its tensors unseen below) and then run whole, as the real step runs it."""

    def __init__(self, counter: FlopCounterMode, aside: Callable[[], ContextManager]) -> None:
        super().__init__(counter)
        self.aside = aside

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _DECOMPOSES.get(func, True) and func not in self.counter.flop_registry and _makes_tensors(func):
            # As torch's counter does (``func.decompose`` under this mode), but aside.
            with self.aside(), self:
                parts = func.decompose(*args, **kwargs)
            _DECOMPOSES[func] = parts is not NotImplemented
            if parts is not NotImplemented:
                return func(*args, **kwargs)
        return super().__torch_dispatch__(func, types, args, kwargs)


class _Counter(FlopCounterMode):
    def __init__(self, aside: Callable[[], ContextManager], **kwargs) -> None:
        super().__init__(**kwargs)
        self._aside = aside

    def __enter__(self):
        super().__enter__()
        # torch keeps its dispatch mode in ``self.mode`` (2.5 and later); swap it for the aside one.
        if isinstance(getattr(self, "mode", None), getattr(_torch_flops, "_FlopCounterMode", ())):
            self.mode.__exit__(None, None, None)
            self.mode = _AsideMode(self, self._aside)
            self.mode.__enter__()
        return self


def flop_counter(aside: Callable[[], ContextManager] | None = None) -> FlopCounterMode:
    """A silent ``FlopCounterMode`` that counts grouped-query attention (:data:`FORMULAS`). With ``aside``
    (a context in which the tensors operators make go uncounted, e.g. a timeline's ``quiet``), an operator
    counted by its decomposition runs whole outside ``aside``: no tensor of the parts is seen below."""
    if aside is None:
        return FlopCounterMode(display=False, custom_mapping=FORMULAS)
    return _Counter(aside, display=False, custom_mapping=FORMULAS)


def flop_formulas() -> dict:
    """Operator packet -> formula called as FlopCounterMode calls it (``formula(*args, out_val=out)``):
    torch's registry with :data:`FORMULAS` in place."""
    return dict(flop_counter().flop_registry)
