"""Profile a workload on fake tensors: the facts the memory and time models need.

One optimizer step is run under ``FakeTensorMode`` (no real memory, so a 7B model profiles
on a laptop) through the same code as a real trial (:mod:`autofit.runtime.training`), at two
micro-batch sizes per precision. A dispatch-mode timeline counts live tensor bytes after
every op; hooks on the layers cut the timeline into regions (the part before the layers,
each layer, the part after them, forward and backward, then the optimizer step). For each
region we keep where live bytes end and how high they peak, as lines ``c0 + c1·b`` in the
micro-batch ``b``. The memory model recombines these regions for any checkpoint interval,
device split and accumulation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.flop_counter import FlopCounterMode

from autofit.core.config import Precision, TrainConfig
from autofit.core.errors import WorkloadError
from autofit.profiling.data import (
    OUTPUT_REGIONS,
    PROFILE_BATCHES,
    LayerProfile,
    Line,
    PrecisionProfile,
    Region,
)
from autofit.profiling.real_check import RealTensors, correct_runs, refusal
from autofit.profiling.timeline import (
    Recorder,
    Timeline,
    first_tensor,
    freed_between,
    init_optimizer_state,
    max_tensor_bytes,
    round_up,
    state_tensors,
    tensor_bytes,
    watch_arguments,
)
from autofit.runtime.training import (
    autocast_context,
    build_trainee,
    forward_backward,
    to_device,
)
from autofit.workloads.base import Workload, checked_batch, explain_failure

# The CUDA caching allocator rounds every block up to 512 bytes (FACTS.md).
CUDA_BLOCK_BYTES = 512


def param_rows(params) -> tuple[tuple[int, int], ...]:
    """(size(0), bytes) of each parameter, tied ones once: FSDP2 shards and pads each on dim 0."""
    seen, rows = set(), []
    for p in params:
        if id(p.untyped_storage()) not in seen:
            seen.add(id(p.untyped_storage()))
            rows.append((int(p.shape[0]) if p.dim() else 1, int(p.numel() * p.element_size())))
    return tuple(rows)


def _run_once(workload: Workload, precision: Precision, micro_batch: int, device_type: str,
              fake_mode, real_batch, count_flops: bool = True, step_optimizer: bool = True) -> dict:
    """One profiled micro-step at ``micro_batch`` samples, plus the optimizer step (its state made
    first) when ``step_optimizer``; raw integers. Without it, the run has no ``optimizer_bytes`` nor
    ``opt_region``: neither depends on the micro-batch, so one run of the two holds them."""
    round_bytes = CUDA_BLOCK_BYTES if device_type == "cuda" else 1
    config = TrainConfig(precision=precision, micro_batch=micro_batch)
    with fake_mode:
        trainee = build_trainee(workload, config, device=device_type, fake=True)
        if step_optimizer:  # its state exists before the step, as in every step after the first
            init_optimizer_state(trainee)
        float_dtype = torch.bfloat16 if precision is Precision.BF16 else None
        # Tensors nested in dicts or lists (e.g. {"input_ids": ..., "labels": ...}) are made fake too
        inputs, targets = to_device(tree_map_only(torch.Tensor, fake_mode.from_tensor, tuple(real_batch)),
                                    trainee.device, float_dtype)
    batch_tensors = [t for t in tree_leaves((inputs, targets)) if isinstance(t, torch.Tensor)]
    model, layers = trainee.model, workload.layers(trainee.model)
    n = len(layers)
    params = [p for p in model.parameters()]
    buffers = list(model.buffers())
    state = state_tensors(trainee.optimizer)

    timeline = Timeline(round_bytes)
    rec = Recorder(timeline)
    handles = []
    layer_out: list[int] = [0] * n
    # Whether a layer saves its own output for backward (e.g. a final ReLU): then a
    # checkpointed segment's recomputation re-creates and keeps it (no early stop before it).
    output_saved: list[bool] = [False] * n
    saved_ptrs: list[set] = [set() for _ in range(n)]
    # Where each layer's forward saved its last tensor for backward (a timeline index): a
    # checkpointed segment's recomputation stops there (non-reentrant early stop).
    last_saved: list[int | None] = [None] * n
    saving: list = [None]
    # The storages each layer is called with (its input and any other tensor argument, e.g. an
    # encoder's output every decoder layer takes), each under the first layer that takes it, and
    # the timeline index at which each died: a checkpoint keeps its segment's arguments alive
    # until the segment's backward (``input_freed_late``/``args_freed_late`` below).
    taken: dict[int, int] = {}
    arg_bytes: list[dict] = [{} for _ in range(n)]
    died_at: dict[int, int] = {}
    phase = {"value": "pre"}
    module_phase: dict[int, str] = {}

    # Hooks go on each distinct layer module once and number the calls: a module listed several
    # times (weight sharing, ModuleList([block] * 4)) is layer i on its i-th call.
    calls = {"pre": 0, "post": 0}
    input_grad: list[bool] = [True] * n
    output_grad: list[bool] = [True] * n

    def numbered(key, hook):
        def wrapper(module, *args):
            i = calls[key]
            calls[key] += 1
            if i < n:  # a layer module also called outside the layer loop is not a layer call
                return hook(i)(module, *args)
        return wrapper

    def fwd_pre(i):
        def hook(module, args, kwargs):
            rec.mark(f"f{i}")
            watch_arguments(i, (args, kwargs), timeline, taken, arg_bytes, died_at)
            if i == 0:
                phase["value"] = "layers"

            def pack(t):
                saved_ptrs[i].add(t.untyped_storage()._cdata)
                last_saved[i] = len(timeline.trace)  # an input is saved before its op runs, an output after
                return t
            saving[0] = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            saving[0].__enter__()
        return hook

    def fwd_post(i):
        def hook(module, args, output):
            saving[0].__exit__(None, None, None)
            out = first_tensor(output)
            layer_out[i] = round_up(out.untyped_storage().nbytes(), round_bytes) if out is not None else 0
            output_saved[i] = out is not None and out.untyped_storage()._cdata in saved_ptrs[i]
            rec.mark(f"F{i}")
            if i == n - 1:
                phase["value"] = "post"
                # the last layer's input dies (where no backward keeps it) as the model moves on
                rec.mark_before_next_op("layers_done")
            output_grad[i] = out is not None and out.requires_grad
            if output_grad[i]:
                out.register_hook(lambda g: rec.mark(f"b{i}"))
            inp = first_tensor(args)
            input_grad[i] = inp is not None and inp.requires_grad
            if input_grad[i]:
                inp.register_hook(lambda g: rec.mark(f"B{i}"))
        return hook

    layer_ids = {id(m) for layer in layers for m in layer.modules()}

    def outer_hook(module, args):
        module_phase.setdefault(id(module), phase["value"])

    for layer in {id(layer): layer for layer in layers}.values():
        handles.append(layer.register_forward_pre_hook(numbered("pre", fwd_pre), with_kwargs=True))
        handles.append(layer.register_forward_hook(numbered("post", fwd_post)))

    def model_out(module, args, output):
        # Where the model's own forward ends and its output's gradient arrives: FSDP gathers and
        # frees the root's weights there, while the loss (outside the model) runs without them.
        rec.mark("out")
        out = first_tensor(output)
        if out is not None and out.requires_grad:
            out.register_hook(lambda g: rec.mark("dout"))

    handles.append(model.register_forward_hook(model_out))
    for module in model.modules():
        if id(module) not in layer_ids and module is not model:
            handles.append(module.register_forward_pre_hook(outer_hook))
    for p in params:
        if p.requires_grad:
            handles.append(p.register_post_accumulate_grad_hook(lambda p: timeline.mark_grad(p.grad)))

    # FLOPs for the time model: one counter over the forward, another over the backward.
    fwd_counter, bwd_counter = FlopCounterMode(display=False), FlopCounterMode(display=False)
    if not count_flops:  # counting costs time; FLOPs are counted at one batch size only
        fwd_counter = bwd_counter = contextlib.nullcontext()

    def between_forward_and_backward():
        fwd_counter.__exit__(None, None, None)
        rec.mark("loss")
        bwd_counter.__enter__()

    def backward_stops():
        # Backward ends inside a layer whose input needs no gradient (the first layer fed the raw
        # input or a frozen embedding's output): its backward runs to the end of the backward
        # pass, and layers before it (no gradient at all) have an empty one.
        names = {m[0] for m in rec.marks}
        for i in reversed(range(n)):
            if f"b{i}" not in names and not output_grad[i]:
                rec.mark(f"b{i}")
            if f"B{i}" not in names and not (input_grad[i] and output_grad[i]):
                rec.mark(f"B{i}")

    with fake_mode:
        timeline.register(params + buffers + state)
        timeline.register(batch_tensors, counted=False)
        timeline.reset_peaks()
        trainee.optimizer.zero_grad(set_to_none=True)
        with timeline:
            rec.mark("start")
            fwd_counter.__enter__()
            forward_backward(trainee, inputs, targets, before_backward=between_forward_and_backward)
            backward_stops()
            bwd_counter.__exit__(None, None, None)
            rec.mark("end")
            if step_optimizer:
                trainee.optimizer.step()
                rec.mark("opt")
    for h in handles:
        h.remove()
    with fake_mode, timeline:
        checkpointed = _checkpointed_forwards(trainee, layers, inputs, rec)

    layer_flops, fwd_flops, bwd_flops = [0.0] * n, 0.0, 0.0
    if count_flops:
        per_module = fwd_counter.get_flop_counts()
        fqn = {id(m): name for name, m in model.named_modules()}
        root = type(model).__name__
        uses = {id(layer): sum(other is layer for other in layers) for layer in layers}  # a shared module counts all its calls
        layer_flops = [float(sum(per_module.get(f"{root}.{fqn.get(id(layer), '')}", {}).values())) / uses[id(layer)]
                       for layer in layers]
        fwd_flops, bwd_flops = float(fwd_counter.get_total_flops()), float(bwd_counter.get_total_flops())
    names = [m[0] for m in rec.marks]
    missing = [f"b{i}" for i in range(n) if f"b{i}" not in names] + [f"B{i}" for i in range(n) if f"B{i}" not in names]
    if missing:
        raise WorkloadError(
            f"{workload.name}: could not follow the backward pass through layers ({missing[0]} missing); "
            "each layer must take the previous layer's output as its first input"
        )

    def reg(a, b):
        return rec.region(a, b)

    grads = {id(p): p for p in params if p.requires_grad}
    # A module listed several times owns its weights once: at its first place in the list.
    first_place = {id(layer): i for i, layer in reversed(list(enumerate(layers)))}
    layer_params = [list(layer.parameters()) if first_place[id(layer)] == i else [] for i, layer in enumerate(layers)]
    in_layers = {id(p) for ps in layer_params for p in ps}
    owner_phase: dict[int, set] = {}
    for module in model.modules():
        ph = module_phase.get(id(module))
        if ph is None:
            continue
        for p in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            owner_phase.setdefault(id(p), set()).add(ph)
    outside = [t for t in params + buffers if id(t) not in in_layers]
    pre_t = [t for t in outside if "pre" in owner_phase.get(id(t), {"pre"})]
    post_t = [t for t in outside if "post" in owner_phase.get(id(t), set()) or "layers" in owner_phase.get(id(t), set())]
    layer_buffers = [list(layer.buffers()) if first_place[id(layer)] == i else [] for i, layer in enumerate(layers)]

    return {
        "static_param_bytes": tensor_bytes(params + buffers, round_bytes),
        "grad_bytes": tensor_bytes(grads.values(), round_bytes),
        "grad_rows": param_rows(grads.values()),
        **({"optimizer_bytes": tensor_bytes(state, round_bytes), "opt_region": reg("end", "opt")[:4]}
           if step_optimizer else {}),
        "pre_param_bytes": tensor_bytes(pre_t, round_bytes),
        # weights used before and after the layers (a tied embedding and head): a split copies them
        "tied_bytes": tensor_bytes([t for t in pre_t if any(t is u for u in post_t)], round_bytes),
        "post_param_bytes": tensor_bytes(post_t, round_bytes),
        "pre_grad_bytes": tensor_bytes([t for t in pre_t if id(t) in grads], round_bytes),
        "post_grad_bytes": tensor_bytes([t for t in post_t if id(t) in grads], round_bytes),
        "pre_max_grad_tensor_bytes": max_tensor_bytes([t for t in pre_t if id(t) in grads], round_bytes),
        "post_max_grad_tensor_bytes": max_tensor_bytes([t for t in post_t if id(t) in grads], round_bytes),
        "pre_forward": reg("start", "f0"),
        "post_forward": reg("layers_done", "loss"),
        "post_backward": reg("loss", f"b{n - 1}"),
        **_model_output_regions(rec, n),
        "pre_backward": reg("B0", "end"),
        "forward_flops": fwd_flops,
        "backward_flops": bwd_flops,
        "input_bytes": tensor_bytes(batch_tensors, round_bytes),
        "step_peak_bytes": max((live for live, _ in timeline.trace), default=0),
        "layers": [
            {
                "param_bytes": tensor_bytes(layer_params[i] + layer_buffers[i], round_bytes),
                "grad_bytes": tensor_bytes([p for p in layer_params[i] if p.requires_grad], round_bytes),
                "max_grad_tensor_bytes": max_tensor_bytes([p for p in layer_params[i] if p.requires_grad], round_bytes),
                "grad_rows": param_rows([p for p in layer_params[i] if p.requires_grad]),
                "output": layer_out[i],
                "output_saved": output_saved[i],
                "forward": reg(f"f{i}", f"F{i}"),
                "recompute": _prefix(rec, f"f{i}", last_saved[i]),
                "checkpointed_forward": checkpointed[i],
                # what dies before the next layer starts (the last: before the next operator):
                # this layer's input, when no backward keeps it
                "after": reg(f"F{i}", f"f{i + 1}" if i < n - 1 else "layers_done")[0],
                "backward": reg(f"b{i}", f"B{i}"),
                "input_freed_late": freed_between(rec, arg_bytes[i], died_at, "layers_done", "loss", True),
                "args_freed_late": freed_between(rec, arg_bytes[i], died_at, "layers_done", "loss", False),
                "forward_flops": layer_flops[i],
            }
            for i in range(n)
        ],
    }


def _checkpointed_forwards(trainee, layers, inputs, rec: Recorder) -> list[tuple]:
    """Each layer's forward as a checkpointed segment's forward runs it, as :meth:`Recorder.region`
    gives it: autograd keeps none of the tensors it saves (the checkpoint's pack hook stores no
    tensor), so each dies with its last Python reference. One more forward of the model, its output
    dropped."""
    n = len(layers)
    calls = {"c": 0, "C": 0}

    def marker(name: str):
        def hook(module, *args):
            i, calls[name] = calls[name], calls[name] + 1
            if i < n:
                rec.mark(f"{name}{i}")
        return hook

    unique = {id(layer): layer for layer in layers}.values()
    handles = [layer.register_forward_pre_hook(marker("c")) for layer in unique]
    handles += [layer.register_forward_hook(marker("C")) for layer in unique]
    try:
        with autocast_context(trainee.config.precision, trainee.device.type), \
                torch.autograd.graph.saved_tensors_hooks(lambda t: None, lambda saved: None):
            trainee.model(inputs)
    finally:
        for h in handles:
            h.remove()
    return [rec.region(f"c{i}", f"C{i}") for i in range(n)]


def _prefix(rec: Recorder, start: str, stop: int | None) -> tuple:
    """The region from mark ``start`` to timeline index ``stop`` (exclusive), as :meth:`Recorder.region`
    gives it; nothing (all zeros) when ``stop`` is None (the layer saved nothing)."""
    first = rec.marks[[m[0] for m in rec.marks].index(start)]
    live0, ng0, at = first[1], first[2], first[5]
    points = rec.t.trace[at:stop] if stop is not None and stop > at else [(live0, ng0)]
    live = [p[0] - live0 for p in points]
    nongrad = [p[1] - ng0 for p in points]
    return live[-1], max(live), nongrad[-1], max(nongrad), live, nongrad


def _line(v1: float, v2: float) -> Line:
    b1, b2 = PROFILE_BATCHES
    slope = (v2 - v1) / (b2 - b1)
    return (float(v1 - slope * b1), float(slope))


def _flops_line(flops: float) -> Line:
    """FLOPs grow in proportion to the micro-batch (every op's work is per sample)."""
    return (0.0, flops / PROFILE_BATCHES[-1])


def _steepest(points1: list[int], points2: list[int]) -> Line:
    """The line of the op whose live bytes grow fastest with the micro-batch (ties: the higher).
    The two runs execute the same ops in the same order, so points pair up one to one;
    if they do not, the fitted peak is all that can be said."""
    if len(points1) != len(points2) or not points1:
        return _line(max(points1, default=0), max(points2, default=0))
    return max((_line(a, b) for a, b in zip(points1, points2)), key=lambda line: (line[1], line[0]))


def _model_output_regions(rec: "Recorder", n: int) -> dict:
    """The after-layers regions cut at the model's output (None where it has no gradient)."""
    names = {m[0] for m in rec.marks}
    if not {"out", "dout"} <= names:
        return {}
    return {"head_forward": rec.region("layers_done", "out"), "loss_forward": rec.region("out", "loss"),
            "loss_backward": rec.region("loss", "dout"), "head_backward": rec.region("dout", f"b{n - 1}")}


def _region_lines(r1: tuple, r2: tuple) -> Region:
    lines = [_line(a, b) for a, b in zip(r1[:4], r2[:4])]
    return Region(*lines, steep=_steepest(r1[4], r2[4]), steep_nongrad=_steepest(r1[5], r2[5]))


def _run_fake(workload: Workload, precision: Precision, micro_batch: int, device_type: str, real_batch) -> dict:
    """One profiled step on fake tensors. On CUDA, a model whose cuDNN kernels refuse fake tensors
    (an RNN: ``flatten_parameters`` and ``_cudnn_rnn`` call cuDNN with fake pointers and fail with
    CUDNN_STATUS_BAD_PARAM) is profiled again with cuDNN off: its native kernels have fake
    implementations. They save each step's gates where cuDNN keeps a reserve buffer (which torch's
    fake kernel sizes as 0 anyway), so the profile is that of the native kernels; the trials on the
    device measure the real one and calibration corrects the estimate."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    # FLOPs and the optimizer step do not depend on the micro-batch: counted and run at the larger one only
    # (each costs about as much as the forward and backward on fake tensors).
    full = micro_batch == PROFILE_BATCHES[-1]
    try:
        with _quiet_fake_kernels():
            return _run_once(workload, precision, micro_batch, device_type, FakeTensorMode(), real_batch, full, full)
    except Exception as exc:
        if device_type != "cuda" or "cudnn" not in f"{type(exc).__name__} {exc}".lower():
            raise
    with torch.backends.cudnn.flags(enabled=False), _quiet_fake_kernels():
        return _run_once(workload, precision, micro_batch, device_type, FakeTensorMode(), real_batch, full, full)


@contextlib.contextmanager
def _quiet_fake_kernels():
    """FakeTensorMode logs a traceback when a fake kernel raises (a user's shape mistake) before the
    error reaches us; the user gets it as one line (WorkloadError), in whichever process profiles."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    disabled, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = disabled


def profile_precision(workload: Workload, precision: Precision, device_type: str = "cpu",
                      split_ends: bool = True) -> PrecisionProfile:
    """Profile one precision on fake tensors. Raises WorkloadError if the model can't be traced.

    ``split_ends=False`` leaves out :func:`profile_split_ends` (a model with tied weights is then
    marked ``split_ends_skipped``): for callers that estimate no pipeline split."""
    runs = {}
    real_batches = {b: checked_batch(workload, b) for b in PROFILE_BATCHES}
    for b in PROFILE_BATCHES:
        try:
            runs[b] = _run_fake(workload, precision, b, device_type, real_batches[b])
        except WorkloadError:
            raise
        except Exception as exc:
            raise WorkloadError(explain_failure(workload.name, exc)) from exc
    runs, real_note, real_extra = _real_check(workload, precision, device_type, runs, real_batches)
    pp = _assemble(precision, runs, real_check=real_note, real_extra_bytes_per_sample=real_extra)
    if not runs[PROFILE_BATCHES[0]]["tied_bytes"]:
        return pp
    if not split_ends:
        return dataclasses.replace(pp, split_ends_skipped=True)
    return with_split_ends(pp, profile_split_ends(workload, precision, device_type, real_batches))


def profile_split_ends(workload: Workload, precision: Precision, device_type: str = "cpu",
                       real_batches: dict | None = None) -> PrecisionProfile:
    """The model's ends as a device split's first and last stages run them, for a model with a
    weight tied across its ends. Each of those stages holds its own copy of that weight and
    accumulates only its own gradient (no sum of the two): the ends are profiled on the model with
    those weights untied (fake runs only; :func:`with_split_ends` attaches them)."""
    untied = dataclasses.replace(workload, model=functools.partial(_build_untied, workload.model))
    real_batches = real_batches or {b: workload.batch(b) for b in PROFILE_BATCHES}
    return _assemble(precision, {b: _run_fake(untied, precision, b, device_type, real_batches[b])
                                 for b in PROFILE_BATCHES})


def with_split_ends(pp: PrecisionProfile, ends: PrecisionProfile) -> PrecisionProfile:
    """``pp`` with ``ends`` (:func:`profile_split_ends`) as its split ends; the layers stay ``pp``'s
    (the real check's corrections included)."""
    return dataclasses.replace(pp, split_ends=dataclasses.replace(ends, layers=pp.layers), split_ends_skipped=False)


def _build_untied(build) -> nn.Module:
    """``build()`` with every parameter shared by two modules replaced, in the second, by a copy."""
    model = build()
    owner: dict[int, nn.Module] = {}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if owner.setdefault(id(p), module) is not module:
                setattr(module, name, nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))
    return model


def _assemble(precision: Precision, runs: dict, **extra) -> PrecisionProfile:
    r1, r2 = runs[PROFILE_BATCHES[0]], runs[PROFILE_BATCHES[1]]
    layers = []
    for i, (l1, l2) in enumerate(zip(r1["layers"], r2["layers"])):
        layers.append(LayerProfile(
            param_bytes=l1["param_bytes"], grad_bytes=l1["grad_bytes"],
            output=_line(l1["output"], l2["output"]), output_saved=l1["output_saved"],
            max_grad_tensor_bytes=l1["max_grad_tensor_bytes"], grad_rows=l1["grad_rows"],
            forward=_region_lines(l1["forward"], l2["forward"]),
            recompute=_region_lines(l1["recompute"], l2["recompute"]),
            checkpointed_forward=_region_lines(l1["checkpointed_forward"], l2["checkpointed_forward"]),
            backward=_region_lines(l1["backward"], l2["backward"]), after=_line(l1["after"], l2["after"]),
            **{k: _line(l1.get(k, 0), l2.get(k, 0)) for k in ("input_freed_late", "args_freed_late")},
            forward_flops=_flops_line(l2["forward_flops"]),
        ))
    opt_peak = r2["opt_region"][1]
    return PrecisionProfile(
        precision=precision.value,
        static_param_bytes=r1["static_param_bytes"], grad_bytes=r1["grad_bytes"],
        optimizer_bytes=r2["optimizer_bytes"], optimizer_peak_bytes=max(0, opt_peak), grad_rows=r1["grad_rows"],
        pre_param_bytes=r1["pre_param_bytes"], post_param_bytes=r1["post_param_bytes"],
        pre_grad_bytes=r1["pre_grad_bytes"], post_grad_bytes=r1["post_grad_bytes"],
        pre_max_grad_tensor_bytes=r1["pre_max_grad_tensor_bytes"],
        post_max_grad_tensor_bytes=r1["post_max_grad_tensor_bytes"],
        pre_forward=_region_lines(r1["pre_forward"], r2["pre_forward"]),
        post_forward=_region_lines(r1["post_forward"], r2["post_forward"]),
        post_backward=_region_lines(r1["post_backward"], r2["post_backward"]),
        **{k: _region_lines(r1[k], r2[k]) for k in OUTPUT_REGIONS if k in r1 and k in r2},
        pre_backward=_region_lines(r1["pre_backward"], r2["pre_backward"]),
        input_bytes=_line(r1["input_bytes"], r2["input_bytes"]),
        layers=tuple(layers),
        forward_flops=_flops_line(r2["forward_flops"]),
        backward_flops=_flops_line(r2["backward_flops"]),
        optimizer_flops=0.0, **extra,
    )


def _real_check(workload: Workload, precision: Precision, device_type: str, runs: dict,
                real_batches: dict) -> tuple[dict, str, float]:
    """The fake runs corrected by real steps at the profiled micro-batches (:mod:`autofit.profiling.real_check`),
    a note saying what was done, and the bytes per sample the real step keeps beyond the fake one."""
    b1, b2 = PROFILE_BATCHES
    why = refusal(runs[b2]["step_peak_bytes"], device_type)
    if why is not None:
        return runs, f"no real step: {why}", 0.0

    def real_run(b: int) -> dict:
        with torch.random.fork_rng(devices=[]):  # the caller's random stream is left as it was
            return _run_once(workload, precision, b, device_type, RealTensors(), real_batches[b], False, False)

    try:
        real1 = real_run(b1)
        # Most models match at b1: only a mismatch pays for the second real step.
        r1, r2, corrected, extra = correct_runs(runs[b1], runs[b2], real1, None, b1, b2)
        if corrected:
            r1, r2, corrected, extra = correct_runs(runs[b1], runs[b2], real1, real_run(b2), b1, b2)
    except Exception as exc:  # noqa: BLE001 -- a step that fails for real fails in the trial too, with its error
        lines = [line for line in str(exc).splitlines() if line.strip()]
        return runs, f"no real step: it failed ({type(exc).__name__}: {lines[0] if lines else ''})"[:300], 0.0
    if not corrected:
        return runs, f"real step at micro-batch {b1} on {device_type}: matches the fake profile", 0.0
    return ({b1: r1, b2: r2}, f"real steps at micro-batches {b1} and {b2} on {device_type}: {corrected} regions corrected, "
            f"{extra:,.0f} bytes per sample more kept than on fake tensors", float(extra))
