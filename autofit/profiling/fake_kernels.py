"""Fake kernels that refuse what the real kernel runs: answered from shapes, as every fake kernel is.

``aten._grouped_mm`` (mixture-of-experts layers: ``transformers``' ``grouped_mm`` experts, and
``torch.nn.functional.grouped_mm`` in a user's own layer) has a meta kernel that copies the CUDA
kernel's checks, bf16 inputs only. The CPU kernel also runs fp32, so a real step of an fp32 or
autocast mixture of experts runs where its fake step failed ("Expected inputs of BF16 type"). Its
output's shape does not depend on the dtype (nor on the offsets' values: every routed row gets one
output row), so :class:`FakeKernels` makes the output the meta kernel would make for bf16 inputs,
in the inputs' dtype. Its backward is two more grouped matmuls, answered the same way.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["FakeKernels", "grouped_mm_output"]

_aten = torch.ops.aten


def grouped_mm_output(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None,
                      out_dtype: torch.dtype | None) -> torch.Tensor:
    """An empty output of ``torch._grouped_mm(mat_a, mat_b, offs=offs)``, as torch's meta kernel lays it out
    (on CUDA each row padded to 16 bytes), in ``out_dtype`` or ``mat_a``'s dtype."""
    a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
    if a2 and b2:
        size = [offs.size(0), mat_a.size(0), mat_b.size(1)]
    elif a2:
        size = [mat_a.size(0), mat_b.size(-1)]
    elif b2:
        size = [mat_a.size(1), mat_b.size(1)]
    else:
        size = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    dtype = out_dtype or mat_a.dtype
    if mat_a.device.type != "cuda":
        return torch.empty(size, dtype=dtype, device=mat_a.device)
    per_row = 16 // dtype.itemsize  # the CUDA kernel's 16-byte row alignment
    padded = -(-size[-1] // per_row) * per_row
    stride = [size[1] * padded, padded, 1] if a2 == b2 else [padded, 1]
    return torch.empty_strided(size, stride, dtype=dtype, device=mat_a.device)


class FakeKernels(TorchDispatchMode):
    """Entered above ``FakeTensorMode``: answers the operators whose fake kernels refuse a real step's
    inputs (above: grouped matmuls outside bf16); every other operator goes to the fake kernels."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten._grouped_mm.default:
            mat_a, mat_b = args[0], args[1]
            if mat_a.dtype != torch.bfloat16 or mat_b.dtype != torch.bfloat16:
                offs = args[2] if len(args) > 2 else kwargs.get("offs")
                out_dtype = args[4] if len(args) > 4 else kwargs.get("out_dtype")
                return grouped_mm_output(mat_a, mat_b, offs, out_dtype)
        return func(*args, **kwargs)
