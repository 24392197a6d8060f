"""The accuracy suite's lean-lever rows: which configs they are, and their own target against the allocator."""

from __future__ import annotations

from autofit.bench.accuracy import AccuracyResults, AccuracyRow, lean_stats, write_accuracy
from autofit.bench.accuracy_cases import LEAN_WORKLOADS, cases, is_lean
from autofit.core.config import TrainConfig

MiB = 2**20


def test_lean_rows_cover_each_lever_on_a_gpt_an_hf_llama_and_a_user_file():
    lean = cases(lean_only=True, workloads=LEAN_WORKLOADS)
    assert set(lean) == set(LEAN_WORKLOADS)
    assert "gpt-tiny" in LEAN_WORKLOADS and any(w.startswith("hf:llama") for w in LEAN_WORKLOADS)
    assert any("user_models" in w for w in LEAN_WORKLOADS)
    for configs in lean.values():
        assert all(is_lean(c) for c in configs)
        assert {c.optimizer.value for c in configs} >= {"adafactor", "adamw8bit"}
        assert any(c.checkpoint_policy.value == "selective" for c in configs)
        assert any(c.device_split == 2 for c in configs) and any(c.grad_accum > 1 for c in configs)
    # the full suite keeps the five levers' rows too, and they are not lean
    assert any(not is_lean(c) for c in cases(workloads=("gpt-tiny",))["gpt-tiny"])


def _row(config: str, predicted_mib: float, tracker_mib: float, allocator_mib: float | None) -> AccuracyRow:
    fields = {k: int(v) if v.isdigit() else v for k, v in (kv.split("=") for kv in config.split(","))}
    return AccuracyRow(workload="gpt-tiny", config=TrainConfig.from_dict(fields),
                       status="ok", predicted_peak_bytes=predicted_mib * MiB, measured_peak_bytes=int(tracker_mib * MiB),
                       allocator_peak_bytes=(int(allocator_mib * MiB),) * 3 if allocator_mib else ())


def test_lean_target_is_judged_against_the_allocator_and_names_what_the_tracker_cannot_see(tmp_path):
    rows = [
        # bitsandbytes' CPU step: the tracker misses its kernel's buffers, the allocator does not
        _row("precision=bf16,micro_batch=2,grad_accum=2,optimizer=adamw8bit", 33.0, 23.3, 33.0),
        _row("precision=fp32,micro_batch=4,optimizer=adafactor", 66.8, 66.8, 66.8),
        _row("precision=fp32,micro_batch=4,checkpoint_every=1,checkpoint_policy=selective", 79.0, 78.9, 78.9),
        _row("precision=fp32,micro_batch=4", 70.0, 70.0, 70.0),  # the five levers: not in the lean target
    ]
    res = AccuracyResults(rows, {}, None, 1.0)
    stats = lean_stats(res)
    assert stats.n == 3 and stats.max < 0.01
    assert res.stats(("gpt-tiny",)).n == 1  # the five levers' targets count only their own rows
    write_accuracy(tmp_path, {"date": "today"}, res)
    md = (tmp_path / "accuracy.md").read_text()
    lean_line = next(line for line in md.splitlines() if line.startswith("**Target, lean levers**"))
    assert "**PASS**" in lean_line and "Against the tracker alone" in lean_line and "+41." in md
    assert "the estimate matches the allocator, in 1 adamw8bit config" in lean_line
    assert "gpt-tiny (lean levers, against the allocator)" in md


def test_a_lean_row_off_the_allocator_fails_its_target(tmp_path):
    rows = [_row("precision=fp32,micro_batch=4,optimizer=adafactor", 60.0, 66.8, 66.8),
            _row("precision=bf16,micro_batch=4,optimizer=adamw8bit", 33.0, 33.0, 33.0)]
    write_accuracy(tmp_path, {"date": "today"}, AccuracyResults(rows, {}, None, 1.0))
    lean_line = next(line for line in (tmp_path / "accuracy.md").read_text().splitlines()
                     if line.startswith("**Target, lean levers**"))
    assert "**FAIL**" in lean_line


def test_a_selective_row_over_its_peak_is_named_with_why(tmp_path):
    rows = [_row("precision=fp32,micro_batch=8,checkpoint_every=1,checkpoint_policy=selective", 31.4, 28.4, 28.4),
            _row("precision=fp32,micro_batch=4,optimizer=adafactor", 66.8, 66.8, 68.4)]  # a kernel's own buffer
    write_accuracy(tmp_path, {"date": "today"}, AccuracyResults(rows, {}, None, 1.0))
    lean_line = next(line for line in (tmp_path / "accuracy.md").read_text().splitlines()
                     if line.startswith("**Target, lean levers**"))
    assert "**FAIL**" in lean_line and "Over by more than 8%" in lean_line and "1 config(s)" in lean_line
    assert "1 other config(s)" in lean_line and "a kernel allocates inside itself" in lean_line
