#!/usr/bin/env python
"""One GPU check for a short loan of a CUDA machine: estimates against the card, an emulated 8 GB card, a search.

Run from a checkout, nothing installed (CUDA torch >= 2.11, transformers, pandas; optuna only
for part c)::

    # once, where there is network, from the repository root: the wheels for part c (optuna and
    # its dependencies, plus nvidia-ml-py for the context measurement) go to the ignored .whl/
    # (see the docstring's end for the download command)
    # on the GPU machine, from the repository root (the integrator's one command):
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:.
    PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py --out "$OUT/gpu"
    # a focused rerun (about 300 s): --parts a,b,c --workloads gpt-tiny,hf-gpt2,hf:llama,convnet-bn,lstm-lm,gpt-mini
    # the CUDA profiles a CPU build cannot run (about 60 s): --parts a --workloads lstm-lm,hf:llama
    #   (lstm-lm: cuDNN refuses fake tensors, profiled with cuDNN off; hf:llama: grouped-query attention)
    # (a Python without pip: unzip instead, for w in .whl/*.whl; do python3 -m zipfile -e $w /tmp/site; done)

Parts, each in its own child processes, each failure recorded in the table and the run going on;
a global time guard (``--time-limit``, default 300 s) ends the run in time (``--parts a,b,c`` runs some):

a. accuracy on CUDA: for the built-ins ``gpt-tiny``, ``gpt-mini``, ``convnet-bn``, ``lstm-lm`` and
   Hugging Face models built from local configs (4 layers, d=256, seq 128): Llama through
   autofit's own ``hf:`` spec, and GPT-2 and Llama through a wrapper a user would write
   (:func:`hf_gpt2_workload`, :func:`hf_llama_workload`; the Llama one last, if time is left), over fp32, amp-bf16, bf16, amp-fp16,
   checkpointing on and off, micro-batch 2-8, and on ``gpt-tiny`` and ``hf-gpt2`` two configs with
   ``offload=optimizer`` (where torchao is installed; its wheel is in ``.whl/``): autofit's estimate (``profile_workload`` on fake
   tensors, ``memory_model.estimate``, device type cuda) against ``max_memory_allocated``,
   ``max_memory_reserved`` and reserved + the CUDA context, measured by autofit's own trial code
   (:func:`autofit.trial.measure.measure_trial`) in a child process. The context is the process's use
   of the card (NVML, else ``nvidia-smi``, else ``mem_get_info``; the card's use before the child
   touched CUDA subtracted) less the allocator's reserved bytes. One config per workload runs
   twice: the ground truth's own noise.
b. an emulated 8 GB card (``8GB`` as ``autofit search --budget`` reads it), enforced by autofit's own
   ``measure_trial``: the allocator capped with ``set_per_process_memory_fraction`` at 8 GB less the
   measured context, and a run whose reserved + context exceeds 8 GB counted as ``oom``. On ``gpt2``, a
   config the estimate puts at 9-16 GB must come back ``oom``; the largest predicted under 8 GB
   and the largest under 80% of it must run with reserved + context within 8 GB. The same over
   and edge configs also go through autofit's own trial runner (``run_trial(..., budget_bytes)``), and
   the edge config once more: in the trial host the first one left, with the same card bytes (within 1%).
c. ``autofit search --model gpt2 --budget 8GB --device cuda`` for a few trials (needs optuna):
   its answer must fit the emulated card (reserved + the context measured in a) with no OOM trial.
d. the 2-GPU pipeline split (a trial and ``scripts/run_split_torchrun.py``) and FSDP
   (``split_mode=fsdp``) where two GPUs are present. Skipped with a line otherwise.

Writes ``gpu_check.md`` and ``gpu_check.csv`` under ``--out`` (default
``results/benchmarks/gpu``), naming the device, torch version and date, and prints one line
``VERDICT: PASS|FAIL ...`` (exit status 0 or 1). ``--device cpu --quick`` runs the plumbing on
the CPU with one tiny config per workload (the CUDA-only parts skip): the unit test does that.

The wheels, downloaded once into ``.whl/`` (ignored by git) for Python 3.12 on x86-64 Linux::

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \\
        -d .whl optuna==5.0.0 alembic==1.20.1 sqlalchemy==2.1.9 colorlog==6.12.0 Mako==1.4.3 \\
        MarkupSafe==3.0.4 typing_extensions==4.16.0 nvidia-ml-py==13.580.82
    python3 -m pip download --no-deps --only-binary=:all: -d .whl torchao==0.18.0  # offload=optimizer (abi3)

(numpy, packaging, tqdm and PyYAML come with transformers).
"""

from __future__ import annotations

import time

PROCESS_START = time.monotonic()  # the time guard counts the imports too

import argparse
import copy
import csv
import datetime as dt
import gc
import importlib.util
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import asdict, dataclass, fields
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve()
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import torch  # noqa: E402
from torch import nn  # noqa: E402

ROW_PREFIX = "@@GPUCHECK "
CARD_BUDGET = "8GB"
# Accuracy targets against what the card holds: the median and the largest |error|, and the largest
# under-estimate allowed (an estimate under the card is a config that may not fit).
TARGET_MEDIAN = 0.02
TARGET_MAX = 0.06
TARGET_UNDER = 0.03
DEFAULT_TIME_LIMIT_S = 300.0  # the run ends within ~10 s of it
# Share of the time limit by which each part must end (cumulative); estimates come first.
PART_END = {"estimates": 0.15, "a": 0.50, "b": 0.63, "c": 0.96, "d": 1.0}

HF_SEQ = 128
HF_VOCAB = 8192

# (precision, micro_batch, grad_accum, checkpoint_every); the second config is repeated for noise.
A_CONFIGS = [
    "precision=fp32,micro_batch=2", "precision=fp32,micro_batch=8", "precision=fp32,micro_batch=8,checkpoint_every=1",
    "precision=amp-bf16,micro_batch=8", "precision=amp-bf16,micro_batch=4,checkpoint_every=1",
    "precision=amp-bf16,micro_batch=4,grad_accum=2", "precision=bf16,micro_batch=8",
    "precision=bf16,micro_batch=8,checkpoint_every=1", "precision=amp-fp16,micro_batch=4",
    "precision=amp-fp16,micro_batch=8,checkpoint_every=1",
]
QUICK_CONFIGS = ["precision=fp32,micro_batch=2"]
# offload=optimizer (torchao's CPUOffloadOptimizer: the large parameters' AdamW state on the host), on
# workloads whose optimizer is an AdamW, where torchao is installed: the device peak without that state.
OFFLOAD_CONFIGS = ["precision=fp32,micro_batch=4,offload=optimizer",
                   "precision=amp-bf16,micro_batch=4,grad_accum=2,offload=optimizer"]
OFFLOAD_WORKLOADS = ("gpt-tiny", "hf-gpt2")
# autofit's own hf: support for Llama; a user-written wrapper (this file) for GPT-2.
HF_LLAMA_SPEC = ("hf:llama?num_hidden_layers=4&hidden_size=256&intermediate_size=688&num_attention_heads=4"
                 f"&num_key_value_heads=2&vocab_size={HF_VOCAB}&max_position_embeddings={HF_SEQ}")
A_WORKLOADS = ["gpt-tiny", "hf-gpt2", "hf:llama", "convnet-bn", "lstm-lm", "gpt-mini", "hf-llama"]
QUICK_WORKLOADS = ["gpt-tiny", "hf-llama"]
B_MODEL = "gpt2"
B_CANDIDATES = [f"precision={p},micro_batch={m},checkpoint_every={c}"
                for p in ("fp32", "bf16") for m in (1, 2, 3, 4, 6, 8, 12, 16) for c in (0, 1)]
SEARCH_TRIALS = 6
SEARCH_TRIAL_TIMEOUT_S = 40  # a gpt2 trial took 9-10 s on the H200


# ----------------------------------------------------------------------------------------------
# Hugging Face workloads built from local configs (no download). Loaded in children by the spec
# "<this file>:hf_gpt2_workload", so they are plain module-level functions.


class HFCausalLM(nn.Module):
    """A transformers causal LM as autofit needs it: token ids in, logits out."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx, use_cache=False).logits


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def _random_tokens(n: int):
    return torch.randint(HF_VOCAB, (n, HF_SEQ)), torch.randint(HF_VOCAB, (n, HF_SEQ))


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


def _hf_workload(name: str, build, layers, description: str):
    from autofit.workloads.base import Workload

    return Workload(name=name, model=lambda: HFCausalLM(build()), batch=_random_tokens, loss=_lm_loss,
                    optimizer=_adamw, layers=layers, tokens_per_sample=HF_SEQ, description=description,
                    meta={"kind": "transformer", "library": "transformers"})


def hf_causal_lm(model_type: str, **config):
    """(config, builder) of a transformers causal LM from a local config, through the Auto classes.

    ``from transformers import GPT2Config`` failed with transformers 5.17 on the GPU machine
    ("cannot import name 'GPT2Config' from 'transformers'") while ``transformers.AutoModelForCausalLM``
    worked there: the Auto classes come first, the model's own module second, and when both fail the
    error names each cause.
    """
    import transformers

    causes = []
    try:
        cfg = transformers.AutoConfig.for_model(model_type, **config)
        # as autofit's hf: spec builds: in torch's default dtype, which autofit sets (fp32 or bf16)
        return cfg, lambda: transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                                                          dtype=torch.get_default_dtype())
    except Exception as exc:  # noqa: BLE001 -- the next way is tried, and both causes reported
        causes.append(f"AutoConfig.for_model({model_type!r}): {_first_line(exc)}")
    try:
        import importlib

        module = importlib.import_module(f"transformers.models.{model_type}")
        prefix = {"gpt2": "GPT2", "llama": "Llama"}[model_type]
        cfg = getattr(module, f"{prefix}Config")(**config)
        head = getattr(module, f"{prefix}LMHeadModel", None) or getattr(module, f"{prefix}ForCausalLM")
        return cfg, lambda: head(cfg)
    except Exception as exc:  # noqa: BLE001
        causes.append(f"transformers.models.{model_type}: {_first_line(exc)}")
    raise ImportError(f"transformers {getattr(transformers, '__version__', '?')} from {transformers.__file__} cannot "
                      f"build {model_type}: " + "; ".join(causes))


def hf_gpt2_workload():
    """transformers' GPT-2 causal LM, 4 layers, d=256, 4 heads, seq 128, vocab 8192 (its default dropout 0.1)."""
    _, build = hf_causal_lm("gpt2", vocab_size=HF_VOCAB, n_positions=HF_SEQ, n_embd=256, n_layer=4, n_head=4,
                            bos_token_id=0, eos_token_id=0)
    return _hf_workload("hf-gpt2-4l-d256", build, lambda m: m.model.transformer.h,
                        "transformers GPT-2, 4 layers, d=256, seq 128, from a local config")


def hf_llama_workload():
    """transformers' Llama causal LM, 4 layers, d=256, 4 heads / 2 kv heads, SwiGLU 688, seq 128, vocab 8192."""
    _, build = hf_causal_lm("llama", vocab_size=HF_VOCAB, hidden_size=256, intermediate_size=688,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=HF_SEQ)
    return _hf_workload("hf-llama-4l-d256", build, lambda m: m.model.model.layers,
                        "transformers Llama, 4 layers, d=256, seq 128, from a local config")


def workload_spec(name: str) -> str:
    """The --model spec of a workload of this check: a built-in name, or this file's HF factories."""
    return {"hf-gpt2": f"{SCRIPT}:hf_gpt2_workload", "hf-llama": f"{SCRIPT}:hf_llama_workload",
            "hf:llama": HF_LLAMA_SPEC}.get(name, name)


# ----------------------------------------------------------------------------------------------
# Measuring the card's memory without creating a CUDA context (NVML, nvidia-smi).


def physical_gpu_index() -> int:
    """NVML's index of CUDA device 0 (the first entry of CUDA_VISIBLE_DEVICES when it is a number)."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


def card_used_bytes(index: int) -> tuple[int | None, str]:
    """(bytes in use on the whole card, how it was read); NVML and nvidia-smi create no CUDA context."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).used), "nvml"
    except Exception:  # noqa: BLE001 - not installed, no driver library: try the next way
        pass
    try:
        out = subprocess.run(["nvidia-smi", f"--id={index}", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            return int(float(out.stdout.split()[0]) * 2**20), "nvidia-smi"
    except (OSError, ValueError, subprocess.SubprocessError):
        pass
    return None, "none"


def process_used_bytes(index: int) -> int | None:
    """This process's use of the card as NVML lists it, or None (no NVML, or PIDs of another namespace)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                return int(proc.usedGpuMemory)
    except Exception:  # noqa: BLE001 - any NVML trouble: fall back to the whole card
        pass
    return None


def context_bytes(baseline_used: int | None, index: int) -> tuple[int | None, str]:
    """This process's use of the card outside the caching allocator's reserved bytes (the context, cuBLAS...).

    Prefers NVML's per-process figure (immune to other processes); else the whole card's use
    less its use before this process touched CUDA (other processes must hold still meanwhile).
    """
    reserved = torch.cuda.memory_reserved()
    own = process_used_bytes(index)
    if own is not None:
        return own - reserved, "nvml per process"
    used, how = card_used_bytes(index)
    if used is not None and baseline_used is not None:
        return used - baseline_used - reserved, how + " (whole card less its use before)"
    free, total = torch.cuda.mem_get_info()  # whole card, other processes included
    return total - free - reserved, "mem_get_info (whole card)"


# ----------------------------------------------------------------------------------------------
# The child: runs configs of one workload with autofit's trial code, one JSON line per config.


def _emit(row: dict) -> None:
    print(ROW_PREFIX + json.dumps(row), flush=True)


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


def child_main(request: dict) -> int:
    """Run ``request["configs"]`` of ``request["spec"]`` on ``request["device"]``; print rows."""
    cuda = request["device"] == "cuda"
    index = physical_gpu_index()
    baseline, _ = card_used_bytes(index) if cuda else (None, "none")  # before this process touches CUDA
    from autofit.core.config import TrainConfig
    from autofit.trial.measure import measure_trial
    from autofit.workloads.load import load_workload

    workload = load_workload(request["spec"])
    budget = request.get("card_budget_bytes")
    if cuda:
        from autofit.probes.cuda_overhead import warm_up_kernels
        from autofit.trial.measure import expected_context_bytes

        torch.cuda.set_device(0)
        warm_up_kernels(torch.device("cuda", 0))  # the context grows as kernel modules load lazily
        ctx, how = context_bytes(baseline, index)
        # With a budget, autofit's measure_trial caps the allocator at the budget less this context
        # (the larger of this process's and the device probe's) and judges reserved + context.
        cap = budget - expected_context_bytes(torch.device("cuda", 0)) if budget else None
        _emit({"kind": "init", "context_bytes": ctx, "context_method": how, "cap_bytes": cap,
               "device_name": torch.cuda.get_device_name(0)})
    for text in request["configs"]:
        started = time.perf_counter()
        try:
            out = measure_trial(workload, TrainConfig.parse(text), device=request["device"], warmup_steps=2,
                                measure_steps=3, budget_bytes=budget)
        except Exception as exc:  # noqa: BLE001 - recorded, the next config still runs
            status = "oom" if "out of memory" in str(exc).lower() else "error"
            out = {"status": status, "error": _first_line(exc)}
        row = {"kind": "config", "config": text, "wall_s": time.perf_counter() - started, **out}
        if cuda and row.get("context_bytes") is None:  # measure_trial measured it where it ran
            row["context_bytes"], row["context_method"] = context_bytes(baseline, index)
        if cuda:
            # Configs share this child: free the last one's cache and peaks, or every later config
            # reads the largest reserved so far (run 2 on the H200 did: errors grew down each workload).
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        _emit(row)
        if row.get("status") != "ok":
            # As autofit's trial host: a config that failed may leave tensors and a larger context behind
            # (on the H200 a repeat after two failed configs read 40 MiB more allocated, 90 MiB more
            # context); the parent runs the rest in a fresh child.
            return 0
    return 0


# ----------------------------------------------------------------------------------------------
# The parent: time guard, rows, estimates, parts.


class Clock:
    """Seconds since the start and the deadline of each part (a share of the time limit)."""

    def __init__(self, limit_s: float, now=time.monotonic, start: float | None = None):
        self.now = now
        self.start = now() if start is None else start
        self.limit_s = limit_s

    def elapsed(self) -> float:
        return self.now() - self.start

    def left(self, part: str) -> float:
        """Seconds until ``part`` must end (never past the global limit)."""
        return self.start + self.limit_s * PART_END[part] - self.now()


def log(clock: Clock, message: str) -> None:
    print(f"[{clock.elapsed():5.0f}s] {message}", flush=True)


@dataclass
class Row:
    """One line of the table; bytes and seconds in the names' units, None where not measured."""

    part: str
    workload: str
    config: str
    status: str
    predicted_bytes: int | None = None          # the estimate on CUDA: reserved + context
    predicted_allocated_bytes: int | None = None  # the estimate less its context and fragmentation
    allocated_bytes: int | None = None          # max_memory_allocated (CPU: the tracker's peak)
    reserved_bytes: int | None = None           # max_memory_reserved
    context_bytes: int | None = None
    card_bytes: int | None = None               # reserved + context: what the card holds
    error_card: float | None = None             # (predicted - card) / card
    error_allocated: float | None = None
    step_time_s: float | None = None
    samples_per_s: float | None = None
    budget_bytes: int | None = None
    wall_s: float | None = None
    repeat: bool = False
    check: str = ""                             # "pass" / "FAIL: why" where the row is a check
    note: str = ""


def rel(predicted: int | None, measured: int | None) -> float | None:
    if predicted is None or not measured:
        return None
    return (predicted - measured) / measured


def fill_errors(row: Row) -> Row:
    if row.reserved_bytes is not None and row.context_bytes is not None:
        row.card_bytes = row.reserved_bytes + row.context_bytes
    row.error_card = rel(row.predicted_bytes, row.card_bytes)
    row.error_allocated = rel(row.predicted_allocated_bytes, row.allocated_bytes)
    return row


def estimates(spec: str, configs: list[str], device_type: str, overhead=None) -> dict[str, tuple[int, int] | str]:
    """config -> (predicted peak, predicted allocated) from autofit's fake-tensor profile, or an error line.

    ``overhead``: a callable giving the device's measured :class:`autofit.probes.cuda_overhead.CudaOverhead`
    (waited for only once the profile is done), or None (CPU, or the fallback)."""
    from autofit.core.config import TrainConfig
    from autofit.estimator.memory_model import estimate
    from autofit.profiling.profile import profile_workload
    from autofit.workloads.load import load_workload

    parsed = {c: TrainConfig.parse(c) for c in configs}
    precisions = sorted({p.precision.value for p in parsed.values()})
    try:
        profile = profile_workload(load_workload(spec), precisions, device_type=device_type)
    except Exception as exc:  # noqa: BLE001
        return dict.fromkeys(configs, f"estimate failed: {_first_line(exc)}")
    # what the profile's real steps found beside the fake runs, per precision (the log says it: on CUDA these
    # run in the profiling children, with cuDNN where the fake runs went without)
    PROFILE_NOTES[spec] = {p: profile.for_precision(p).real_check for p in precisions}
    measured = overhead() if overhead is not None and device_type == "cuda" else None
    out: dict[str, tuple[int, int] | str] = {}
    for text, config in parsed.items():
        try:
            est = estimate(profile, config, overhead=measured)
            out[text] = (int(est.peak_bytes), predicted_allocated(est, measured))
        except Exception as exc:  # noqa: BLE001
            out[text] = f"estimate failed: {_first_line(exc)}"
    return out


def predicted_allocated(est, overhead) -> int:
    """What the estimate says ``max_memory_allocated`` will be: its peak less its overhead (context,
    workspace and the allocator's reserve), plus the workspace again (the cuBLAS workspaces are allocated)."""
    if est.device_type != "cuda":
        return int(est.peak_bytes - est.overhead_bytes)
    from autofit.probes.cuda_overhead import fallback_overhead

    o = overhead or fallback_overhead()
    return int(round(est.peak_bytes - est.overhead_bytes + o.workspace_bytes))


PROFILE_NOTES: dict = {}  # workload spec -> {precision: the profile's real-check note}
OVERHEAD_NOTE: dict = {}  # "cuda" -> the probe's note, for the table's header
OVERHEAD: dict = {}  # "cuda" -> Future of the device probe's CudaOverhead (started before the estimates)


def start_device_probe(device: str, clock: "Clock"):
    """Measure the context and cuBLAS workspace in autofit's probe child (NVML per process) while the
    profiles run; cached where the trial children read it. Returns a callable that waits for it."""
    if device != "cuda":
        return None
    from autofit.probes.cuda_overhead import fallback_overhead
    from autofit.probes.device_rates import probe_rates

    def probe():
        try:
            # cached: the trial children and part c's search read this measurement
            found = probe_rates("cuda").memory_overhead() or fallback_overhead("the probe measured nothing")
        except Exception as exc:  # noqa: BLE001 -- the estimates go on with the fallback, and say so
            found = fallback_overhead(f"the device probe failed: {_first_line(exc)}")
        log(clock, f"device probe: {found.note()}")
        OVERHEAD_NOTE["cuda"] = found.note()
        return found

    pool = ThreadPoolExecutor(max_workers=1)
    OVERHEAD["cuda"] = pool.submit(probe)
    pool.shutdown(wait=False)
    return lambda: OVERHEAD["cuda"].result(timeout=120)


def kill_group(pid: int) -> None:
    """Kill a child started with start_new_session (its group id is its pid), if still there."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_child(request: dict, timeout_s: float, clock: Clock) -> tuple[list[dict], str | None]:
    """Run a child (``--child``); its rows, and why it ended early (None when it did not)."""
    cmd = [sys.executable, str(SCRIPT), "--child", json.dumps(request)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True, cwd=ROOT)
    why = None
    try:
        stdout, _ = proc.communicate(timeout=max(timeout_s, 1.0))
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        stdout, _ = proc.communicate()
        why = f"time guard: child killed after {timeout_s:.0f} s"
    rows = []
    for line in stdout.splitlines():
        if line.startswith(ROW_PREFIX):
            rows.append(json.loads(line[len(ROW_PREFIX):]))
        elif line.strip():
            print(f"    | {line}", flush=True)
    if why is None and proc.returncode != 0:
        why = f"child exited with status {proc.returncode}"
    if why:
        log(clock, f"  {why}")
    return rows, why


def run_children(request: dict, timeout_s: float, clock: Clock) -> tuple[list[dict], str | None]:
    """:func:`run_child` again for the configs left after one that was not ok (a child ends there)."""
    deadline = clock.now() + timeout_s
    rows: list[dict] = []
    configs = list(request["configs"])
    while True:
        new, why = run_child({**request, "configs": configs}, deadline - clock.now(), clock)
        rows += new
        done = sum(r.get("kind") == "config" for r in new)
        if why or not done or done >= len(configs):
            return rows, why
        configs = configs[done:]
        if deadline - clock.now() < 5:
            return rows, f"time guard: {len(configs)} config(s) left after a failed one"


def rows_from_child(part: str, workload: str, configs: list[str], predicted: dict, child_rows: list[dict],
                    why: str | None, repeat_at: int | None = None) -> list[Row]:
    """Match the child's rows to the configs asked for; configs without a row get the reason."""
    measured = [r for r in child_rows if r.get("kind") == "config"]
    rows = []
    for i, text in enumerate(configs):
        pred = predicted.get(text)
        # Cut short by the time guard: not run; a child that crashed or gave no row: an error.
        row = Row(part, workload, text, "skipped" if (why or "").startswith("time guard") else "error")
        est_note = pred if isinstance(pred, str) else ""
        if isinstance(pred, tuple):
            row.predicted_bytes, row.predicted_allocated_bytes = pred
        row.note = "; ".join(x for x in (est_note, why or "the child gave no row") if x)
        if i < len(measured):
            m = measured[i]
            row.status = m.get("status") or "error"
            row.note = "; ".join(x for x in (est_note, m.get("error") or "") if x)
            row.allocated_bytes = m.get("peak_bytes")
            row.reserved_bytes = m.get("peak_reserved_bytes")
            row.context_bytes = m.get("context_bytes")
            row.step_time_s = m.get("step_time_s")
            row.samples_per_s = m.get("samples_per_s")
            row.wall_s = m.get("wall_s")
        row.repeat = i == repeat_at
        if row.context_bytes is not None and not 0 < row.context_bytes < 4 * 2**30:
            row.note = "; ".join(x for x in (row.note, "implausible context: another process may have used the card")
                                 if x)
        rows.append(fill_errors(row))
    return rows


def plan(args) -> dict[str, tuple[str, list[str]]]:
    """name -> (spec, configs) of every estimate the run needs (part a's workloads, part b's candidates)."""
    names = args.workloads.split(",") if args.workloads else (QUICK_WORKLOADS if args.quick else A_WORKLOADS)
    jobs = {name: (workload_spec(name), a_configs(name, args)) for name in names} if "a" in args.parts else {}
    if "b" in args.parts and args.device == "cuda" and not args.quick:
        # Profiling all four precisions also fills the profile cache for part c's search.
        jobs["b:" + B_MODEL] = (B_MODEL, B_CANDIDATES + ["precision=amp-bf16,micro_batch=1",
                                                        "precision=amp-fp16,micro_batch=1"])
    return jobs


LATE: dict = {}  # estimates still running when part a starts: name -> Future


def all_estimates(jobs: dict, device: str, clock: Clock, overhead=None) -> dict[str, dict]:
    """Every estimate up front, workloads in parallel (each profile runs in its own processes). One not
    done by the estimates' deadline is waited for when its part needs it (:func:`late_estimate`):
    the context is NVML's per-process figure, so profiling processes on the card do not disturb it."""
    log(clock, f"estimates: {len(jobs)} workloads on fake tensors ({', '.join(jobs)})")
    if not jobs:
        return {}
    pool = ThreadPoolExecutor(max_workers=len(jobs))
    futures = {name: pool.submit(estimates, spec, configs, device, overhead) for name, (spec, configs) in jobs.items()}
    wait_futures(list(futures.values()), timeout=max(clock.left("estimates"), 30))
    pool.shutdown(wait=False, cancel_futures=True)
    out = {}
    for name, future in futures.items():
        if not future.done():
            LATE[name] = future
            log(clock, f"  {name}: still profiling (its part waits for it)")
            continue
        if future.done() and future.exception() is None:
            out[name] = future.result()
        else:
            why = "time guard" if not future.done() else _first_line(future.exception())
            out[name] = dict.fromkeys(jobs[name][1], f"estimate failed: {why}")
        failed = sum(isinstance(v, str) for v in out[name].values())
        log(clock, f"  {name}: {len(out[name]) - failed} estimated" + (f", {failed} failed" if failed else ""))
        for precision, note in PROFILE_NOTES.get(jobs[name][0], {}).items():
            log(clock, f"    {precision} profile: {note or 'no note'}")
    return out


def late_estimate(name: str, configs: list[str], timeout_s: float) -> dict:
    """The estimates of ``name`` once its profile is done, or an error line per config after ``timeout_s``."""
    future = LATE.get(name)
    if future is None:
        return {}
    try:
        return future.result(timeout=max(timeout_s, 1))
    except Exception as exc:  # noqa: BLE001 - a timeout included
        return dict.fromkeys(configs, f"estimate failed: {_first_line(exc) or 'time guard'}")


def a_configs(name: str, args) -> list[str]:
    """Part a's configs for workload ``name``: the offload ones too where they can run (CUDA, torchao)."""
    if args.quick:
        return QUICK_CONFIGS
    offload = (name in OFFLOAD_WORKLOADS and args.device == "cuda"
               and importlib.util.find_spec("torchao") is not None)
    return A_CONFIGS + (OFFLOAD_CONFIGS if offload else [])


def part_a(args, clock: Clock, device: str, predicted_all: dict) -> list[Row]:
    names = args.workloads.split(",") if args.workloads else (QUICK_WORKLOADS if args.quick else A_WORKLOADS)
    rows: list[Row] = []
    for n, name in enumerate(names):
        configs = a_configs(name, args)
        left = clock.left("a")
        if left < 15:
            rows += [Row("a", name, c, "skipped", note="time guard") for c in configs]
            continue
        spec = workload_spec(name)
        # the second config again, for the truth's noise: before the offload ones, whose pinned host buffers
        # and side stream stay with the process
        plain = [c for c in configs if "offload" not in c]
        repeat_at = len(plain)
        asked = plain + [configs[min(1, len(configs) - 1)]] + [c for c in configs if "offload" in c]
        predicted = predicted_all.get(name) or late_estimate(name, configs, clock.left("a") - 20)
        left = clock.left("a")
        share = max(20.0, 2 * left / (len(names) - n))
        log(clock, f"a. {name}: measuring on {device} (at most {min(share, left):.0f} s)")
        child_rows, why = run_children({"spec": spec, "configs": asked, "device": device}, min(share, left), clock)
        init = next((r for r in child_rows if r.get("kind") == "init"), None)
        if init:
            log(clock, f"  context at start {mib(init.get('context_bytes'))} ({init.get('context_method')})")
        new = rows_from_child("a", name, asked, predicted, child_rows, why, repeat_at=repeat_at)
        for r in new:
            log(clock, f"  {r.config:<55} {r.status:<7} pred {mib(r.predicted_bytes)} alloc {mib(r.allocated_bytes)} "
                       f"card {mib(r.card_bytes)} err {pct(r.error_card)} / alloc {pct(r.error_allocated)}")
        rows += new
    return rows


def part_b(args, clock: Clock, device: str, predicted: dict) -> list[Row]:
    from autofit.core.budget import parse_budget

    budget = parse_budget(CARD_BUDGET)
    late = LATE.get("b:" + B_MODEL)
    if not predicted and late is not None:
        try:
            predicted = late.result(timeout=max(clock.left("b") - 45, 1))
        except Exception as exc:  # noqa: BLE001 - a timeout included
            predicted = {"-": f"estimate failed: {_first_line(exc) or 'time guard'}"}
    chosen = choose_budget_configs(predicted, budget)
    if not chosen:
        reason = next((v for v in predicted.values() if isinstance(v, str)), "no candidate in range")
        return [Row("b", B_MODEL, "-", "error", check="FAIL: no config to test", note=reason)]
    configs = [c for _, c in chosen]
    log(clock, "b. chosen: " + "; ".join(f"{role} {c} ({mib(predicted[c][0])} predicted)" for role, c in chosen))
    child_rows, why = run_children({"spec": B_MODEL, "configs": configs, "device": device, "card_budget_bytes": budget},
                                clock.left("b") - 5, clock)
    init = next((r for r in child_rows if r.get("kind") == "init"), {})
    rows = rows_from_child("b", B_MODEL, configs, predicted, child_rows, why)
    for (role, _), row in zip(chosen, rows):
        row.budget_bytes = budget
        row.note = f"{role}; allocator capped at {mib(init.get('cap_bytes'))}" + (f"; {row.note}" if row.note else "")
        row.check = judge_budget(role, row.status, row.card_bytes, budget)
    # autofit's own trial runner with the same budget (over must be oom, edge must fit the card).
    from autofit.core.config import TrainConfig
    from autofit.trial.run import run_trial

    for role, text in chosen[:2]:
        left = clock.left("b")
        if left < 20:
            rows.append(Row("b", B_MODEL, text, "skipped", note=f"autofit run_trial, {role}: time guard"))
            continue
        log(clock, f"b. autofit's run_trial, {role}: {text} at budget {CARD_BUDGET}")
        res = run_trial(B_MODEL, TrainConfig.parse(text), device=device, budget_bytes=budget, timeout_s=left - 5)
        row = Row("b", B_MODEL, text, res.status.value, allocated_bytes=res.peak_bytes,
                  reserved_bytes=res.peak_reserved_bytes, context_bytes=res.context_bytes,
                  step_time_s=res.step_time_s, samples_per_s=res.samples_per_s, budget_bytes=budget, wall_s=res.wall_s,
                  note=f"autofit run_trial, {role} (context measured in its child)" + (
                      f"; {res.error}" if res.error else ""))
        pred = predicted.get(text)
        if isinstance(pred, tuple):
            row.predicted_bytes, row.predicted_allocated_bytes = pred
        fill_errors(row)
        row.check = judge_budget(role, row.status, row.card_bytes, budget)
        rows.append(row)
    rows += _again_in_the_host(clock, device, budget, rows[-1])
    for r in rows:
        log(clock, f"  {r.config:<55} {r.status:<7} pred {mib(r.predicted_bytes)} card {mib(r.card_bytes)} {r.check}")
    return rows


def _again_in_the_host(clock: Clock, device: str, budget: int, first: Row) -> list[Row]:
    """The last run_trial again: an ok trial leaves its trial host (autofit/trial/host.py) up, so this one
    runs in the same process. Its card bytes must be the first's (within 1%), and its wall time shows
    what the host saves (no interpreter, imports or CUDA context)."""
    from autofit.core.config import TrainConfig
    from autofit.trial.run import run_trial

    if first.status != "ok" or first.card_bytes is None or clock.left("b") < 20:
        return []
    log(clock, f"b. autofit's run_trial again, in the trial host: {first.config}")
    res = run_trial(B_MODEL, TrainConfig.parse(first.config), device=device, budget_bytes=budget,
                    timeout_s=clock.left("b") - 5)
    row = Row("b", B_MODEL, first.config, res.status.value, allocated_bytes=res.peak_bytes,
              reserved_bytes=res.peak_reserved_bytes, context_bytes=res.context_bytes, step_time_s=res.step_time_s,
              samples_per_s=res.samples_per_s, budget_bytes=budget, wall_s=res.wall_s,
              note=f"autofit run_trial again, in the trial host (wall {res.wall_s:.1f} s against {first.wall_s:.1f} s)"
                   + (f"; {res.error}" if res.error else ""))
    row.predicted_bytes, row.predicted_allocated_bytes = first.predicted_bytes, first.predicted_allocated_bytes
    fill_errors(row)
    row.check = judge_budget("edge", row.status, row.card_bytes, budget)
    if row.check == "pass" and abs(row.card_bytes - first.card_bytes) > 0.01 * first.card_bytes:
        row.check = f"FAIL: card {mib(row.card_bytes)} in the host against {mib(first.card_bytes)} in a fresh process"
    return [row]


def choose_budget_configs(predicted: dict, budget: int) -> list[tuple[str, str]]:
    """(role, config): ``over`` predicted in (1.125, 2] x budget, nearest 1.5x; ``edge`` the largest
    predicted <= budget; ``safe`` the largest predicted <= 0.8 x budget."""
    ok = {c: v[0] for c, v in predicted.items() if isinstance(v, tuple) and c in B_CANDIDATES}
    over = [c for c, p in ok.items() if 1.125 * budget < p <= 2 * budget]
    edge = [c for c, p in ok.items() if p <= budget]
    safe = [c for c, p in ok.items() if p <= 0.8 * budget]
    chosen = []
    if over:
        chosen.append(("over", min(over, key=lambda c: abs(ok[c] - 1.5 * budget))))
    if edge:
        chosen.append(("edge", max(edge, key=lambda c: ok[c])))
    if safe and max(safe, key=lambda c: ok[c]) not in dict(chosen).values():
        chosen.append(("safe", max(safe, key=lambda c: ok[c])))
    return chosen


def judge_budget(role: str, status: str, card_bytes: int | None, budget: int) -> str:
    if role == "over":
        return "pass" if status == "oom" else f"FAIL: predicted over {CARD_BUDGET} but {status}"
    if status != "ok":
        return f"FAIL: predicted under {CARD_BUDGET} but {status}"
    if card_bytes is None:
        return "FAIL: context not measured"
    return "pass" if card_bytes <= budget else f"FAIL: reserved + context {mib(card_bytes)} over {CARD_BUDGET}"


def part_c(args, clock: Clock, device: str, context: int | None, out_dir: Path) -> list[Row]:
    try:
        import optuna  # noqa: F401
    except ImportError:
        return [Row("c", B_MODEL, "search", "skipped", check="FAIL: optuna not importable",
                    note="install the wheels first: see this script's docstring")]
    left = clock.left("c")
    study_dir = out_dir / f"search-{B_MODEL}-{CARD_BUDGET}"
    new_trials_s = int(left - SEARCH_TRIAL_TIMEOUT_S - 15)
    if new_trials_s < 20:
        return [Row("c", B_MODEL, "search", "skipped", note="time guard")]
    cmd = [sys.executable, "-m", "autofit", "search", "--model", B_MODEL, "--budget", CARD_BUDGET, "--device", device,
           "--trials", str(args.search_trials), "--timeout", str(new_trials_s), "--trial-timeout",
           str(SEARCH_TRIAL_TIMEOUT_S), "--out", str(study_dir), "--json"]
    log(clock, "c. " + " ".join(cmd[1:]))
    started, started_wall = time.monotonic(), time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=max(left - 3, 5))
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        stdout, _ = proc.communicate()
    wall = time.monotonic() - started
    statuses = trial_statuses(study_dir / "trials.csv")
    try:
        result = json.loads(stdout[stdout.index("{"):])
    except ValueError:
        return [Row("c", B_MODEL, "search", "error", wall_s=wall, check="FAIL: search gave no result",
                    note=f"exit {proc.returncode}; trials {statuses}")]
    best, m = result.get("best"), result.get("best_measured") or {}
    row = Row("c", B_MODEL, "search: " + (",".join(f"{k}={v}" for k, v in best.items()) if best else "none"),
              "ok" if best else "none", allocated_bytes=m.get("peak_bytes"), reserved_bytes=m.get("peak_reserved_bytes"),
              context_bytes=m.get("context_bytes") or context, step_time_s=m.get("step_time_s"),
              samples_per_s=m.get("samples_per_s"),
              budget_bytes=result.get("budget_bytes"), wall_s=wall,
              note=f"{result.get('n_real')} real trials ({statuses}), {result.get('n_pruned')} of "
                   f"{result.get('n_configs')} pruned; stopped: {result.get('stop_reason')}; context "
                   + ("measured in the trial" if m.get("context_bytes") else "from part a")
                   + first_trial_note(study_dir / "trials.csv", started_wall, started_wall + wall))
    pred = (result.get("best_predicted") or {}).get("peak_bytes")
    row.predicted_bytes = int(pred) if pred else None
    fill_errors(row)
    budget = result.get("budget_bytes") or 0
    if not best:
        row.check = "FAIL: no config found"
    elif statuses.get("oom"):
        row.check = f"FAIL: {statuses['oom']} OOM trial(s)"
    else:
        row.check = judge_budget("edge", "ok", row.card_bytes, budget)
    log(clock, f"  best {row.config} card {mib(row.card_bytes)} {row.samples_per_s or 0:.1f} samples/s {row.check}")
    return [row]


def first_trial_note(path: Path, started_wall: float, ended_wall: float | None = None) -> str:
    """How long the search took before its first real trial started (its process, profiling, the CUDA
    device probe, planning: what the bench's gpu-cost regime charges autofit once per search), the wall
    time of its real trials, and (with ``ended_wall``) how long the search ran on after its last trial
    ended (re-measurement planning, reports): work that delays its wall time but not its answer. Read
    from its ``trials.csv`` (``started`` is local time to the second)."""
    try:
        with path.open() as f:
            ran = [r for r in csv.DictReader(f) if r.get("status") not in ("pruned", "running") and r.get("started")]
    except OSError:
        return ""
    if not ran:
        return ""
    starts = [dt.datetime.fromisoformat(r["started"]).timestamp() for r in ran]
    walls = [float(r["trial_wall_s"]) for r in ran if r.get("trial_wall_s")]
    note = (f"; first real trial started {min(starts) - started_wall:.0f} s after the search (±1 s); "
            f"{len(walls)} real trials took {sum(walls):.1f} s of wall time")
    ends = [t + float(r["trial_wall_s"]) for t, r in zip(starts, ran) if r.get("trial_wall_s")]
    if ended_wall is not None and ends:
        note += f"; the last ended {ended_wall - max(ends):.0f} s before the search did (±1 s)"
    return note


def trial_statuses(path: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    try:
        with path.open() as f:
            for rec in csv.DictReader(f):
                counts[rec.get("status", "?")] = counts.get(rec.get("status", "?"), 0) + 1
    except OSError:
        pass
    return counts


def part_d(args, clock: Clock, device: str) -> list[Row]:
    n = torch.cuda.device_count() if device == "cuda" else 0
    if n < 2:
        return [Row("d", "gpt-tiny", "device_split=2", "skipped", note=f"{n} GPU(s): the 2-GPU split and FSDP need two")]
    from autofit.core.config import FIELDS, TrainConfig
    from autofit.trial.run import run_trial

    rows = []
    text = "precision=amp-bf16,micro_batch=4,grad_accum=4,device_split=2"
    texts = [text] + ([text + ",split_mode=fsdp"] if "split_mode" in FIELDS else [])
    predicted = estimates("gpt-tiny", texts, device)
    for t in texts:
        res = run_trial("gpt-tiny", TrainConfig.parse(t), device="cuda", timeout_s=max(clock.left("d") / 3, 10))
        row = Row("d", "gpt-tiny", t, res.status.value, allocated_bytes=res.peak_bytes, step_time_s=res.step_time_s,
                  samples_per_s=res.samples_per_s, wall_s=res.wall_s,
                  note=f"per device measured {[mib(b) for b in res.per_device_peak_bytes]}; {res.error or ''}")
        if isinstance(predicted.get(t), tuple):
            row.predicted_bytes, row.predicted_allocated_bytes = predicted[t]
        row.check = "pass" if res.ok and len(res.per_device_peak_bytes) == 2 else f"FAIL: {res.status.value}"
        rows.append(fill_errors(row))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(ROOT / "scripts/run_split_torchrun.py"),
           "--model", "gpt-tiny", "--config", text, "--device", "cuda", "--json"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=max(clock.left("d") - 5, 10), cwd=ROOT)
        ok = out.returncode == 0
        rows.append(Row("d", "gpt-tiny", text + " (torchrun)", "ok" if ok else "error", check="pass" if ok else
                        f"FAIL: torchrun exit {out.returncode}", note=(out.stdout or out.stderr).strip()[-300:]))
    except subprocess.TimeoutExpired:
        rows.append(Row("d", "gpt-tiny", text + " (torchrun)", "timeout", check="FAIL: timeout"))
    if "split_mode" not in FIELDS:
        rows.append(Row("d", "-", "fsdp", "skipped", note="autofit has no split_mode (FSDP) in this checkout"))
    return rows


# ----------------------------------------------------------------------------------------------
# Summary, files, verdict.


def mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f} MiB"


def pct(x) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def stats(errors: list[float]) -> tuple[int, float | None, float | None]:
    a = [abs(e) for e in errors if e is not None and math.isfinite(e)]
    return len(a), (statistics.median(a) if a else None), (max(a) if a else None)


def noise(rows: list[Row]) -> list[float]:
    """Relative difference between each repeated config and its first run (card bytes, else allocated)."""
    out = []
    for r in rows:
        if not r.repeat or r.status != "ok":
            continue
        first = next((f for f in rows if f.part == r.part and f.workload == r.workload and f.config == r.config
                      and not f.repeat and f.status == "ok"), None)
        if first:
            a, b = (r.card_bytes, first.card_bytes) if r.card_bytes and first.card_bytes else (
                r.allocated_bytes, first.allocated_bytes)
            if a and b:
                out.append(abs(a - b) / b)
    return out


def verdict(rows: list[Row], device: str) -> tuple[bool, str]:
    acc = [r for r in rows if r.part == "a" and r.status == "ok" and not r.repeat]
    n_card, med_card, max_card = stats([r.error_card for r in acc])
    n_alloc, med_alloc, max_alloc = stats([r.error_allocated for r in acc])
    failures = []
    judged = (med_card, max_card, n_card) if device == "cuda" else (med_alloc, max_alloc, n_alloc)
    if not judged[2]:
        failures.append("no accuracy config measured")
    elif judged[0] > TARGET_MEDIAN or judged[1] > TARGET_MAX:
        failures.append(f"accuracy outside median {TARGET_MEDIAN:.0%} / max {TARGET_MAX:.0%}")
    errors = [r.error_card if device == "cuda" else r.error_allocated for r in acc]
    under = [e for e in errors if e is not None and e < -TARGET_UNDER]
    if under:
        failures.append(f"{len(under)} config(s) under-estimated by more than {TARGET_UNDER:.0%} "
                        f"(worst {min(under):+.1%})")
    broken = [r for r in rows if r.part == "a" and r.status not in ("ok", "skipped")]
    if broken:
        failures.append(f"{len(broken)} accuracy config(s) failed: "
                        + ", ".join(sorted({f"{r.workload} {r.status}" for r in broken})))
    # A workload autofit cannot estimate for CUDA (its fake-tensor profile failed: cuDNN's RNN kernels,
    # an attention FLOP formula) fails the check even where its steps ran and were measured.
    unestimated = sorted({r.workload for r in rows if r.part == "a" and r.note.startswith("estimate failed")})
    if unestimated:
        failures.append(f"not estimated: {', '.join(unestimated)}")
    not_run = sum(r.part == "a" and r.status == "skipped" for r in rows)
    failures += [f"{r.part}:{r.config}: {r.check[6:]}" for r in rows if r.check.startswith("FAIL")]
    ok = not failures

    def f(x):
        return "-" if x is None else f"{100 * x:.2f}%"

    line = (f"VERDICT: {'PASS' if ok else 'FAIL'} on {device}: accuracy over {n_card or n_alloc} configs, "
            f"|error| vs reserved+context median {f(med_card)} max {f(max_card)}, vs allocated median {f(med_alloc)} "
            f"max {f(max_alloc)}; budget checks {sum(r.part == 'b' and r.check == 'pass' for r in rows)} pass; "
            f"search {next((r.check for r in rows if r.part == 'c'), 'not run') or '-'}"
            + (f"; {not_run} accuracy config(s) not run (time guard)" if not_run else "")
            + (f"; failed: {' | '.join(failures)}" if failures else ""))
    return ok, line


def environment(device: str) -> dict:
    env = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "torch": torch.__version__,
           "python": platform.python_version(), "host_cpu": platform.processor() or platform.machine()}
    if device == "cuda":
        try:
            props = torch.cuda.get_device_properties(0)  # the parent's first CUDA call: after every child
            env.update(device=f"{props.name} ({props.total_memory / 2**30:.0f} GiB)", cuda=torch.version.cuda,
                       gpus=torch.cuda.device_count())
        except Exception as exc:  # noqa: BLE001
            env["device"] = f"cuda ({_first_line(exc)})"
    else:
        env["device"] = "cpu (plumbing run: the CUDA-only parts are skipped)"
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = "not installed"
    try:
        env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=ROOT, timeout=10).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        env["commit"] = "?"
    return env


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_outputs(out_dir: Path, rows: list[Row], env: dict, verdict_line: str, wall_s: float) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path = out_dir / "gpu_check.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["device", "torch", "date"] + [x.name for x in fields(Row)])
        writer.writeheader()
        for r in rows:
            writer.writerow({"device": env.get("device"), "torch": env.get("torch"), "date": env.get("date"), **asdict(r)})
    n, med, mx = stats(noise(rows))
    body = [
        f"# GPU check: {env.get('device')}",
        "",
        "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()) + f". Wall time {wall_s:.0f} s.",
        "",
        f"Command: `python3 scripts/gpu_check.py` (see its docstring). {verdict_line}",
        "",
        "Predicted: autofit's estimate on fake tensors for device type cuda: tensors + the cuBLAS workspace + the "
        "allocator's reserve (autofit/estimator/reserved_model.py) + the context, the workspace and context measured on this device by autofit's probe child "
        f"({OVERHEAD_NOTE.get('cuda', 'not measured: CPU run')}); predicted allocated = that less its context and "
        "reserve terms. Measured by autofit's `measure_trial` "
        "in a child process: allocated = `max_memory_allocated`, reserved = `max_memory_reserved` over the steps "
        "after two warm-up steps, context = the process's use of the card (NVML per process; else nvidia-smi less the "
        "card's use before the child) less the allocator's reserved bytes. Part b caps the allocator at 8 GB less the "
        "context and counts a run whose reserved + context exceeds 8 GB as oom (autofit's `measure_trial` does both). "
        "Error = (predicted − measured) / measured; "
        "negative is an under-estimate. On a CPU run the estimate is for device type cpu and allocated is the "
        "CPU tracker's peak.",
        "",
        f"Ground-truth noise (a config run twice per workload): {n} pairs, median "
        f"{'-' if med is None else f'{100 * med:.2f}%'}, max {'-' if mx is None else f'{100 * mx:.2f}%'}.",
        "",
        markdown_table(
            ["part", "workload", "config", "status", "predicted", "pred. alloc", "allocated", "reserved", "context",
             "reserved+context", "error (card)", "error (alloc)", "step (s)", "check", "note"],
            [[r.part, r.workload, f"`{r.config}`" + (" (repeat)" if r.repeat else ""), r.status, mib(r.predicted_bytes),
              mib(r.predicted_allocated_bytes), mib(r.allocated_bytes), mib(r.reserved_bytes), mib(r.context_bytes),
              mib(r.card_bytes), pct(r.error_card), pct(r.error_allocated),
              "-" if r.step_time_s is None else f"{r.step_time_s:.4f}", r.check, r.note] for r in rows]),
        "",
    ]
    md_path = out_dir / "gpu_check.md"
    md_path.write_text("\n".join(body))
    return [md_path, csv_path]


def run_part(name: str, func, rows: list[Row], clock: Clock) -> None:
    """Run one part; an exception becomes a FAIL row and the next part still runs."""
    try:
        rows += func()
    except Exception as exc:  # noqa: BLE001
        log(clock, f"{name}. failed: {_first_line(exc)}")
        rows.append(Row(name, "-", "-", "error", check=f"FAIL: part {name} raised", note=_first_line(exc)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--out", default=str(ROOT / "results/benchmarks/gpu"), help="output folder (default %(default)s)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="one tiny config per workload (the CPU plumbing test)")
    parser.add_argument("--workloads", help="comma-separated part-a workloads (default: all; with --quick: "
                        + ",".join(QUICK_WORKLOADS) + f"); known: {','.join(A_WORKLOADS)}")
    parser.add_argument("--parts", default="abcd", help="which parts to run, e.g. a,b,c or abc (default abcd)")
    parser.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT_S, help="seconds (default %(default)s)")
    parser.add_argument("--search-trials", type=int, default=SEARCH_TRIALS, help="real trials in part c")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(json.loads(args.child))
    args.parts = args.parts.replace(",", "").replace(" ", "")
    if args.time_limit <= 0 or args.search_trials < 1 or set(args.parts) - set("abcd"):
        parser.error("--time-limit and --search-trials must be positive; --parts letters among a, b, c, d")
    unknown = set((args.workloads or "").split(",")) - set(A_WORKLOADS) - {""}
    if unknown:
        parser.error(f"--workloads: unknown {','.join(sorted(unknown))}; expected some of {','.join(A_WORKLOADS)}")
    # Every child (trials, profiles, the search) imports autofit from this checkout.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(ROOT)])
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs are local; never wait on the network
    clock = Clock(args.time_limit, start=PROCESS_START)
    out_dir = Path(args.out)
    device = args.device
    log(clock, f"gpu_check on {device}, torch {torch.__version__}, time limit {args.time_limit:.0f} s, out {out_dir}")
    rows: list[Row] = []
    predicted_all: dict = {}
    overhead = start_device_probe(device, clock) if not args.quick else None
    run_part("estimates", lambda: predicted_all.update(all_estimates(plan(args), device, clock, overhead)) or [],
             rows, clock)
    if "a" in args.parts:
        run_part("a", lambda: part_a(args, clock, device, predicted_all), rows, clock)
    contexts = [r.context_bytes for r in rows if r.part == "a" and r.context_bytes is not None]
    context = max(contexts) if contexts else None
    cuda_only = device == "cuda" and not args.quick
    for name, func in (("b", lambda: part_b(args, clock, device, predicted_all.get("b:" + B_MODEL) or {})),
                       ("c", lambda: part_c(args, clock, device, context, out_dir)),
                       ("d", lambda: part_d(args, clock, device))):
        if name not in args.parts:
            continue
        if not cuda_only:
            rows.append(Row(name, "-", "-", "skipped", note="CUDA only (this run: "
                            + ("--quick)" if args.quick else "cpu)")))
            continue
        run_part(name, func, rows, clock)
    ok, line = verdict(rows, device)
    files = write_outputs(out_dir, rows, environment(device), line, clock.elapsed())
    log(clock, "wrote " + ", ".join(str(p) for p in files))
    print(line, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
