"""Peak live tensor bytes of CPU training steps, by category.

A thin wrapper around ``torch.distributed._tools.mem_tracker.MemTracker``, a private PyTorch
API (a ``TorchDispatchMode`` that sees every tensor an operator creates). Everything that
touches it lives in this module, behind :class:`MemoryTracker`, so a change in PyTorch
is fixed here and nowhere else.

Categories (the estimate's names; see :data:`CATEGORIES`):

- ``params_bytes``: parameters and buffers (MemTracker's Parameter + Buffer);
- ``grads_bytes``: parameter gradients (Gradient);
- ``optimizer_bytes``: the optimizer's persistent state (Optstate, up to the state's size);
- ``activations_bytes``: tensors created in forward, including recomputation (Activation);
- ``temporary_bytes``: tensors created in backward (Temp), plus the optimizer step's
  transient buffers (Optstate above the persistent state);
- ``overhead_bytes``: other live tensors (Other): tensors registered as overhead, and tensors
  that outlive a step without being parameters, gradients or optimizer state (a GradScaler's
  scale, caches a model keeps) -- see :meth:`MemoryTracker.reset_peak`.

The breakdown of a peak is its composition at the peak moment, so the six values sum to it.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Iterable

import torch
from torch import nn

CATEGORIES = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "temporary_bytes",
              "overhead_bytes")


class _BudgetExceeded(Exception):
    """Raised inside a tracked step when live tensor bytes pass the budget; a trial reports ``oom``."""

    def __init__(self, live_bytes: int, budget_bytes: int) -> None:
        super().__init__(f"live tensor bytes {live_bytes} exceeded the budget of {budget_bytes} bytes")
        self.live_bytes = live_bytes
        self.budget_bytes = budget_bytes


def _tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors in a nested structure of lists, tuples and dicts."""
    found: list[torch.Tensor] = []

    def visit(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                visit(item)
        elif isinstance(obj, dict):
            for item in obj.values():
                visit(item)

    visit(obj)
    return found


def storage_bytes(obj: Any) -> int:
    """Bytes of the distinct storages under the tensors in ``obj`` (views and aliases once)."""
    storages = {id(s): s for s in (t.untyped_storage() for t in _tensors(obj))}  # one Python object per storage
    return sum(s.nbytes() for s in storages.values())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``optimizer.state``, e.g. AdamW's two moments and step counters.

    torchao's ``CPUOffloadOptimizer`` (``offload=optimizer``) has no ``state`` of its own: the device keeps
    only its optimizer of the small parameters (``d_opt``, None when every parameter went to the host);
    the offloaded parameters' states are on the host."""
    if not hasattr(optimizer, "state") and hasattr(optimizer, "d_opt"):
        return 0 if optimizer.d_opt is None else optimizer_state_bytes(optimizer.d_opt)
    return storage_bytes(list(optimizer.state.values()))


class _NoHook:
    """Stands for the hook handle a frozen parameter never gets."""

    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


@functools.cache
def _tracker_class():
    # Imported lazily: torch.distributed._tools takes seconds to import (it pulls in dynamo),
    # and only a CPU trial needs it -- not the CLI parent, not a CUDA trial.
    from torch.distributed._tools import mem_tracker as mt

    class _Tracker(mt.MemTracker):
        """MemTracker that checks live bytes against a limit after each operator."""

        def __init__(self, limit_bytes: int | None) -> None:
            super().__init__()
            self.limit_bytes = limit_bytes
            self.exceeded_bytes: int | None = None

        def live_total(self) -> int:
            return sum(snap[mt._TOTAL_KEY] for snap in self._curr_mem_snap.values())

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = super().__torch_dispatch__(func, types, args, kwargs)
            if self.limit_bytes is not None:
                live = self.live_total()  # a dict lookup per device: cheap next to the op itself
                if live > self.limit_bytes:
                    self.exceeded_bytes = live
                    raise _BudgetExceeded(live, self.limit_bytes)
            return result

        def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
            # A root module's second forward is the next iteration, which MemTracker refuses
            # until its per-module statistics are reset (we use only the global ones): reset.
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                name = self._mod_tracker.get_known_fqn(module)
                if set(self._mod_tracker.parents) - {name} == {"Global"}:
                    self.reset_mod_stats()
            super()._pre_fw_hook(module, inputs)

        def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True):
            # MemTracker hooks every parameter's gradient, and a frozen one (requires_grad=False:
            # a LoRA base weight) refuses a hook. It never gets a gradient: mark it as hooked.
            for param in module.parameters():
                if not param.requires_grad:
                    self._param_to_grad_hook_handles.setdefault(param, (_NO_HOOK, _NO_HOOK))
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def retag(self, old: set, new) -> None:
            """Move every live storage tracked under a type in ``old`` to type ``new``."""
            for winfo, _ in list(self._WINFO.values()):
                if winfo.reftype in old:
                    previous, winfo.reftype = winfo.reftype, new
                    self._update_snap(mt._UpdateType.REF, winfo, old_reftype=previous)

        def reset_peak(self) -> None:
            self._peak_mem_snap = self.get_tracker_snapshot("current")
            self._peak_mem = {dev: snap[mt._TOTAL_KEY] for dev, snap in self._peak_mem_snap.items()}

    return _Tracker, mt._MemRefType, mt._TOTAL_KEY


class MemoryTracker:
    """Live and peak tensor bytes of the training steps run inside it, by category.

    ``model`` and ``optimizer`` exist before tracking starts and are registered up front
    (weights, buffers, any gradients and optimizer state). ``inputs`` are the pre-made
    micro-batches: they belong to the data loader, not to the step, so they are never
    counted -- even when the model makes views of them -- matching the estimate, which
    counts the input batch only on CUDA. ``overhead`` are other pre-existing tensors to count
    as ``overhead_bytes``. The tracker keeps references to ``inputs`` so their bytes stay
    constant while it runs.

    With ``budget_bytes``, an operator that takes counted live bytes past the budget raises
    ``_BudgetExceeded`` inside the step (and :attr:`exceeded_bytes` is set); the trial turns
    it into status ``oom``.

    Call :meth:`reset_peak` after the warm-up steps, and :meth:`step_boundary` between
    iterations (a root module's next forward also counts as one).

    Example::

        with MemoryTracker(model, optimizer, inputs=batches, budget_bytes=2**30) as tracker:
            for _ in range(3):
                train_step(trainee, batches, on_micro_step=lambda i: tracker.step_boundary())
        tracker.peak_bytes, tracker.peak_breakdown()

    Known limitations: tensors that bypass the dispatcher (``no_dispatch``, storages resized
    by non-tensor methods) are not seen; tensors created before tracking and not registered
    (a cache a model built in an earlier untracked call) are not counted; sizes are storage
    bytes with no allocator rounding (this is the CPU, where there is no caching allocator).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, inputs: Any = (),
                 overhead: Iterable[torch.Tensor] = (), budget_bytes: int | None = None) -> None:
        tracker_cls, self._ref, self._total_key = _tracker_class()
        self._optimizer = optimizer
        self._tracker = tracker_cls(None)
        self._tracker.track_external(model, optimizer)
        # Inputs are tracked (as Other) so that a view of one made inside the step is seen as an
        # existing storage, not counted as a new activation; their bytes are subtracted when
        # reporting. Strong references keep that amount constant while tracking.
        self._inputs = _tensors(inputs)
        self._tracker.track_external(*self._inputs)
        self.input_bytes = storage_bytes(self._inputs)
        self._tracker.track_external(*_tensors(list(overhead)))
        self.budget_bytes = budget_bytes
        self.active = False  # inside ``with tracker:``
        if budget_bytes is not None:
            self._tracker.limit_bytes = budget_bytes + self.input_bytes

    def __enter__(self) -> "MemoryTracker":
        # A module built inside forward (transformers' T5 makes its CrossEntropyLoss there) is gone
        # before backward; MemTracker then warns twice per step that it skips that module's
        # per-module statistics. The totals this wrapper reads do not depend on them.
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.filterwarnings("ignore", message=r"Module is None\. Skipping (PRE|POST)_BW hook")
        self._tracker.__enter__()
        self.active = True
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.active = False
        try:
            self._tracker.__exit__(*exc_info)
        finally:
            self._warnings.__exit__(*exc_info)

    def step_boundary(self) -> None:
        """Between micro-steps and iterations: clear the per-module statistics."""
        self._tracker.reset_mod_stats()

    def reset_peak(self) -> None:
        """Start the peak afresh (after warm-up), from the tensors live now.

        Between steps, live tensors that are not parameters, gradients or optimizer state
        outlive the step: they are re-labelled overhead, not activations.
        """
        self._tracker.retag({self._ref.ACT, self._ref.TEMP}, self._ref.OTH)
        self._tracker.reset_peak()

    @property
    def exceeded_bytes(self) -> int | None:
        """Counted live bytes at the moment the budget was passed, or None."""
        live = self._tracker.exceeded_bytes
        return None if live is None else live - self.input_bytes

    @property
    def live_bytes(self) -> int:
        """Counted live tensor bytes now."""
        return self._tracker.live_total() - self.input_bytes

    @property
    def peak_bytes(self) -> int:
        """Largest counted live tensor bytes since tracking began or :meth:`reset_peak`."""
        return sum(self.peak_breakdown().values())

    def live_breakdown(self) -> dict[str, int]:
        """Counted live bytes now, by category (:data:`CATEGORIES`)."""
        return self._categorise(self._tracker.get_tracker_snapshot("current"))

    def peak_breakdown(self) -> dict[str, int]:
        """The composition of live bytes at the peak moment, by category; the values sum to the peak."""
        return self._categorise(self._tracker.get_tracker_snapshot("peak"))

    def _categorise(self, snapshot: dict) -> dict[str, int]:
        ref = self._ref
        by_type = {t: sum(dev.get(t, 0) for dev in snapshot.values()) for t in ref}
        state = min(by_type[ref.OPT], optimizer_state_bytes(self._optimizer))
        return {
            "params_bytes": by_type[ref.PARAM] + by_type[ref.BUFFER],
            "grads_bytes": by_type[ref.GRAD],
            "optimizer_bytes": state,
            "activations_bytes": by_type[ref.ACT],
            "temporary_bytes": by_type[ref.TEMP] + by_type[ref.OPT] - state,
            "overhead_bytes": max(0, by_type[ref.OTH] - self.input_bytes),
        }
