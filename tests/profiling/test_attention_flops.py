"""Grouped-query attention's FLOPs: autofit's formulas for the fused SDPA kernels, checked on this CPU against
torch's own count of the same attention done by plain matmuls (meta tensors: no kernel runs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils.flop_counter as torch_flops

from autofit.profiling.flops import (
    attention_backward_flops,
    attention_forward_flops,
    flop_counter,
    flop_formulas,
)

aten = torch.ops.aten
B, H_Q, H_KV, S_Q, S_K, D_QK, D_V = 2, 8, 2, 16, 24, 32, 40


def _qkv(h_kv: int = H_KV, grad: bool = False):
    def t(*shape):
        return torch.empty(*shape, device="meta", dtype=torch.bfloat16, requires_grad=grad)
    return t(B, H_Q, S_Q, D_QK), t(B, h_kv, S_K, D_QK), t(B, h_kv, S_K, D_V)


def _expanded(k, v):
    """What transformers' ``repeat_kv`` hands the kernel: each key/value head repeated for its query group."""
    return k.repeat_interleave(H_Q // H_KV, dim=1), v.repeat_interleave(H_Q // H_KV, dim=1)


def test_grouped_heads_cost_what_the_expanded_heads_cost():
    q, k, v = _qkv()
    ke, ve = _expanded(k, v)
    fwd = attention_forward_flops(q.shape, k.shape, v.shape)
    assert fwd == attention_forward_flops(q.shape, ke.shape, ve.shape) == 2 * B * H_Q * S_Q * S_K * (D_QK + D_V)
    grad_out = (B, H_Q, S_Q, D_V)
    assert attention_backward_flops(grad_out, q.shape, k.shape, v.shape) == \
        attention_backward_flops(grad_out, q.shape, ke.shape, ve.shape) == 2 * B * H_Q * S_Q * S_K * (3 * D_QK + 2 * D_V)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        attention_forward_flops((B, 8, S_Q, D_QK), (B, 3, S_K, D_QK), (B, 3, S_K, D_V))


@pytest.mark.parametrize("expand", [False, True], ids=["enable_gqa", "expanded kv"])
def test_the_formula_matches_torchs_count_of_the_same_attention_as_matmuls(expand):
    # On meta tensors F.scaled_dot_product_attention takes the math path: two bmm forward, which torch counts.
    q, k, v = _qkv(grad=True)
    if expand:
        k, v = _expanded(k, v)
    with torch_flops.FlopCounterMode(display=False) as fwd:
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=not expand)
    assert fwd.get_total_flops() == attention_forward_flops(q.shape, k.shape, v.shape)
    with torch_flops.FlopCounterMode(display=False) as bwd:
        out.backward(torch.empty_like(out))
    # The math path keeps its scores for backward; the fused kernels make them again (one more matmul).
    assert bwd.get_total_flops() + 2 * B * H_Q * S_Q * S_K * D_QK == \
        attention_backward_flops(out.shape, q.shape, k.shape, v.shape)


@pytest.mark.parametrize("op", ["_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                                "_scaled_dot_product_cudnn_attention"])
def test_the_fused_kernels_are_counted_with_grouped_heads_where_torchs_formula_asserts(op, monkeypatch):
    if not hasattr(aten, op):
        pytest.skip(f"this torch has no aten.{op}")

    def asserts(query_shape, key_shape, value_shape):  # torch 2.11's sdpa_flop_count on GQA shapes
        raise AssertionError("query, key and value must have the same heads")

    monkeypatch.setattr(torch_flops, "sdpa_flop_count", asserts)
    q, k, v = _qkv()
    args = (q, k, v) if op == "_scaled_dot_product_flash_attention" else (q, k, v, None, False)
    with flop_counter() as counter:
        getattr(aten, op)(*args)  # the meta kernel: shapes only
    assert counter.get_total_flops() == attention_forward_flops(q.shape, k.shape, v.shape)


def test_the_fused_backward_formulas_count_grouped_heads():
    q, k, v = _qkv()
    grad_out = torch.empty(B, H_Q, S_Q, D_V, device="meta")
    formulas = flop_formulas()
    for name in ("_scaled_dot_product_flash_attention_backward", "_scaled_dot_product_efficient_attention_backward"):
        grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        assert formulas[getattr(aten, name)](grad_out, q, k, v, out_val=grads) == \
            attention_backward_flops(grad_out.shape, q.shape, k.shape, v.shape)
