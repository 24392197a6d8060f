"""The hooks that cut one profiled step's timeline into regions, and what they record on the way.

:mod:`autofit.profiling.step` runs the step; a :class:`StepTrace` is attached to its model for
the run. Its marks, in the :class:`~autofit.profiling.timeline.Recorder`:

- ``start``, then for layer ``i``: ``f{i}`` and ``F{i}`` where its forward starts and ends,
  ``b{i}`` where its output's gradient arrives and ``B{i}`` where its input's gradient is made
  (its backward); ``layers_done`` before the first operator after the last layer;
- ``out`` and ``dout`` where the model's own forward ends and its output's gradient arrives;
- ``loss`` between forward and backward, ``end`` after the backward, ``opt`` after the optimizer step;
- ``c{i}`` and ``C{i}``: layer ``i``'s forward in one more forward, run as a checkpointed segment runs it;
- ``s{i}`` and ``S{i}``: the same in another forward, run as a selectively checkpointed segment runs it.

No tensor is kept on the trace: a reference held here would keep memory alive that the step frees.
"""

from __future__ import annotations

import collections
import contextlib
import functools

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from autofit.core.errors import WorkloadError
from autofit.profiling.flops import flop_counter, flop_formulas
from autofit.profiling.raw import EMPTY_REGION, RawRegion
from autofit.profiling.timeline import (
    Recorder,
    Timeline,
    first_tensor,
    freed_between,
    round_up,
    watch_arguments,
)
from autofit.runtime.training import SELECTIVE_SAVE, Trainee, autocast_context

__all__ = ["StepTrace"]


def _unpacked(t: torch.Tensor) -> torch.Tensor:
    return t


class StepTrace:
    """One profiled step's hooks (:meth:`attach`, :meth:`detach`) and what they record."""

    def __init__(self, n_layers: int, round_bytes: int, count_flops: bool) -> None:
        n = self.n = n_layers
        self.round_bytes = round_bytes
        self.timeline = Timeline(round_bytes)
        self.rec = Recorder(self.timeline)
        self.layer_out: list[int] = [0] * n  # bytes of each layer's output
        # Whether a layer saves its own output for backward (e.g. a final ReLU): then a
        # checkpointed segment's recomputation re-creates and keeps it (no early stop before it).
        self.output_saved: list[bool] = [False] * n
        self.saved_ptrs: list[set] = [set() for _ in range(n)]
        # Where each layer's forward saved its last tensor for backward (a timeline index): a
        # checkpointed segment's recomputation stops there (non-reentrant early stop).
        self.last_saved: list[int | None] = [None] * n
        self._saving: torch.autograd.graph.saved_tensors_hooks | None = None  # the running layer's
        self._counting = None  # the FLOP counter entered and not yet left
        # The storages each layer is called with (its input and any other tensor argument, e.g. an
        # encoder's output every decoder layer takes), each under the first layer that takes it, and
        # the timeline index at which each died: a checkpoint keeps its segment's arguments alive
        # until the segment's backward (:meth:`freed_late`).
        self.taken: dict[int, int] = {}
        self.arg_bytes: list[dict] = [{} for _ in range(n)]
        self.died_at: dict[int, int] = {}
        # Where the step is ("pre", "layers", "post") when each module outside the layers first runs.
        self.phase = "pre"
        self.module_phase: dict[int, str] = {}
        # Hooks go on each distinct layer module once and number the calls: a module listed several
        # times (weight sharing, ModuleList([block] * 4)) is layer i on its i-th call.
        self.calls = {"pre": 0, "post": 0, "c": 0, "C": 0, "s": 0, "S": 0, "r": 0, "R": 0}
        self.input_grad: list[bool] = [True] * n
        self.output_grad: list[bool] = [True] * n
        # Each layer's output and its output's gradient, as (counted bytes, timeline index at which it died):
        # a pipeline stage keeps both past the layer's backward (:meth:`backward_kept`).
        self.output_death: list[list] = [[0, None] for _ in range(n)]
        self.grad_death: list[list] = [[0, None] for _ in range(n)]
        # FLOPs for the time model: one counter over the forward, another over the backward.
        self.fwd_counter, self.bwd_counter = flop_counter(self.timeline.quiet), flop_counter(self.timeline.quiet)
        if not count_flops:  # counting costs time; FLOPs are counted at one batch size only
            self.fwd_counter = self.bwd_counter = contextlib.nullcontext()
        self._handles: list = []

    # -- hooks ---------------------------------------------------------------------------------

    def attach(self, model: nn.Module, layers, params: list[nn.Parameter]) -> None:
        """Hook the layers, the model's output, the modules outside the layers and the gradients."""
        for layer in {id(layer): layer for layer in layers}.values():
            self._handles.append(layer.register_forward_pre_hook(self._layer_starts, with_kwargs=True))
            self._handles.append(layer.register_forward_hook(self._layer_ends))
        self._handles.append(model.register_forward_hook(self._model_ends))
        layer_ids = {id(m) for layer in layers for m in layer.modules()}
        for module in model.modules():
            if id(module) not in layer_ids and module is not model:
                self._handles.append(module.register_forward_pre_hook(self._outer_module_starts))
        for p in params:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_accumulated))

    def detach(self) -> None:
        """Remove the hooks, and leave what a step that raised left entered: a layer's saved-tensor
        hooks are process-wide, and would keep every tensor autograd saves afterwards alive."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._saving is not None:
            self._saving.__exit__(None, None, None)
            self._saving = None
        if self._counting is not None:
            self._counting.__exit__(None, None, None)
            self._counting = None

    def _next_call(self, key: str) -> int | None:
        """The layer this call of a layer module is (None: a call outside the layer loop)."""
        i = self.calls[key]
        self.calls[key] += 1
        return i if i < self.n else None

    def _layer_starts(self, module, args, kwargs) -> None:
        i = self._next_call("pre")
        if i is None:
            return
        self.rec.mark(f"f{i}")
        watch_arguments(i, (args, kwargs), self.timeline, self.taken, self.arg_bytes, self.died_at)
        if i == 0:
            self.phase = "layers"
        self._saving = torch.autograd.graph.saved_tensors_hooks(functools.partial(self._saved, i), _unpacked)
        self._saving.__enter__()

    def _saved(self, i: int, t: torch.Tensor) -> torch.Tensor:
        self.saved_ptrs[i].add(t.untyped_storage()._cdata)
        self.last_saved[i] = len(self.timeline.trace)  # an input is saved before its op runs, an output after
        return t

    def _layer_ends(self, module, args, output) -> None:
        i = self._next_call("post")
        if i is None:
            return
        self._saving.__exit__(None, None, None)
        self._saving = None
        out = first_tensor(output)
        self.layer_out[i] = round_up(out.untyped_storage().nbytes(), self.round_bytes) if out is not None else 0
        self.output_saved[i] = out is not None and out.untyped_storage()._cdata in self.saved_ptrs[i]
        if out is not None:
            self._watch_death(out, self.output_death[i])
        self.rec.mark(f"F{i}")
        if i == self.n - 1:
            self.phase = "post"
            # the last layer's input dies (where no backward keeps it) as the model moves on
            self.rec.mark_before_next_op("layers_done")
        self.output_grad[i] = out is not None and out.requires_grad
        if self.output_grad[i]:
            out.register_hook(functools.partial(self._output_gradient_arrives, i))
        inp = first_tensor(args)
        self.input_grad[i] = inp is not None and inp.requires_grad
        if self.input_grad[i]:
            inp.register_hook(functools.partial(self._gradient_arrives, f"B{i}"))

    def _gradient_arrives(self, name: str, grad: torch.Tensor) -> None:
        self.rec.mark(name)

    def _output_gradient_arrives(self, i: int, grad: torch.Tensor) -> None:
        self.rec.mark(f"b{i}")
        self._watch_death(grad, self.grad_death[i])

    def _watch_death(self, t: torch.Tensor, death: list) -> None:
        """Record in ``death`` the bytes the timeline counts for ``t``'s storage and, once it is freed, the
        timeline index at which it died. No reference to the tensor is kept."""
        storage = t.untyped_storage()
        death[0], death[1] = self.timeline.counted_bytes(storage), None
        self.timeline.when_freed(storage, lambda at: death.__setitem__(1, at))

    def _outer_module_starts(self, module, args) -> None:
        self.module_phase.setdefault(id(module), self.phase)

    def _model_ends(self, module, args, output) -> None:
        # Where the model's own forward ends and its output's gradient arrives: FSDP gathers and
        # frees the root's weights there, while the loss (outside the model) runs without them.
        self.rec.mark("out")
        out = first_tensor(output)
        if out is not None and out.requires_grad:
            out.register_hook(functools.partial(self._gradient_arrives, "dout"))

    def _grad_accumulated(self, p: nn.Parameter) -> None:
        self.timeline.mark_grad(p.grad)

    # -- the step's phases ---------------------------------------------------------------------

    def forward_starts(self) -> None:
        self.rec.mark("start")
        self.fwd_counter.__enter__()
        self._counting = self.fwd_counter

    def between_forward_and_backward(self) -> None:
        self.fwd_counter.__exit__(None, None, None)
        self.rec.mark("loss")
        self.bwd_counter.__enter__()
        self._counting = self.bwd_counter

    def backward_ends(self) -> None:
        # Backward ends inside a layer whose input needs no gradient (the first layer fed the raw
        # input or a frozen embedding's output): its backward runs to the end of the backward
        # pass, and layers before it (no gradient at all) have an empty one.
        names = set(self.rec.names())
        for i in reversed(range(self.n)):
            if f"b{i}" not in names and not self.output_grad[i]:
                self.rec.mark(f"b{i}")
            if f"B{i}" not in names and not (self.input_grad[i] and self.output_grad[i]):
                self.rec.mark(f"B{i}")
        self.bwd_counter.__exit__(None, None, None)
        self._counting = None
        self.rec.mark("end")

    def optimizer_stepped(self) -> None:
        self.rec.mark("opt")

    def checkpointed_forwards(self, trainee: Trainee, layers, inputs) -> list[tuple[RawRegion, int]]:
        """Each layer's forward as a checkpointed segment's forward runs it, as :meth:`Recorder.region`
        gives it: autograd keeps none of the tensors it saves (the checkpoint's pack hook stores no
        tensor), so each dies with its last Python reference. One more forward of the model, its output
        dropped. Per layer also what its forward left alive once the model's forward returned (autocast
        exited, the model's output still held), beyond its output: what something other than autograd
        keeps, e.g. a key/value cache the model returns. A tensor the layer replaces (a stash of the
        step before, a buffer) is taken off: the net growth. The step before ran first, so that is net."""
        unique = {id(layer): layer for layer in layers}.values()
        timeline, layer_now = self.timeline, [None]
        before = timeline.alive_ids()  # the previous step's leftovers among them
        born: dict[int, tuple[int, int]] = {}  # storage id -> (the layer that made it, bytes), while alive
        replaced = [0] * self.n

        def new(storage_id: int, nbytes: int) -> None:
            if layer_now[0] is not None:
                born[storage_id] = (layer_now[0], nbytes)

        def freed(storage_id: int, nbytes: int) -> None:
            born.pop(storage_id, None)
            if storage_id in before:
                before.discard(storage_id)  # its id may be a new storage's next
                if layer_now[0] is not None:
                    replaced[layer_now[0]] += nbytes

        def mark(key: str, module, *args) -> None:
            i = self._next_call(key)
            if i is not None:
                self.rec.mark(f"{key}{i}")
                layer_now[0] = i if key == "c" else None

        handles = [layer.register_forward_pre_hook(functools.partial(mark, "c")) for layer in unique]
        handles += [layer.register_forward_hook(functools.partial(mark, "C")) for layer in unique]
        timeline.on_new, timeline.on_free = new, freed
        try:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: None, lambda saved: None):
                with autocast_context(trainee.config.precision, trainee.device.type):
                    out = trainee.model(inputs)
                main = first_tensor(out)
                if main is not None:  # the model's output is the loss's, not kept by anything
                    born.pop(id(main.untyped_storage()), None)
                made = [0] * self.n
                for i, nbytes in born.values():
                    made[i] += nbytes
                kept = [max(0, made[i] - replaced[i]) for i in range(self.n)]
                del out, main
        finally:
            timeline.on_new = timeline.on_free = None
            for h in handles:
                h.remove()
        return [(self.rec.region(f"c{i}", f"C{i}"), kept[i]) for i in range(self.n)]

    def selective_forwards(self, trainee: Trainee, layers, inputs) -> list[tuple]:
        """Each layer's forward as a selectively checkpointed segment's forward runs it: as
        :meth:`checkpointed_forwards`, but the outputs of the operators the policy saves
        (:data:`~autofit.runtime.training.SELECTIVE_SAVE`) are kept, as the policy's cache keeps them
        until the segment's recomputation takes them. Per layer: the region, the bytes it keeps beyond its
        output, whether it keeps its output too, the FLOPs of the operators it keeps (not recomputed), and
        its recomputation, whole and up to its last saved tensor (:meth:`selective_recomputes`)."""
        unique = {id(layer): layer for layer in layers}.values()
        cache = _PolicyCache(self.round_bytes, self.n)

        def starts(module, args) -> None:
            i = self._next_call("s")
            if i is not None:
                self.rec.mark(f"s{i}")
                cache.layer = i

        def ends(module, args, output) -> None:
            i = self._next_call("S")
            if i is not None:
                self.rec.mark(f"S{i}")
                cache.layer = None
                out = first_tensor(output)
                cache.output[i] = out.untyped_storage()._cdata if out is not None else None

        handles = [layer.register_forward_pre_hook(starts) for layer in unique]
        handles += [layer.register_forward_hook(ends) for layer in unique]
        try:
            with autocast_context(trainee.config.precision, trainee.device.type), \
                    torch.autograd.graph.saved_tensors_hooks(lambda t: None, lambda saved: None), cache.mode:
                trainee.model(inputs)
        finally:
            for h in handles:
                h.remove()
        recomputes = self.selective_recomputes(trainee, layers, inputs, cache)
        out = []
        for i in range(self.n):
            kept = cache.bytes[i]
            output_kept = cache.output[i] in kept
            out.append((self.rec.region(f"s{i}", f"S{i}"), sum(b for k, b in kept.items() if k != cache.output[i]),
                        output_kept, cache.flops[i], *recomputes[i]))
        return out

    def selective_recomputes(self, trainee: Trainee, layers, inputs, cache: "_PolicyCache") -> list[tuple]:
        """Each layer's forward as a selective segment's recomputation runs it: autograd saves what backward
        needs, and the operators the policy saved hand back their kept outputs (``cache``, from
        :meth:`selective_forwards`) instead of making them again, as ``torch.utils.checkpoint``'s cache
        does. Per layer: the whole forward and its prefix up to the last tensor it saves (early stop)."""
        unique = {id(layer): layer for layer in layers}.values()
        # The queues hold the kept outputs from here on, alone: one handed back is the recomputation's,
        # and dies as soon as nothing saves it; those after a layer's last saved tensor stay queued, as
        # the checkpoint's cache keeps them (early stop) until the segment's backward is done.
        queues = [collections.deque(outputs) for outputs in cache.by_layer]
        cache.kept.clear()
        cache.by_layer.clear()
        now: list[int | None] = [None]
        last: list[int | None] = [None] * self.n
        timeline = self.timeline

        class Replay(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                i = now[0]
                if i is not None and func in SELECTIVE_SAVE and queues[i]:
                    return queues[i].popleft()
                return func(*args, **(kwargs or {}))

        def pack(t: torch.Tensor) -> torch.Tensor:
            if now[0] is not None:
                last[now[0]] = len(timeline.trace)
            # the same storage, without its grad_fn: an output saved as itself would hold its own graph
            # in a cycle that outlives the pass (and the step)
            return t.detach()

        def starts(module, args) -> None:
            i = self._next_call("r")
            if i is not None:
                self.rec.mark(f"r{i}")
                now[0] = i

        def ends(module, args, output) -> None:
            i = self._next_call("R")
            if i is not None:
                self.rec.mark(f"R{i}")
                now[0] = None

        handles = [layer.register_forward_pre_hook(starts) for layer in unique]
        handles += [layer.register_forward_hook(ends) for layer in unique]
        try:
            replay_forward(trainee, inputs, pack, Replay())
        except Exception:  # noqa: BLE001 -- a forward that does not replay (its operators differ on a second run)
            # keeps the estimate that counts the kept outputs as made again: high, never under
            return [(None, None)] * self.n
        finally:
            for h in handles:
                h.remove()
            queues.clear()
        if any(f"R{i}" not in self.rec.names() for i in range(self.n)):
            return [(None, None)] * self.n
        return [(self.rec.region(f"r{i}", f"R{i}"), self.prefix(f"r{i}", last[i])) for i in range(self.n)]

    # -- reading the trace ---------------------------------------------------------------------

    def check_backward(self, workload_name: str) -> None:
        """Raise WorkloadError where the backward pass could not be followed through every layer."""
        names = self.rec.names()
        n = self.n
        missing = [f"b{i}" for i in range(n) if f"b{i}" not in names] + [f"B{i}" for i in range(n) if f"B{i}" not in names]
        if missing:
            raise WorkloadError(
                f"{workload_name}: could not follow the backward pass through layers ({missing[0]} missing); "
                "each layer must take the previous layer's output as its first input"
            )

    def region(self, start: str, end: str) -> RawRegion:
        return self.rec.region(start, end)

    def recompute(self, i: int) -> RawRegion:
        """Layer ``i``'s forward up to its last saved tensor (:meth:`prefix`)."""
        return self.prefix(f"f{i}", self.last_saved[i])

    def prefix(self, start: str, stop: int | None) -> RawRegion:
        """The region from mark ``start`` to timeline index ``stop`` (exclusive), as :meth:`Recorder.region`
        gives it; nothing (all zeros) when ``stop`` is None (the layer saved nothing)."""
        first = self.rec.find(start)
        live0, ng0, at = first.live, first.nongrad, first.at
        points = self.timeline.trace[at:stop] if stop is not None and stop > at else [(live0, ng0)]
        live = [p[0] - live0 for p in points]
        nongrad = [p[1] - ng0 for p in points]
        return RawRegion(live[-1], max(live), nongrad[-1], max(nongrad), live, nongrad)

    def backward_kept(self, i: int, output_too: bool) -> RawRegion:
        """Layer ``i``'s backward as a pipeline stage that ends with it runs it: its output's gradient (and,
        ``output_too``, its output) never freed in it. The stage's receive buffer holds the gradient and its
        schedule's forward cache the output until the micro-batch's backward returns, where this profile's
        backward freed them as it went: each counts from where it died here to the region's end, so the
        peak is the one the stage reaches, wherever in the backward it falls."""
        base = self.region(f"b{i}", f"B{i}")
        if base is EMPTY_REGION:  # marked at once: nothing ran in it
            return base
        start = self.rec.find(f"b{i}").at
        held = [self.grad_death[i]] + ([self.output_death[i]] if output_too else [])
        extra = [sum(nbytes for nbytes, died in held if died is not None and start < died <= k)
                 for k in range(start, start + len(base.points))]
        live = [p + x for p, x in zip(base.points, extra)]
        nongrad = [p + x for p, x in zip(base.points_nongrad, extra)]
        return RawRegion(live[-1], max(live), nongrad[-1], max(nongrad), live, nongrad)

    def output_regions(self) -> dict[str, RawRegion]:
        """The after-layers regions cut at the model's output (none where it has no gradient)."""
        if not {"out", "dout"} <= set(self.rec.names()):
            return {}
        return {"head_forward": self.region("layers_done", "out"), "loss_forward": self.region("out", "loss"),
                "loss_backward": self.region("loss", "dout"), "head_backward": self.region("dout", f"b{self.n - 1}")}

    def layer_args(self, i: int, weights: set[int]) -> int:
        """Bytes of layer ``i``'s tensor arguments beyond its input, first taken there, that are not among
        ``weights`` (storage keys of the model's parameters and buffers)."""
        return sum(nbytes for key, (is_first, nbytes) in self.arg_bytes[i].items() if not is_first and key not in weights)

    def freed_late(self, i: int, first: bool) -> int:
        """Bytes of layer ``i``'s first argument (``first``) or of its others that died after the layers,
        as the model's forward returned (:func:`~autofit.profiling.timeline.freed_between`)."""
        return freed_between(self.rec, self.arg_bytes[i], self.died_at, "layers_done", "loss", first)

    def layer_flops(self, model: nn.Module, layers) -> list[float]:
        """Each layer's forward FLOPs (the forward counter's per-module counts)."""
        per_module = self.fwd_counter.get_flop_counts()
        fqn = {id(m): name for name, m in model.named_modules()}
        root = type(model).__name__
        uses = {id(layer): sum(other is layer for other in layers) for layer in layers}  # a shared module counts all its calls
        return [float(sum(per_module.get(f"{root}.{fqn.get(id(layer), '')}", {}).values())) / uses[id(layer)]
                for layer in layers]


def replay_forward(trainee: Trainee, inputs, pack, mode) -> None:
    """One forward of the model under ``mode``, autograd saving through ``pack``; its output dropped."""
    with autocast_context(trainee.config.precision, trainee.device.type), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mode:
        out = trainee.model(inputs)
    del out


class _PolicyCache:
    """Keeps the outputs of the operators selective checkpointing saves, made inside a layer's forward, as
    its cache does (``torch.utils.checkpoint``'s ``_CachingTorchDispatchMode``): their storages' bytes per
    layer, and the FLOPs of those operators."""

    def __init__(self, round_bytes: int, n: int) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        formulas = flop_formulas()
        self.layer: int | None = None
        self.kept: list = []
        self.by_layer: list[list] = [[] for _ in range(n)]  # each layer's kept outputs, in the order made
        self.bytes: list[dict[int, int]] = [{} for _ in range(n)]
        self.flops: list[float] = [0.0] * n
        self.output: list[int | None] = [None] * n
        cache = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                i = cache.layer
                if i is not None and func in SELECTIVE_SAVE:
                    cache.kept.append(out)
                    cache.by_layer[i].append(out)
                    for t in tree_leaves(out):
                        if isinstance(t, torch.Tensor):
                            storage = t.untyped_storage()
                            cache.bytes[i][storage._cdata] = round_up(storage.nbytes(), round_bytes)
                    formula = formulas.get(func._overloadpacket)
                    if formula is not None:
                        cache.flops[i] += float(formula(*args, **(kwargs or {}), out_val=out))
                return out

        self.mode = Mode()
