"""Expert routing in a profiled step: the worst case a top-k router allows, with values the fake step can read.

A mixture-of-experts layer sends each token to the k experts its router's ``torch.topk`` picks, and
how many tokens each expert gets decides the shapes of its activations. A fake tensor has no values,
so a layer written the usual way (``torch.where(selected == i)`` per expert, ``for i in expert_hit``)
cannot run on one: the number of tokens is data. The profiled step therefore fixes the routing to one
stated assumption, the same on fake and on real tensors (the real check runs the same step):

**every token's top-k goes to the same k experts** (indices ``0 … k-1`` along the top-k dimension;
the values are the scores there), except a few tokens that take the other experts, k at a time, so
that every expert runs. The first k experts get (nearly) every token, the largest count a router
allows; the k·tokens routed rows are as many as under any routing. What a layer keeps for backward
is summed over its experts (k·tokens rows, whatever the routing), plus what each expert that runs
keeps whatever its count (under autocast, its weights' casts: hence every expert runs); what one
expert holds while it computes is at most one expert's with every token. So a random batch's
routing, which reaches every expert with far fewer tokens each, peaks no higher (grouped kernels,
``transformers``' default, size every routed row at once and do not depend on the routing at all).

On fake tensors :class:`Routing` keeps the real values of the routing indices beside their fake
tensors (small integer tensors: tokens × k), and of every operator that reads only such tensors
(comparisons, ``one_hot``, sums, sorts, ``nonzero``, ``.item()``), computed on the real values; where a
fake kernel cannot size its output from shapes alone (``nonzero``, a boolean mask's index) or a value
is read (``.item()``, a Python ``for`` over a tensor), the real values answer it.
"""

from __future__ import annotations

import math

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
)
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["ROUTING_NOTE", "Routing", "worst_case_picks"]

ROUTING_NOTE = ("expert routing assumed: every token's top-k to the same k experts (the most tokens per expert "
                "a router allows), a few tokens' to the others so that every expert runs")

_aten = torch.ops.aten
# Factory operators whose small outputs (``torch.arange(num_experts)``) take part in routing arithmetic.
_FACTORIES = {_aten.arange.default, _aten.arange.start, _aten.arange.start_step, _aten.zeros.default,
              _aten.ones.default, _aten.full.default, _aten.scalar_tensor.default}
_MAX_FACTORY_NUMEL = 1 << 16
_DATA_DEPENDENT = (DynamicOutputShapeException, DataDependentOutputException)


def _tensor_args(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among an ``OpOverload``'s arguments. Its schema nests at most one list deep (``Tensor[]``,
    ``Tensor?[]``), so one pass does what ``tree_flatten`` does at a fraction of its cost: this runs for
    every operator of a profiled step (gpt-tiny's profile took about 14% longer with ``tree_flatten``)."""
    out = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(v for v in value if isinstance(v, torch.Tensor))
    return out


def worst_case_picks(shape: list[int], k: int, dim: int) -> torch.Tensor:
    """Top-k indices for scores of ``shape`` along ``dim``: experts ``0 … k-1`` for every row, except the
    last few rows, which take the other experts, k at a time, so that every expert runs (as under any
    routing of a real batch; an expert that gets no token keeps nothing, not even its weights' casts)."""
    if not shape:
        return torch.zeros((), dtype=torch.long)
    experts = shape[dim]
    rows = shape[:dim] + shape[dim + 1:]
    picks = torch.arange(k, dtype=torch.long).expand(max(1, math.prod(rows)), k).clone()
    for row, first in enumerate(range(k, experts, k)):
        if row >= picks.shape[0]:
            break
        first = min(first, experts - k)  # the last group: the last k experts
        picks[-1 - row] = torch.arange(first, first + k)
    return picks.reshape(rows + [k]).movedim(-1, dim).contiguous()


class Routing(TorchDispatchMode):
    """Entered above the step's tensor mode: ``torch.topk`` returns the worst-case routing
    (:mod:`autofit.profiling.routing`); on fake tensors (``fake``), routing values are kept and
    answer what fake kernels cannot. ``routed`` counts the top-k calls it answered."""

    def __init__(self, fake: bool) -> None:
        super().__init__()
        self.fake = fake
        self.routed = 0
        self._values: WeakIdKeyDictionary = WeakIdKeyDictionary()  # fake tensor -> its real values

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten.topk.default and args[0].is_floating_point():
            return self._top_k(*args, **kwargs)
        if not self.fake:
            return func(*args, **kwargs)
        tensors = (_tensor_args(args, kwargs) if isinstance(func, torch._ops.OpOverload)
                   else [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)])
        if tensors and all(t in self._values for t in tensors):
            return self._on_values(func, *tree_flatten((args, kwargs)))
        if not tensors and func in _FACTORIES:
            return self._factory(func, args, kwargs)
        if func in (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default) and self._has_mask(args[1]):
            args = (args[0], self._masks_as_indices(args[1]), *args[2:])
        out = func(*args, **kwargs)
        if func._schema.is_mutable:  # an operator that wrote into a routing tensor from other data: no values now
            for t in tensors:
                if t in self._values and any(t is o for o in tree_flatten(out)[0]):
                    del self._values[t]
        return out

    def _top_k(self, scores, k, dim=-1, largest=True, sorted=True):
        """The top-k of ``scores`` as the assumption routes: :func:`worst_case_picks`, as scores there."""
        self.routed += 1
        dim = dim % scores.dim() if scores.dim() else 0
        with _disable_current_modes():
            picks = worst_case_picks(list(scores.shape), k, dim)
        if self.fake:
            indices = torch.empty(picks.shape, dtype=torch.long, device=scores.device)
            self._values[indices] = picks
        else:
            indices = picks.to(scores.device)
        return torch.gather(scores, dim, indices), indices

    def _on_values(self, func, flat, spec):
        """``func`` on routing tensors only: computed on their values too, which answer its fake kernel."""
        args, kwargs = tree_unflatten([self._values[t] if isinstance(t, torch.Tensor) else t for t in flat], spec)
        if "device" in kwargs:  # values stay on the CPU: a few integers a token
            kwargs = {**kwargs, "device": torch.device("cpu")}
        with _disable_current_modes():
            real = func(*args, **kwargs)
        fake_args, fake_kwargs = tree_unflatten(flat, spec)
        try:
            out = func(*fake_args, **fake_kwargs)
        except _DATA_DEPENDENT:
            device = next(t for t in flat if isinstance(t, torch.Tensor)).device
            out = tree_map_only(torch.Tensor, lambda r: self._stand_in(r, device), real)
            return out
        self._remember(out, real)
        return out

    def _factory(self, func, args, kwargs):
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.numel() <= _MAX_FACTORY_NUMEL:
            real_kwargs = {**kwargs, "device": "cpu"}
            with _disable_current_modes():
                self._values[out] = func(*args, **real_kwargs)
        return out

    def _stand_in(self, real: torch.Tensor, device) -> torch.Tensor:
        """A fake tensor shaped as ``real``, holding its values."""
        fake = torch.empty_strided(real.shape, real.stride(), dtype=real.dtype, device=device)
        self._values[fake] = real
        return fake

    def _remember(self, out, real) -> None:
        outs, reals = tree_flatten(out)[0], tree_flatten(real)[0]
        for o, r in zip(outs, reals):
            if isinstance(o, torch.Tensor) and isinstance(r, torch.Tensor):
                self._values[o] = r

    def _has_mask(self, indices) -> bool:
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool and i in self._values for i in indices)

    def _masks_as_indices(self, indices) -> list:
        """Boolean masks with known values as the integer indices they select (as torch's own kernel does)."""
        out: list = []
        for i in indices:
            if isinstance(i, torch.Tensor) and i.dtype == torch.bool and i in self._values:
                with _disable_current_modes():
                    picked = self._values[i].nonzero().unbind(1)
                out += [self._stand_in(p.contiguous(), i.device) for p in picked]
            else:
                out.append(i)
        return out
