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
from torch.utils._pytree import tree_map_only

from autofit.profiling.timeline import Timeline
from autofit.runtime.training import Trainee, autocast_context

__all__ = ["recomputed_kept"]


def recomputed_kept(trainee: Trainee, layers, inputs, timeline: Timeline) -> list[tuple[int, int, int]]:
    """Per layer: the bytes its recomputation leaves alive with its output held, and once its output is
    dropped, and its input's bytes where the recomputed graph keeps it (a norm that saves its input: the
    checkpoint would have let it go after the segment's backward), while the model's output lives.
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
    kept = [(0, 0, 0)] * n
    for i in reversed(range(len(calls))):  # the backward recomputes the last segment first
        kept[i] = _replay(trainee, timeline, *calls[i])
    calls.clear()
    del out
    return kept


def _replay(trainee: Trainee, timeline: Timeline, module, args, kwargs) -> tuple[int, int, int]:
    """One layer's recomputation: (left alive with its output held, once it is dropped, its input's bytes
    where the recomputed graph keeps the input beyond the checkpoint)."""
    # The checkpoint recomputes from its saved inputs, detached, needing gradients as they did. The first
    # is a copy here, so that whether the recomputed graph keeps it shows (a norm saves its input).
    args = tree_map_only(torch.Tensor, lambda t: t.detach().requires_grad_(t.requires_grad), args)
    x = args[0].clone().requires_grad_(args[0].requires_grad) if isinstance(args[0], torch.Tensor) else None
    args = (x, *args[1:]) if x is not None else args
    input_bytes = timeline.counted_bytes(x.untyped_storage()) if x is not None else 0
    alive = weakref.ref(x.untyped_storage()) if x is not None else lambda: None
    del x
    start = timeline.live
    with autocast_context(trainee.config.precision, trainee.device.type):
        y = module(*args, **kwargs)
    with_output = timeline.live - start
    del y
    dropped = timeline.live - start
    del args
    return max(0, with_output), max(0, dropped), input_bytes if alive() is not None else 0
