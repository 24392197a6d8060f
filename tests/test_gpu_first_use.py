"""scripts/gpu_first_use.py: its refusals here (its timings need a card: results/benchmarks/gpu/README.md, run 8)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_first_use.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_without_cuda_it_says_so_in_one_line():
    done = _run("--parts", "imports")
    assert done.returncode == 2
    assert done.stderr.strip() == "gpu_first_use: needs a CUDA device (torch.cuda.is_available() is False here)"


def test_an_unknown_part_is_refused_with_the_choices():
    done = _run("--parts", "imports,warp")
    assert done.returncode == 2 and "unknown parts warp; choose among imports, concurrent" in done.stderr
