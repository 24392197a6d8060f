"""Live tensor bytes after every operator, cut at named marks: the profiler's timeline.

MemTracker (``torch.distributed._tools.mem_tracker``) keeps only per-module peaks; the memory
model needs the whole timeline cut at our own hooks, and the live bytes *without* gradients,
so this small dispatch mode does the counting. It counts the same thing as MemTracker: the
bytes of every distinct storage alive (rounded to the CUDA block size on a CUDA device).
:mod:`autofit.profiling` drives it.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from autofit.profiling.raw import EMPTY_REGION, RawRegion
from autofit.runtime.optimizers import scalar_stand_ins

__all__ = ["Mark", "Recorder", "Timeline", "first_tensor", "init_optimizer_state", "max_tensor_bytes", "round_up",
           "state_tensors", "tensor_bytes", "watch_arguments", "freed_between"]


class Timeline(TorchDispatchMode):
    def __init__(self, round_bytes: int) -> None:
        super().__init__()
        self.round_bytes = round_bytes
        self.live = 0
        self.grad_live = 0
        self.peak = 0
        self.peak_nongrad = 0
        self.trace: list[tuple[int, int]] = []  # (live, live without grads) after every op
        self._storages: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._grad_ids: dict[int, int] = {}  # id(storage) -> bytes, for gradients alive now
        self.before_next_op: Callable[[], None] | None = None  # called once, before the next operator runs
        # Called with (id(storage), counted bytes) as a storage is first seen and as it dies, where set.
        self.on_new: Callable[[int, int], None] | None = None
        self.on_free: Callable[[int, int], None] | None = None
        self._quiet = False

    def _nbytes(self, storage) -> int:
        n = storage.nbytes()
        return -(-n // self.round_bytes) * self.round_bytes if n else 0

    def register(self, tensors: Iterable[torch.Tensor], counted: bool = True) -> None:
        """Known storages (weights, optimizer state, input batches): count them or not, but never as new."""
        for t in tensors:
            self._add(t.untyped_storage(), counted)

    def add_storage(self, storage) -> None:
        """A storage alive before the timeline started, counted (a tensor an earlier step left)."""
        self._add(storage)

    def _add(self, storage, counted: bool = True) -> None:
        if storage in self._storages:
            return
        nbytes = self._nbytes(storage) if counted else 0
        self._storages[storage] = nbytes
        self.live += nbytes
        weakref.finalize(storage, self._free, nbytes, id(storage))
        if self.on_new is not None:
            self.on_new(id(storage), nbytes)

    def _free(self, nbytes: int, storage_id: int) -> None:
        self.live -= nbytes
        self.grad_live -= self._grad_ids.pop(storage_id, 0)
        if self.on_free is not None:
            self.on_free(storage_id, nbytes)

    def left_alive(self, known: Iterable[torch.Tensor]) -> list:
        """The counted storages alive now other than ``known``'s (weights, gradients, optimizer state)."""
        skip = {id(t.untyped_storage()) for t in known}
        return [s for s, nbytes in list(self._storages.items()) if nbytes and id(s) not in skip]

    def alive_ids(self) -> set[int]:
        """``id`` of every storage seen and alive now."""
        return {id(s) for s in list(self._storages.keys())}

    def when_freed(self, storage, record: Callable[[int], None]) -> None:
        """Call ``record`` with the timeline index at which ``storage`` dies (a free between two operators
        lands before the next one's point). Holds no reference to the storage."""
        weakref.finalize(storage, lambda: record(len(self.trace)))

    def counted_bytes(self, storage) -> int:
        """The bytes this timeline counts for ``storage`` (0 where not counted or not seen)."""
        return self._storages.get(storage, 0)

    def mark_grad(self, grad: torch.Tensor) -> None:
        storage = grad.untyped_storage()
        self._add(storage)
        if id(storage) not in self._grad_ids:
            self._grad_ids[id(storage)] = self._storages[storage]
            self.grad_live += self._grad_ids[id(storage)]
        self._observe()

    def reset_peaks(self) -> None:
        self.peak = self.live
        self.peak_nongrad = self.live - self.grad_live

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Operators run here pass through uncounted: work done aside of the step (a FLOP counter's
        decomposition of an operator the step then runs whole)."""
        was, self._quiet = self._quiet, True
        try:
            yield
        finally:
            self._quiet = was

    def _observe(self) -> None:
        self.trace.append((self.live, self.live - self.grad_live))
        self.peak = max(self.peak, self.live)
        self.peak_nongrad = max(self.peak_nongrad, self.live - self.grad_live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._quiet:
            return func(*args, **(kwargs or {}))
        if self.before_next_op is not None:  # what died since the last operator is gone by now
            call, self.before_next_op = self.before_next_op, None
            call()
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                try:
                    self._add(t.untyped_storage())
                except (NotImplementedError, RuntimeError):  # tensors without storage (e.g. sparse)
                    pass
        self._observe()
        return out


class Mark(NamedTuple):
    """A named cut of the timeline; the peaks are those since the previous mark."""

    name: str
    live: int
    nongrad: int
    peak: int
    peak_nongrad: int
    at: int  # index of the mark's own point in the trace


class Recorder:
    """Cuts the timeline at named marks and turns each stretch into (delta, peak) pairs."""

    def __init__(self, timeline: Timeline) -> None:
        self.t = timeline
        self.marks: list[Mark] = []

    def mark(self, name: str) -> None:
        t = self.t
        if t.before_next_op is not None:  # a pending mark comes first
            call, t.before_next_op = t.before_next_op, None
            call()
        t._observe()
        self.marks.append(Mark(name, t.live, t.live - t.grad_live, t.peak, t.peak_nongrad, len(t.trace) - 1))
        t.reset_peaks()

    def mark_before_next_op(self, name: str) -> None:
        """Mark ``name`` just before the next operator (or the next mark), once the tensors that
        Python drops in between (a layer's input no backward keeps) are freed."""
        self.t.before_next_op = lambda: self.mark(name)

    def names(self) -> list[str]:
        return [m.name for m in self.marks]

    def find(self, name: str) -> Mark:
        """The first mark called ``name``."""
        return self.marks[self.names().index(name)]

    def region(self, start: str, end: str) -> RawRegion:
        """The stretch from mark ``start`` to mark ``end``, above the live bytes at ``start``."""
        names = self.names()
        i, j = names.index(start), names.index(end)
        if j <= i:  # marked at once, end first: e.g. the last layer's output is the model's (one gradient, two hooks)
            return EMPTY_REGION
        first, last = self.marks[i], self.marks[j]
        live0, ng0 = first.live, first.nongrad
        peak = max(m.peak for m in self.marks[i + 1:j + 1])
        peak_ng = max(m.peak_nongrad for m in self.marks[i + 1:j + 1])
        points = self.t.trace[first.at:last.at + 1]
        return RawRegion(last.live - live0, peak - live0, last.nongrad - ng0, peak_ng - ng0,
                         [live - live0 for live, _ in points], [ng - ng0 for _, ng in points])


def first_tensor(x: Any) -> torch.Tensor | None:
    for leaf in tree_leaves(x):
        if isinstance(leaf, torch.Tensor):
            return leaf
    return None


def round_up(n: int, round_bytes: int) -> int:
    return -(-n // round_bytes) * round_bytes if n else 0


def tensor_bytes(tensors: Iterable[torch.Tensor], round_bytes: int) -> int:
    seen, total = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        if id(st) not in seen:  # tied weights share a storage
            seen.add(id(st))
            total += round_up(st.nbytes(), round_bytes)
    return total


def max_tensor_bytes(tensors: list[torch.Tensor], round_bytes: int) -> int:
    return max((round_up(t.untyped_storage().nbytes(), round_bytes) for t in tensors), default=0)


def state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def init_optimizer_state(trainee) -> None:
    """Run one optimizer step on zero gradients so its state exists (steady state), cheaply."""
    for p in trainee.model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    with scalar_stand_ins(trainee.optimizer):
        trainee.optimizer.step()
    trainee.optimizer.zero_grad(set_to_none=True)


def watch_arguments(i: int, call, timeline: Timeline, taken: dict, arg_bytes: list, died_at: dict) -> None:
    """Record layer ``i``'s tensor arguments not taken by an earlier layer (their counted bytes) and
    watch when each dies (the timeline index: a free between two ops lands before the next one)."""
    tensors = [t for t in tree_leaves(call) if isinstance(t, torch.Tensor)]
    for place, t in enumerate(tensors):
        storage = t.untyped_storage()
        key = storage._cdata
        if key in taken:
            continue
        taken[key] = i
        arg_bytes[i][key] = (place == 0, timeline.counted_bytes(storage))
        timeline.when_freed(storage, lambda at, k=key: died_at.setdefault(k, at))


def freed_between(rec: Recorder, arg_bytes: dict, died_at: dict[int, int], start: str, end: str,
                  first: bool) -> int:
    """Bytes of a layer's first argument (``first``) or of its others that died between marks
    ``start`` and ``end``: without checkpointing, their last Python reference went there (the
    model's forward returning), while a checkpoint keeps its segment's arguments until the
    segment's backward is done."""
    at = {m.name: m.at for m in rec.marks}
    return sum(nbytes for key, (is_first, nbytes) in arg_bytes.items()
               if is_first == first and at[start] < died_at.get(key, -1) <= at[end])
