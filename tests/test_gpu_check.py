"""scripts/gpu_check.py: its plumbing on the CPU (the CUDA-only parts skip) and its judging functions."""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


gc = _load()
GB = 10**9


def test_choose_budget_configs_picks_over_edge_and_safe():
    budget = 8 * GB
    predicted = {c: (i * GB, i * GB) for i, c in enumerate(gc.B_CANDIDATES[:20])}  # 0..19 GB
    predicted[gc.B_CANDIDATES[20]] = "estimate failed: x"
    chosen = dict(gc.choose_budget_configs(predicted, budget))
    assert predicted[chosen["over"]][0] == 12 * GB   # nearest 1.5x budget, inside (9, 16] GB
    assert predicted[chosen["edge"]][0] == 8 * GB    # the largest predicted <= budget
    assert predicted[chosen["safe"]][0] == 6 * GB    # the largest <= 80% of it


def test_choose_budget_configs_without_estimates_is_empty():
    assert gc.choose_budget_configs({c: "estimate failed" for c in gc.B_CANDIDATES}, 8 * GB) == []


@pytest.mark.parametrize("role,status,card,expected", [
    ("over", "oom", None, "pass"),
    ("over", "ok", 10 * GB, "FAIL"),
    ("edge", "ok", 8 * GB - 1, "pass"),
    ("edge", "ok", 8 * GB + 1, "FAIL"),
    ("safe", "oom", None, "FAIL"),
    ("safe", "ok", None, "FAIL"),
])
def test_judge_budget(role, status, card, expected):
    assert gc.judge_budget(role, status, card, 8 * GB).startswith(expected)


def test_errors_against_the_card_count_the_context():
    row = gc.fill_errors(gc.Row("a", "w", "c", "ok", predicted_bytes=1100, predicted_allocated_bytes=450,
                                allocated_bytes=500, reserved_bytes=600, context_bytes=400))
    assert row.card_bytes == 1000
    assert row.error_card == pytest.approx(0.10)
    assert row.error_allocated == pytest.approx(-0.10)


def test_verdict_fails_outside_the_targets_and_on_a_failed_check():
    good = [gc.fill_errors(gc.Row("a", "w", f"c{i}", "ok", predicted_bytes=1000 + i, predicted_allocated_bytes=500,
                                  allocated_bytes=500, reserved_bytes=600, context_bytes=400)) for i in range(5)]
    ok, line = gc.verdict(good, "cuda")
    assert ok and line.startswith("VERDICT: PASS")
    bad = good + [gc.fill_errors(gc.Row("a", "w", "far", "ok", predicted_bytes=1200, predicted_allocated_bytes=500,
                                        allocated_bytes=500, reserved_bytes=600, context_bytes=400))]
    ok, line = gc.verdict(bad, "cuda")
    assert not ok and "max 20.00%" in line
    ok, line = gc.verdict(good + [gc.Row("b", "gpt2", "x", "ok", check="FAIL: predicted over 8GB but ok")], "cuda")
    assert not ok and "predicted over 8GB but ok" in line


def test_an_under_estimate_over_the_allowed_share_fails_even_within_the_median_and_max():
    def row(name: str, predicted: int):
        return gc.fill_errors(gc.Row("a", "w", name, "ok", predicted_bytes=predicted, predicted_allocated_bytes=500,
                                     allocated_bytes=500, reserved_bytes=600, context_bytes=400))

    good = [row(f"c{i}", 1000 + i) for i in range(9)]
    ok, _ = gc.verdict(good + [row("under-2%", 980)], "cuda")
    assert ok  # 2% under the card: allowed
    ok, line = gc.verdict(good + [row("under-5%", 950)], "cuda")  # within max 6%, but 5% under
    assert not ok and "1 config(s) under-estimated by more than 3% (worst -5.0%)" in line


def test_a_workload_measured_but_not_estimated_fails_the_verdict():
    ok_row = gc.fill_errors(gc.Row("a", "w", "c0", "ok", predicted_bytes=1000, predicted_allocated_bytes=500,
                                   allocated_bytes=500, reserved_bytes=600, context_bytes=400))
    child = [{"kind": "config", "status": "ok", "peak_bytes": 10, "peak_reserved_bytes": 20, "context_bytes": 5}]
    lstm = gc.rows_from_child("a", "lstm-lm", ["c1"], {"c1": "estimate failed: WorkloadError: weight_buf"}, child, None)
    assert lstm[0].status == "ok" and lstm[0].error_card is None
    ok, line = gc.verdict([ok_row] + lstm, "cuda")
    assert not ok and "not estimated: lstm-lm" in line


def test_a_child_cut_short_leaves_its_configs_marked():
    child = [{"kind": "init"}, {"kind": "config", "status": "ok", "peak_bytes": 10, "peak_reserved_bytes": 20,
                                "context_bytes": 5}]
    rows = gc.rows_from_child("a", "w", ["c1", "c2", "c1"], {"c1": (30, 9), "c2": "estimate failed: E"}, child,
                              "time guard: child killed after 9 s", repeat_at=2)
    assert [r.status for r in rows] == ["ok", "skipped", "skipped"]
    assert rows[0].card_bytes == 25 and rows[0].error_card == pytest.approx(0.2)
    assert "time guard" in rows[1].note and rows[2].repeat


def test_a_child_ends_after_a_failed_config_and_a_fresh_one_runs_the_rest(monkeypatch, capsys):
    import autofit.trial.measure as measure

    ran = []

    def fake_measure(workload, config, **kw):
        ran.append(config.micro_batch)
        if config.micro_batch == 2:
            raise RuntimeError("boom")
        return {"status": "ok", "peak_bytes": 1}

    monkeypatch.setattr(measure, "measure_trial", fake_measure)
    gc.child_main({"spec": "gpt-tiny", "device": "cpu",
                   "configs": ["micro_batch=1", "micro_batch=2", "micro_batch=4"]})
    assert ran == [1, 2]  # the third is left to a fresh child
    assert capsys.readouterr().out.count(gc.ROW_PREFIX) == 2

    asked = []

    def fake_child(request, timeout_s, clock):
        asked.append(request["configs"])
        rows = [{"kind": "config", "status": "ok" if c != "c2" else "error"} for c in request["configs"]]
        cut = next((i + 1 for i, r in enumerate(rows) if r["status"] != "ok"), len(rows))
        return rows[:cut], None

    monkeypatch.setattr(gc, "run_child", fake_child)
    rows, why = gc.run_children({"configs": ["c1", "c2", "c3"]}, 60, gc.Clock(100))
    assert asked == [["c1", "c2", "c3"], ["c3"]] and why is None
    assert [r["status"] for r in rows] == ["ok", "error", "ok"]


def test_a_crashed_child_fails_the_verdict_but_the_time_guard_does_not():
    ok_row = gc.fill_errors(gc.Row("a", "w", "c0", "ok", predicted_bytes=1000, predicted_allocated_bytes=500,
                                   allocated_bytes=500, reserved_bytes=600, context_bytes=400))
    cut = gc.rows_from_child("a", "w2", ["c1"], {}, [], "time guard: child killed after 9 s")
    crashed = gc.rows_from_child("a", "w3", ["c1"], {}, [], "child exited with status -11")
    assert cut[0].status == "skipped" and crashed[0].status == "error"
    ok, line = gc.verdict([ok_row] + cut, "cuda")
    assert ok and "1 accuracy config(s) not run" in line
    ok, line = gc.verdict([ok_row] + crashed, "cuda")
    assert not ok and "w3 error" in line


def test_clock_gives_each_part_its_share():
    now = [100.0]
    clock = gc.Clock(400, now=lambda: now[0])
    now[0] = 150.0
    assert clock.left("a") == pytest.approx(400 * gc.PART_END["a"] - 50)
    assert clock.left("d") == pytest.approx(350)


def test_bad_arguments_are_one_line_errors():
    out = subprocess.run([sys.executable, str(SCRIPT), "--parts", "ax", "--device", "cpu"], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 2 and "--parts" in out.stderr
    out = subprocess.run([sys.executable, str(SCRIPT), "--workloads", "nope", "--device", "cpu"], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 2 and "nope" in out.stderr and "gpt-tiny" in out.stderr


@pytest.mark.slow
def test_plumbing_on_the_cpu(tmp_path):
    """A Hugging Face model through the whole path: estimate, child trial, repeat, files, verdict."""
    pytest.importorskip("transformers")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_WAIT_POLICY="PASSIVE")
    out = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--workloads", "hf-llama",
                          "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert out.returncode in (0, 1), out.stdout + out.stderr
    verdict = [line for line in out.stdout.splitlines() if line.startswith("VERDICT: ")]
    assert len(verdict) == 1 and "accuracy over 1 configs" in verdict[0]
    with (tmp_path / "gpu_check.csv").open() as f:
        rows = list(csv.DictReader(f))
    a = [r for r in rows if r["part"] == "a"]
    assert [r["status"] for r in a] == ["ok", "ok"] and a[1]["repeat"] == "True"
    assert int(a[0]["allocated_bytes"]) > 10 * 2**20 and int(a[0]["predicted_bytes"]) > 10 * 2**20
    assert abs(float(a[0]["error_allocated"])) < 0.5
    assert {r["part"]: r["status"] for r in rows if r["part"] != "a"} == {"b": "skipped", "c": "skipped",
                                                                            "d": "skipped"}
    md = (tmp_path / "gpu_check.md").read_text()
    assert "torch " in md and "hf-llama" in md and verdict[0] in md


def test_an_estimate_still_profiling_is_waited_for_by_its_part():
    from concurrent.futures import Future

    done, never = Future(), Future()
    done.set_result({"c1": (30, 9)})
    gc.LATE.update({"w-done": done, "w-never": never})
    try:
        assert gc.late_estimate("w-done", ["c1"], 1) == {"c1": (30, 9)}
        late = gc.late_estimate("w-never", ["c1", "c2"], 0.01)
        assert set(late) == {"c1", "c2"} and all(v.startswith("estimate failed") for v in late.values())
        assert gc.late_estimate("not-late", ["c1"], 1) == {}
    finally:
        gc.LATE.pop("w-done"), gc.LATE.pop("w-never")


def test_parts_may_be_given_with_commas():
    out = subprocess.run([sys.executable, str(SCRIPT), "--parts", "a,x", "--device", "cpu"], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 2 and "--parts" in out.stderr


def test_offload_configs_run_on_cuda_for_adamw_workloads_where_torchao_is(monkeypatch):
    from types import SimpleNamespace

    cuda = SimpleNamespace(quick=False, device="cuda")
    monkeypatch.setattr(gc.importlib.util, "find_spec", lambda name: object())
    assert gc.a_configs("gpt-tiny", cuda) == gc.A_CONFIGS + gc.OFFLOAD_CONFIGS
    assert gc.a_configs("convnet-bn", cuda) == gc.A_CONFIGS
    assert gc.a_configs("gpt-tiny", SimpleNamespace(quick=False, device="cpu")) == gc.A_CONFIGS  # pruned there
    assert gc.a_configs("gpt-tiny", SimpleNamespace(quick=True, device="cuda")) == gc.QUICK_CONFIGS
    monkeypatch.setattr(gc.importlib.util, "find_spec", lambda name: None)
    assert gc.a_configs("gpt-tiny", cuda) == gc.A_CONFIGS


def test_the_search_part_says_how_long_autofit_took_before_its_first_trial(tmp_path):
    """What the bench's gpu-cost regime charges autofit once per search, read from a search's trials.csv."""
    import datetime as dt

    started = dt.datetime(2026, 12, 3, 12, 0, 0).timestamp()
    path = tmp_path / "trials.csv"
    path.write_text("trial,status,started,trial_wall_s\n"
                    "0,pruned,,\n"
                    "1,ok,2026-12-03T12:00:16,9.5\n"
                    "2,oom,2026-12-03T12:00:26,2.0\n"
                    "3,running,2026-12-03T12:00:29,\n")
    note = gc.first_trial_note(path, started)
    assert "first real trial started 16 s after the search" in note and "2 real trials took 11.5 s" in note
    assert gc.first_trial_note(tmp_path / "missing.csv", started) == ""
    # given the search's end: how long it ran on after its last trial (the oom one ended at 12:00:28)
    assert "the last ended 4 s before the search did" in gc.first_trial_note(path, started, started + 32)
    assert "before the search did" not in note
