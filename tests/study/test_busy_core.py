"""A search beside a busy core answers as a quiet one does, and its table shows what the trials got.

The space holds two configs that differ in quiet throughput (one sample at a time against sixteen:
several times on an AVX2 CPU, 1.6 times on one with AVX-512), which load can swap: OpenMP's
spin-waiting made a loaded trial read a tenth of its quiet figure at random, and beside a busy core
the config that parallelises well loses more than the other (both then read alike, so a starved
sample ranks by what it reaches, autofit.core.records.reach)."""

from __future__ import annotations

import os

import pytest

import autofit
from autofit.bench.steady import BusyCore

SPACE = {"precision": ["fp32"], "micro_batch": [1, 16], "global_batch": 16, "checkpoint_every": [0],
         "device_split": [1]}


def _search(out):
    return autofit.search("gpt-tiny", "1GB", space=SPACE, out=out, device="cpu", progress=False)


@pytest.mark.slow
@pytest.mark.alone  # the quiet search is the reference: another worker's trials must not load it
@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux's per-thread schedstat")
def test_a_search_beside_a_busy_core_gives_the_quiet_answer_and_records_the_wait(tmp_path, monkeypatch):
    # the premise: a trial's steps ask for a thread per core, as a user's do, so the busy loop takes one of them
    monkeypatch.setenv("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)  # as a user's shell has it: autofit picks its children's
    quiet = _search(tmp_path / "quiet")
    with BusyCore():
        loaded = _search(tmp_path / "loaded")
    assert quiet.best is not None and loaded.best == quiet.best, (quiet.table, loaded.table)
    ran = loaded.table[loaded.table["status"] == "ok"]
    # one trial may be all it needs (the other config predicted several times slower); each says what it
    # waited for a CPU
    assert len(ran) >= 1 and ran["max_wait_share"].notna().all(), ran

