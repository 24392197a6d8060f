"""What a checkpointed layer's recomputation leaves alive when its forward keeps tensors beyond autograd.

A layer that keeps tensors until the model's output is dropped (``LayerProfile.retained``: a key/value
cache the model returns) is called again by its segment's recomputation with what it keeps still there:
a cache appends to itself again (it grows), and the tensors it now holds carry the recomputation's
autograd graph, whose nodes keep what they saved (``torch.utils.checkpoint`` hands the recomputation's
saved tensors to the original graph and leaves them in the new one too). Nothing frees that graph until
the cache itself is dropped, with the model's output, after the backward.

:func:`recomputed_kept` replays each layer's recomputation on the profile's fake tensors: the model's
forward is run as a checkpointed segment's first forward runs it (nothing saved for backward), its
output held, then each layer is called again with the arguments it was first called with, saving for
backward, and what stays alive is read from the timeline: with the layer's output held (an inner layer
of a segment, whose output the next layer's recomputed graph keeps) and once it is dropped (a segment's
last layer).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._pytree import tree_leaves, tree_map_only

from autofit.profiling.timeline import Timeline
from autofit.runtime.training import Trainee, autocast_context

__all__ = ["recomputed_kept"]


def recomputed_kept(trainee: Trainee, layers, inputs, timeline: Timeline) -> list[tuple[int, int, int, int]]:
    """Per layer: the bytes its recomputation leaves alive with its output held, and once its output is
    dropped, then the bytes of its input and of its other arguments first taken there where the
    recomputed graph keeps them (the checkpoint would have let them go after the segment's backward),
    while the model's output lives; all zeros where a layer cannot be called again so (it raised).
    Run inside the profile's tensor mode and ``timeline``."""
    n = len(layers)
    calls: list[tuple] = []

    def capture(module, args, kwargs) -> None:
        if len(calls) < n:  # a module listed several times is layer i on its i-th call
            calls.append((module, args, kwargs))

    handles = [layer.register_forward_pre_hook(capture, with_kwargs=True)
               for layer in {id(layer): layer for layer in layers}.values()]
    try:
        # the first forward of checkpointed segments: autograd keeps nothing, the model's output is held
        with torch.autograd.graph.saved_tensors_hooks(lambda t: None, lambda saved: None), \
                autocast_context(trainee.config.precision, trainee.device.type):
            out = trainee.model(inputs)
    finally:
        for h in handles:
            h.remove()
    first = _first_takers(calls)
    kept = [(0, 0, 0, 0)] * n
    try:
        for i in reversed(range(len(calls))):  # the backward recomputes the last segment first
            module, args, kwargs = calls[i]
            kept[i] = _replay(trainee, timeline, module, args, kwargs, {k for k, taker in first.items() if taker == i})
    except Exception:  # noqa: BLE001 -- a layer that cannot be called again so: nothing replayed, all zeros,
        # which the estimate reads as not replayed and refuses checkpointing (memory_table.retained_refusal)
        kept = [(0, 0, 0, 0)] * n
    finally:
        calls.clear()
        del out
    return kept


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _first_takers(calls: list[tuple]) -> dict[int, int]:
    """Storage key -> the first layer called with it, of the tensor arguments beyond the input (rotary
    tables every layer takes are the first one's)."""
    first: dict[int, int] = {}
    for i, (_, args, kwargs) in enumerate(calls):
        for t in tree_leaves((args[1:], kwargs)):
            if isinstance(t, torch.Tensor):
                first.setdefault(_key(t), i)
    return first


def _replay(trainee: Trainee, timeline: Timeline, module, args, kwargs, own: set[int]) -> tuple[int, int, int, int]:
    """One layer's recomputation: (left alive with its output held, once it is dropped, then the bytes of
    its input and of its other arguments first taken here (storage keys ``own``) that the recomputed
    graph keeps: a norm saves its input, a rotary embedding its tables)."""
    # The checkpoint recomputes from its saved arguments, detached, needing gradients as they did. Its
    # input and the arguments first taken here are copies, so that whether the recomputed graph keeps them
    # shows (the checkpoint alone would have let them go after the segment's backward).
    copies: list[tuple] = []  # (weak reference to a copy's storage, its bytes), the input's first

    def saved(t: torch.Tensor, copy: bool) -> torch.Tensor:
        if not copy:
            return t.detach().requires_grad_(t.requires_grad)
        made = t.detach().clone().requires_grad_(t.requires_grad)
        copies.append((weakref.ref(made.untyped_storage()), timeline.counted_bytes(made.untyped_storage())))
        return made

    first = args[0]
    args = (saved(first, True) if isinstance(first, torch.Tensor) else first,
            *tree_map_only(torch.Tensor, lambda t: saved(t, _key(t) in own), args[1:]))
    kwargs = tree_map_only(torch.Tensor, lambda t: saved(t, _key(t) in own), kwargs)
    if not isinstance(first, torch.Tensor):
        copies.insert(0, (lambda: None, 0))
    del first
    start = timeline.live
    with autocast_context(trainee.config.precision, trainee.device.type):
        y = module(*args, **kwargs)
    with_output = timeline.live - start
    del y
    dropped = timeline.live - start
    del args, kwargs
    kept = [nbytes if ref() is not None else 0 for ref, nbytes in copies]
    return max(0, with_output), max(0, dropped), kept[0], sum(kept[1:])
