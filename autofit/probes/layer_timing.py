"""The time model's prior from the workload's own layer: one repeated layer, timed for real.

The device probe (:func:`autofit.probes.device_rates.probe_rates`) times a bare square matmul; a
workload's layers run smaller, thinner matrices, normalisations, attention, recurrences, at a
rate that can be several times lower (the uncalibrated prior was 13-65% fast on the bench's
grids). So before a search, a child process builds the model on the meta device (no memory),
captures what its first repeated layer receives at two small micro-batches, materialises that
one layer and those inputs with random values, and times a forward and backward of it in each
precision (``autocast`` for the amp modes, the layer cast for bf16), the repeats in rounds over every
precision and micro-batch, three to five rounds as their time allows (:func:`_timed_interleaved`).
Against the time model's own prediction for that layer
(:func:`autofit.estimator.time_model.layer_time_line`) this gives two factors per precision -- one
for the per-sample part (FLOPs, activation traffic), one for the fixed part (operators, weight
traffic) -- which :func:`autofit.estimator.time_model.predict_table` applies to the whole model
(:attr:`autofit.estimator.time_model.OpCounts.layer_scales`).

A model whose forward cannot run on the meta device before its first layer -- one that reads a
value there, as ``transformers``' mask code does (``Tensor.item() cannot be called on meta
tensors``) -- is built for real instead (when its weights fit what a probe may take,
:func:`autofit.profiling.real_check.available_bytes`) and run on the workload's own small batches;
its first layer and the integer and boolean inputs it received (positions, masks) are then taken
as they are, the floating ones still random.

A layer predicted to take longer than :data:`MAX_LAYER_S` at the larger micro-batch (a 7B
model's layer on a CPU) is not timed: there the large-matrix rate is the right one anyway.
The measured lines are cached on disk like the profiles; a failing probe leaves the prior as it
was and says why in one line (its traceback under ``--debug``: :mod:`autofit.probes.failures`).
Nothing here is a table of known architectures: only the workload in hand is run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Callable, NamedTuple

from autofit.core.files import write_atomic
from autofit.runtime import forkserver, procs

LAYER_BATCHES = (2, 8)
MAX_LAYER_S = 0.5      # predicted seconds of one layer's forward + backward at the larger micro-batch
SCALE_RANGE = (0.2, 20.0)  # factors outside it are taken as a failed measurement, not a layer
PROBE_TIMEOUT_S = 180.0
_REPEATS = 5
# Rounds always taken, and the timed seconds after which no further round starts: a small model's layer
# gets all _REPEATS rounds in well under a second, while a long-sequence or wide one (gpt-mini at 512 tokens:
# 0.3 s a round) stops after the third, 0.6 s sooner, which a search's first use waits for.
_MIN_REPEATS = 3
_ROUNDS_BUDGET_S = 0.5
LAYER_PROBE_VERSION = 3  # 2: untouched floats drawn, not left uninitialised; a real model where meta cannot run;
                         # 3: repeats interleaved over precisions and micro-batches


class _Captured(Exception):
    """Raised by the capture hook to stop the meta forward once the layer's inputs are known."""


def _captured_inputs(workload, model, micro_batch: int):
    """(args, kwargs) the first repeated layer of ``model`` receives at ``micro_batch``, on the model's device."""
    import torch

    from autofit.runtime.training import to_device

    device = next((t.device for t in [*model.parameters(), *model.buffers()]), torch.device("cpu"))
    layer = workload.layers(model)[0]
    seen = {}

    def hook(_module, args, kwargs):
        seen["args"], seen["kwargs"] = args, kwargs
        raise _Captured

    handle = layer.register_forward_pre_hook(hook, with_kwargs=True)
    inputs, _ = workload.batch(micro_batch)
    try:
        with torch.no_grad() if device.type != "meta" else contextlib.nullcontext():
            model(to_device(inputs, device))
    except _Captured:
        pass
    finally:
        handle.remove()
    if "args" not in seen:
        raise RuntimeError("the first layer was never called")
    return seen["args"], seen["kwargs"]


def _capture(workload, batches) -> tuple[dict, object]:
    """``({micro_batch: (args, kwargs)}, real model or None)``: the first layer's inputs captured on the
    meta device, else -- where the model's forward cannot run there -- on a real model."""
    import torch

    from autofit.probes.failures import one_line
    from autofit.profiling.real_check import available_bytes

    with torch.device("meta"):
        model = workload.model()
    try:
        return {b: _captured_inputs(workload, model, b) for b in batches}, None
    except Exception as exc:  # noqa: BLE001 -- e.g. Tensor.item() in a model's mask code: try a real model
        meta_error = one_line(exc)
    nbytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    limit = available_bytes("cpu")
    if nbytes > limit:
        raise RuntimeError(f"the model's forward cannot run on the meta device ({meta_error}) and the real "
                           f"model's {nbytes / 2**20:,.0f} MiB are over the {limit / 2**20:,.0f} MiB a probe may take")
    del model
    model = workload.model()
    model.train()
    return {b: _captured_inputs(workload, model, b) for b in batches}, model


def _materialise(value, float_dtype):
    """Captured tensors become fresh real ones of the same shape: floats random (requiring grad, as a
    layer's input in a model does); integers and booleans as captured on a real model, else (meta)
    integers zero and booleans true; containers are rebuilt."""
    import torch

    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            dtype = float_dtype if float_dtype is not None else value.dtype
            return torch.randn(value.shape, dtype=dtype).requires_grad_(True)
        if value.device.type != "meta":
            return value.detach().clone()
        if value.dtype is torch.bool:
            return torch.ones(value.shape, dtype=torch.bool)
        return torch.zeros(value.shape, dtype=value.dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_materialise(v, float_dtype) for v in value)
    if isinstance(value, dict):
        return {k: _materialise(v, float_dtype) for k, v in value.items()}
    return value


def _real_layer(workload, precision, real_model=None):
    """The first layer, real, in the precision's parameter dtype: a copy of ``real_model``'s, else
    materialised from the meta device (modules with ``reset_parameters`` reset; floating tensors of
    the others drawn from N(0, 0.02), never left as uninitialised memory, whose denormals or NaNs
    would time a different layer)."""
    import copy

    import torch

    from autofit.runtime.training import param_dtype

    if real_model is not None:
        layer = copy.deepcopy(workload.layers(real_model)[0])
    else:
        with torch.device("meta"):
            model = workload.model()
        layer = workload.layers(model)[0].to_empty(device="cpu")
        with torch.no_grad():
            done = set()
            for module in layer.modules():
                reset = getattr(module, "reset_parameters", None)
                if callable(reset):
                    reset()
                    done |= {id(t) for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]}
            for tensor in [*layer.parameters(), *layer.buffers()]:
                if id(tensor) not in done and tensor.is_floating_point():
                    tensor.normal_(0.0, 0.02)
    layer.train()
    return layer.to(dtype=param_dtype(precision))


def _layer_step(layer, args, kwargs, precision) -> Callable[[], None]:
    """One forward and backward of ``layer`` on these inputs, as a closure to time."""
    import torch

    from autofit.runtime.training import autocast_context

    def step():
        with autocast_context(precision, "cpu"):
            out = layer(*args, **kwargs)
        outs = [t for t in (out if isinstance(out, (list, tuple)) else [out])
                if isinstance(t, torch.Tensor) and t.requires_grad]
        torch.autograd.backward([t.float().sum() for t in outs])
        layer.zero_grad(set_to_none=True)

    return step


def _timed_interleaved(steps: dict[tuple[str, int], Callable[[], None]], repeats: int = _REPEATS,
                       failed: Callable[[str, Exception], None] = lambda name, exc: None,
                       min_repeats: int = _MIN_REPEATS, budget_s: float = _ROUNDS_BUDGET_S,
                       clock: Callable[[], float] = time.perf_counter) -> dict[tuple[str, int], list[float]]:
    """Each step's timed calls (seconds, fastest first), taken in rounds (every step once per round), so a
    slowdown that lasts a while (another process, a frequency change) spreads over all the steps instead of
    inflating every repeat of one: the fixed part of a line is the small difference of two timings, which
    one slowed point turns by several times. ``repeats`` rounds at most; after ``min_repeats`` of them, none
    starts once the rounds have taken ``budget_s``. The spread the caller reports (next best less best)
    tends to be wider over fewer repeats, so a layer timed less is trusted less. A step that raises is
    dropped with ``failed(its precision, error)``, and the rest of its precision with it."""
    times: dict[tuple[str, int], list[float]] = {key: [] for key in steps}
    started = clock()
    for round_no in range(repeats):
        if round_no >= min_repeats and clock() - started >= budget_s:
            break
        for key in list(times):
            if key not in times:
                continue  # its precision failed earlier in this round
            start = clock()
            try:
                steps[key]()
            except Exception as exc:  # noqa: BLE001 -- reported per precision by the caller
                failed(key[0], exc)
                times = {k: v for k, v in times.items() if k[0] != key[0]}
                continue
            times[key].append(clock() - start)
    return {key: sorted(v) for key, v in times.items()}


def layer_probe_child(request: dict, send=None) -> dict:
    """In a probe child: ``{"seconds": {precision: [best seconds at each of LAYER_BATCHES]}, "spread_s":
    {precision: [next best less best, at each]}, "failed": {precision: error reply}}`` of the workload's
    first layer. A precision whose layer fails (a kernel this device lacks for it: oneDNN's LSTM under
    bf16 autocast on an AVX2 CPU) is left out of ``seconds``, the others kept; a failure before any
    precision is timed is the child's error reply."""
    import torch

    from autofit.probes.failures import error_reply
    from autofit.workloads.load import load_workload

    try:
        workload = load_workload(request["source"])
        torch.manual_seed(0)
        captured, real_model = _capture(workload, request["batches"])
    except Exception as exc:  # noqa: BLE001 -- the parent says it in one line, the traceback under --debug
        return error_reply(exc)
    batches, steps, failed = request["batches"], {}, {}
    for name in request["precisions"]:
        try:
            steps.update(_precision_steps(workload, name, real_model, captured, batches))
        except Exception as exc:  # noqa: BLE001 -- as above, per precision
            failed[name] = error_reply(exc)
    times = _timed_interleaved(steps, failed=lambda name, exc: failed.setdefault(name, error_reply(exc)))
    names = [name for name in request["precisions"]
             if name not in failed and all(times.get((name, b)) for b in batches)]
    if not names and failed:
        return next(iter(failed.values()))
    # the best call of each point, and how far the next best is from it (how well the best is known)
    return {"seconds": {name: [times[(name, b)][0] for b in batches] for name in names},
            "spread_s": {name: [_next_gap(times[(name, b)]) for b in batches] for name in names},
            "failed": failed}


def _next_gap(times: list[float]) -> float:
    return times[1] - times[0] if len(times) > 1 else 0.0


def _precision_steps(workload, name: str, real_model, captured, batches) -> dict[tuple[str, int], Callable[[], None]]:
    """The layer's step at each micro-batch in precision ``name``, each run once (kernel selection, the
    thread pool's start) so that every timed call is warm. Raises what the layer raises."""
    import torch

    from autofit.core.config import Precision

    precision = Precision(name)
    torch.manual_seed(0)
    layer = _real_layer(workload, precision, real_model)
    float_dtype = torch.bfloat16 if precision is Precision.BF16 else None
    steps = {}
    for b in batches:
        args, kwargs = _materialise(captured[b], float_dtype)
        steps[(name, b)] = _layer_step(layer, args, kwargs, precision)
        steps[(name, b)]()  # warm-up
    return steps


def _cache_path(key: str, precisions: list[str], device_type: str) -> Path:
    """``key``: the workload's profile key (:func:`autofit.profiling.cache.profile_key`: its model's
    shapes, settings and code by content, never a path or an mtime), so the profile and the layer
    timings of a workload are stale or reused together, across checkouts and ``touch`` alike."""
    import torch

    from autofit.profiling.cache import cache_dir

    ident = repr((LAYER_PROBE_VERSION, key, sorted(precisions), LAYER_BATCHES, device_type, torch.__version__,
                  os.environ.get("OMP_NUM_THREADS") or str(torch.get_num_threads())))
    return cache_dir() / f"layer-{hashlib.sha256(ident.encode()).hexdigest()[:16]}.json"


class LayerTimings(NamedTuple):
    """Per precision, the best seconds of the layer's forward + backward at each of :data:`LAYER_BATCHES`,
    and how much slower the next best call was (how well each best is known; empty when not measured)."""

    seconds: dict[str, list[float]]
    spread_s: dict[str, list[float]]


def measure_layer_timings(source: str, precisions: list[str], device_type: str = "cpu",
                          use_cache: bool = True, note: Callable[[str], None] | None = None,
                          key: str | None = None) -> LayerTimings | None:
    """Timings of the first layer's forward + backward at :data:`LAYER_BATCHES`, per precision, measured
    in a child forked from the trials' fork server (in the trials' environment), else a fresh one
    (in the same environment: :func:`autofit.runtime.procs.child_env`), and cached. None when the
    workload has no layer to time or the child fails (the prior stays the bare-matmul one).
    ``note`` is called with a line for a user: the timings read from the cache, or the timing starting and done.
    ``key``: the workload's profile key, under which the timings are cached (without one, nothing is)."""
    from autofit.probes.failures import child_failure, reply_failure

    if device_type != "cpu" or not precisions:
        return None  # on CUDA the probe child would need its own context: the bare-matmul prior stays
    note = note or (lambda line: None)
    use_cache = use_cache and bool(key)
    path = _cache_path(key or "", precisions, device_type)
    if use_cache and path.is_file():
        try:
            timings = _timings(json.loads(path.read_text()))
            note(f"the workload's layer timings read from the cache ({path})")
            return timings
        except (OSError, ValueError, KeyError):
            pass
    note(f"timing one layer of the workload for real ({', '.join(precisions)}; micro-batches "
         f"{' and '.join(map(str, LAYER_BATCHES))})...")
    started = time.perf_counter()
    request = {"source": source, "precisions": precisions, "batches": list(LAYER_BATCHES)}
    child = None
    if forkserver.enabled():  # as a trial runs (and it warms the fork server for the first trial)
        with contextlib.suppress(OSError):
            child = forkserver.start_trial("autofit.probes.layer_timing:layer_probe_child", request, timeout_s=PROBE_TIMEOUT_S,
                                           echo_stderr=False)
    if child is None:
        child = procs.spawn("autofit.probes.layer_timing:layer_probe_child", request, timeout_s=PROBE_TIMEOUT_S,
                            env=procs.child_env())
    try:
        finished = child.wait()
    finally:
        child.kill()
    message = child.last_message()
    if not message or "seconds" not in message:
        cause = child_failure(child, finished, "timing the layer")
        note(f"timing the layer failed after {time.perf_counter() - started:.1f} s ({cause}): the prior stays "
             "the device probe's")
        return None
    for name, reply in (message.get("failed") or {}).items():
        note(f"timing the layer at {name} failed ({reply_failure(reply, f'timing the layer at {name}')}): "
             f"{name} gets the other precisions' factors")
    note(f"timed the layer in {time.perf_counter() - started:.1f} s")
    if use_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps(message))  # a concurrent reader never sees half a file
        except OSError:
            pass
    return _timings(message)


def _timings(message: dict) -> LayerTimings:
    return LayerTimings(dict(message["seconds"]), dict(message.get("spread_s") or {}))
