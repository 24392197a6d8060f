"""The search suite's cells: the workloads, grids and budgets on which autofit's search meets its
peers, each chosen so that a lever (accumulation, checkpointing, a device split) decides the optimum;
and the :class:`~autofit.bench.problem.Problem` a strategy is given for a cell and a budget."""

from __future__ import annotations

import os
from pathlib import Path

from autofit.bench.problem import Problem
from autofit.bench.search_data import Cell, MiB
from autofit.core.config import CheckpointPolicy, OptimizerChoice, Precision, SplitMode

_THREE = (Precision.FP32, Precision.AMP_BF16, Precision.BF16)
# amp-fp16 is left out to keep the exhaustive grids affordable: on CPUs without native fp16
# kernels a step is ~1000x slower (docs/facts.md#device-rates-differ-by-dtype), and where the CPU has them (avx512_fp16, as the
# search's probe found on this machine) it measures close to fp32, which the grid already has.
_PIPELINE_AND_FSDP = (SplitMode.PIPELINE, SplitMode.FSDP)


def user_model(file: str, function: str = "workload") -> str:
    """The ``--model`` spec of a workload file in ``autofit/bench/user_models`` (written as a user
    writes one, loaded by path), relative to the working directory as a user would type it."""
    path = Path(__file__).resolve().parent / "user_models" / file
    try:
        path = Path(os.path.relpath(path))
    except ValueError:  # another drive (Windows): keep it absolute
        pass
    return f"{path.as_posix()}:{function}"


# Cells where each lever decides the optimum, chosen from measurements (the tables' "The optimum
# uses ..." line states, per budget, what each lever is worth in the committed run):
# - accumulation: gpt-tiny @ 64 MiB. No config with grad_accum 1 fits at global batch 12 (the
#   smallest, bf16 mb=12 ckpt=1, measured 66.2 MiB); the optimum was bf16 mb=6 ga=2.
# - checkpointing: gpt-tiny @ 94 MiB. fp32 mb=6 ckpt=1 (90.9 MiB) measured 46.3 samples/s where the
#   best config without checkpointing, bf16 mb=6 (62.4 MiB), measured 34.7 (+33%; fp32 mb=4, 96.4 MiB,
#   is over). Checkpointing wins here because a small model's CPU step gains much from a larger
#   micro-batch (fp32 mb=2 -> 6: 32.5 -> 55.7 samples/s) and recomputation costs ~20% (46.3 vs 55.7).
#   Replayed on that committed grid at 94 MiB: autofit answered the optimum in 3 of 3 seeds; the
#   per-precision finder sweeps, which never checkpoint, 70-75% of it.
# - device split: a 2-way pipeline and 2 FSDP ranks (gloo processes on this CPU) at 24 MiB, under
#   gpt-tiny's smallest one-device config (bf16 mb=1 ckpt=1, 25.3 MiB; the fp32 states alone are
#   42 MB): bf16 pipeline mb=1 measured 18.6 MiB, fsdp mb=1 19.3, fsdp mb=2 21.6 (pipeline mb=2,
#   24.2, is over). Only budgets where nothing fits on one device: there every fitting config is
#   one job on both devices, so autofit's objective (job samples/s, autofit.core.objective) and the
#   grid's (one trial's samples/s) rank them alike; with room for one device, autofit would count
#   an unsplit config twice (two data-parallel replicas) where the grid counts it once.
# - a workload file: the MLP-Mixer of user_models/mixer.py (RMSprop with momentum), loaded by path as
#   a user would load it. Its budgets from the estimate (which matched the tracker on it): at 16 MiB
#   fp32 fits up to mb=8 with checkpointing, amp-bf16 mb=4 without / mb=16 with, bf16 mb=8 / mb=32;
#   at 24 MiB fp32 mb=16 with checkpointing, amp-bf16 mb=8 / mb=32, bf16 mb=16 / mb=32.
# Every grid's micro-batches go down to 1, so a finder that halves its way down always has a size
# left to try (a grid starting at 4 scored a finder that would have run 3 as finding nothing).
CELLS = (
    Cell("gpt-tiny", 12, (1, 2, 4, 6, 12), _THREE, (64, 94, 128)),
    Cell("convnet-bn", 24, (1, 2, 4, 6, 8, 12, 24), _THREE, (16, 24)),
    Cell("gpt-tiny", 4, (1, 2), _THREE, (24,), checkpoints=(0,),
         device_splits=(1, 2), split_modes=_PIPELINE_AND_FSDP),
    Cell(user_model("mixer.py"), 32, (1, 4, 8, 16, 32), _THREE, (16, 24)),
)
QUICK_CELLS = (
    Cell("gpt-tiny", 12, (1, 4, 12), (Precision.FP32, Precision.AMP_BF16), (64, 128)),
)


# The lean cell: gpt-tiny (AdamW) where the optimum needs a lean lever, which autofit searches (given the
# lean space's optimizer and checkpoint policy) and the batch finders cannot (they keep the workload's
# optimizer and full checkpointing, as the real tools do). Its own tuple, run alone by `--lean` and with
# the other cells by the full bench: the committed tables judge autofit on the lean levers too, and a
# lean-only run stays a few minutes. 90 configs (2 precisions x 5 micro-batches x 3 optimizers x (no
# checkpointing + full + selective)). Measured with `autofit measure` (the tracker matched the estimate
# to 0.01 MiB on each; adamw8bit aside, whose bitsandbytes CPU step allocates where the tracker cannot see):
# - 25 MiB: no config with the workload's own AdamW fits: the smallest, bf16 mb=1 ga=12 ckpt=1, is
#   25.27 MiB (bf16 mb=1 ckpt=0 26.87), so every finder scores 0. With adafactor: bf16 mb=1 ckpt=0
#   17.04 MiB (30.3 samples/s), mb=2 ckpt=1 18.50 (27.7), mb=2 ckpt=1/sel 22.27 (26.8), mb=2 ckpt=0
#   24.15 (39.2): the optimizer lever alone decides it.
# - 40 MiB: the own AdamW fits (bf16 mb=2 ckpt=0 33.98 MiB, 36.8 samples/s; mb=4 ckpt=1 36.89, 34.4) beside
#   larger lean micro-batches (adafactor bf16 mb=4 ckpt=0 38.36, 32.1; adamw8bit mb=4 ckpt=1 32.09 by the
#   tracker, 32.96 estimated): a budget where a lean lever need not win, for the grid to say which does
#   (these samples/s are single CLI runs on a loaded machine, +-10%). amp-bf16 with AdamW fits neither
#   budget (54.94 MiB at mb=1 ckpt=0), so the finders at amp-bf16 score 0 at both.
#
# The selective cell: gpt-tiny at 1024 tokens per sample, the workload's AdamW kept (selective checkpointing
# changes nothing in the training; the optimizer lever does, and has its own cell above). At this length a
# sample's activations, not the weights, decide what fits, and an operator's work is large enough that
# the selective policy's dispatch overhead no longer dominates (at 128 tokens, or on the 128-wide ViT, a
# selectively checkpointed step measured as slow as a fully checkpointed one). Measured with
# `autofit.measure` at global batch 4 (estimates equal to the tracker on each; samples/s of two runs,
# load ~1.3): bf16 mb=1 ckpt=0 77.9 MiB (11.7, 11.2 samples/s), ckpt=1/sel 70.4 (9.6, 9.7), ckpt=1 55.3
# (8.2, 7.0); mb=2 ckpt=1 89.6 (7.7, 9.8), ckpt=1/sel 119.7; amp-bf16 mb=1 ckpt=1 93.3 estimated.
# - 74 MiB: nothing fits without checkpointing, so every finder scores 0; selective (the middle point
#   per-layer intervals cannot reach) measured ~25% faster than full checkpointing.
# - 100 MiB: mb=1 without checkpointing fits: a budget where the lean lever must not be chosen.
LEAN_CELLS = (
    Cell("gpt-tiny", 12, (1, 2, 4, 6, 12), (Precision.AMP_BF16, Precision.BF16), (25, 40), checkpoints=(0, 1),
         optimizers=(OptimizerChoice.AS_GIVEN, OptimizerChoice.ADAFACTOR, OptimizerChoice.ADAMW8BIT),
         checkpoint_policies=(CheckpointPolicy.FULL, CheckpointPolicy.SELECTIVE)),
    Cell("gpt-tiny+seq_len=1024", 4, (1, 2, 4), (Precision.AMP_BF16, Precision.BF16), (74, 100), checkpoints=(0, 1),
         checkpoint_policies=(CheckpointPolicy.FULL, CheckpointPolicy.SELECTIVE)),
)

# The heavy cell: trials of 10 s and more here, the regime of the models people tune on a GPU, where a
# trial's steps, not a search's fixed costs, decide how soon an answer comes. gpt-mini (17.4M parameters)
# at 512 tokens per sample, global batch 8. Measured with `run_trial` (load ~0.8, one run each): bf16 mb=1
# ckpt=0 214.7 MiB, 3.99 samples/s, a trial of 11.1 s; mb=1 ckpt=1 169.6 MiB, 3.23, 9.7 s; mb=2 ckpt=1
# 205.3 MiB, 3.43, 15.6 s; mb=4 ckpt=1 276.8 MiB, 3.55, 17.4 s (estimates equal to the tracker; amp-bf16,
# whose fp32 weights and states double the model's memory, needs 348 MiB at mb=1 with checkpointing).
# - 212 MiB: nothing fits without checkpointing (bf16 mb=1 needs 214.7), so checkpointing decides it and
#   every finder scores 0;
# - 320 MiB: bf16 mb=1 and mb=2 (295.6 estimated) fit without it, beside checkpointed micro-batches up to 4.
HEAVY_CELLS = (
    Cell("gpt-mini+seq_len=512", 8, (1, 2, 4, 8), (Precision.AMP_BF16, Precision.BF16), (212, 320), checkpoints=(0, 1)),
)


def search_budgets(quick: bool = False) -> dict[str, tuple[int, ...]]:
    """Budgets in bytes per workload, as used by the search suite (the accuracy suite reuses them).

    A workload in several cells gets the budgets of all of them; the lean cells' are left out (the
    accuracy suite judges its lean rows by their own target)."""
    out: dict[str, tuple[int, ...]] = {}
    for c in QUICK_CELLS if quick else CELLS:
        out[c.workload] = tuple(sorted(set(out.get(c.workload, ())) | {b * MiB for b in c.budgets_mib}))
    return out


def problem_for(cell: Cell, budget_bytes: int, param_count: int) -> Problem:
    # The peers' default precision is fp32 (Problem); a grid without it (the lean cell) gives its first
    # instead. No peer runs at it unchanged: each runs at the user's precision or sweeps them all.
    default = Precision.FP32 if Precision.FP32 in cell.precisions else cell.precisions[0]
    return Problem(workload=cell.workload, budget_bytes=budget_bytes, global_batch=cell.global_batch,
                   precisions=cell.precisions, default_precision=default, micro_batches=cell.micro_batches, checkpoints=cell.checkpoints,
                   param_count=param_count, device_splits=cell.device_splits, split_modes=cell.split_modes,
                   optimizers=cell.optimizers, checkpoint_policies=cell.checkpoint_policies, device=cell.device)
