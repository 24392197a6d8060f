"""scripts/cuda_peak_trace.py: the replay of an allocator history (here, a made-up one), and its refusal
without CUDA (the trace itself needs a card: results/benchmarks/gpu/README.md, run 7)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "cuda_peak_trace.py"


@pytest.fixture(scope="module")
def trace():
    spec = importlib.util.spec_from_file_location("cuda_peak_trace_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _frame(path: str, line: int, name: str) -> dict:
    return {"filename": path, "line": line, "name": name}


def test_the_peak_is_the_largest_live_total_and_its_blocks_are_named_by_our_frame(trace):
    ours = [_frame("/site/torch/nn/functional.py", 10, "linear"), _frame("/x/autofit/workloads/gpt.py", 207, "forward")]
    events = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": ours},
        {"action": "alloc", "addr": 2, "size": 50, "frames": []},
        {"action": "free_completed", "addr": 1},
        {"action": "alloc", "addr": 3, "size": 80, "frames": ours},  # 130 live: under the 150 before
        {"action": "free_requested", "addr": 2},  # still live until the free completes
    ]
    best, by_key = trace.peak_blocks(events)
    assert best == 150
    assert by_key == {"gpt.py:207 forward <- functional.py:10 linear": 100, "(no frames)": 50}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_cuda_it_says_so_in_one_line(trace, capsys):
    assert trace.main(["gpt-tiny:precision=fp32,micro_batch=2"]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["cuda_peak_trace: no CUDA device here (it traces the card's allocator); run it on a GPU machine"]
