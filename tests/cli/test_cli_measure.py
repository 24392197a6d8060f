"""``python -m autofit measure`` as a user runs it: the JSON contract, exit codes, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from autofit.cli import main
from autofit.runtime.tracker import CATEGORIES

REPO = __import__("pathlib").Path(__file__).resolve().parents[2]
JSON_KEYS = {"workload", "config", "device", "status", "peak_bytes", "per_device_peak_bytes", "breakdown",
             "samples_per_s", "step_time_s", "error"}


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "autofit", "measure", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(process: subprocess.Popen, timeout: float = 180) -> tuple[int, str, str]:
    stdout, stderr = process.communicate(timeout=timeout)
    return process.returncode, stdout, stderr


def test_json_contract(trial_workload_spec):
    # "noisy" prints when loaded (in this parent and in the child): stdout must stay one JSON object.
    code, stdout, stderr = _finish(_start("--model", trial_workload_spec("noisy"), "--config", "micro_batch=4",
                                          "--device", "cpu", "--steps", "1", "--json"))
    assert code == 0, stderr
    data = json.loads(stdout)
    assert JSON_KEYS <= set(data)
    assert data["status"] == "ok" and data["error"] is None and data["device"] == "cpu"
    assert data["workload"] == "noisy"
    assert data["config"] == {"precision": "fp32", "micro_batch": 4, "grad_accum": 1, "checkpoint_every": 0,
                              "device_split": 1, "split_mode": "pipeline", "optimizer": "as-given",
                              "checkpoint_policy": "full", "offload": "none"}
    assert set(data["breakdown"]) == set(CATEGORIES)
    assert data["peak_bytes"] == sum(data["breakdown"].values()) and data["per_device_peak_bytes"] == [data["peak_bytes"]]
    assert data["samples_per_s"] > 0 and data["step_time_s"] > 0
    assert "hello from the workload" in stderr


def test_summary_and_exit_1_when_not_ok(trial_workload_spec, capsys):
    code = main(["measure", "--model", trial_workload_spec("wide"), "--budget", "100KB", "--device", "cpu",
                 "--steps", "1"])  # in this process: the trial itself still runs in a child
    out = capsys.readouterr().out
    assert code == 1
    assert "status     oom: live tensor bytes reached" in out
    assert "budget     100.00 KB (97.66 KiB) per device" in out  # the budget in both unit systems


# Each error path once in a real subprocess (a user's view: exit 2, one line, no traceback),
# started all at once since each pays ~2.5 s of imports; the rest in this process.
SUBPROCESS_BAD_INPUTS = {
    "bare budget": ["--model", "gpt-tiny", "--budget", "8"],          # BudgetError
    "missing file": ["--model", "missing/file.py:make"],              # WorkloadError
    "zero steps": ["--model", "gpt-tiny", "--steps", "0"],            # argparse
}
IN_PROCESS_BAD_INPUTS = {
    "bad config value": ["--model", "gpt-tiny", "--config", "micro_batch=0"],
    "unknown config key": ["--model", "gpt-tiny", "--config", "batch=8"],
    "unknown model": ["--model", "no-such-model"],
    "bad timeout": ["--model", "gpt-tiny", "--timeout", "-1"],
    "bad timed steps": ["--model", "gpt-tiny", "--timed-steps", "0"],
    "bad device": ["--model", "gpt-tiny", "--device", "tpu"],
    "no model": [],
}
if not torch.cuda.is_available():
    IN_PROCESS_BAD_INPUTS["cuda without a GPU"] = ["--model", "gpt-tiny", "--device", "cuda"]


def _assert_one_error_line(name: str, stdout: str, stderr: str) -> None:
    assert stdout == "", name
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autofit: error: "), f"{name}: {stderr!r}"


def test_bad_inputs_exit_2_with_one_line_in_a_subprocess():
    processes = {name: _start(*args) for name, args in SUBPROCESS_BAD_INPUTS.items()}
    for name, process in processes.items():
        code, stdout, stderr = _finish(process, timeout=120)
        assert code == 2, f"{name}: exit {code}\n{stderr}"
        _assert_one_error_line(name, stdout, stderr)


@pytest.mark.parametrize("name", IN_PROCESS_BAD_INPUTS)
def test_bad_inputs_exit_2_with_one_line(name, capsys):
    try:
        code = main(["measure", *IN_PROCESS_BAD_INPUTS[name]])
    except SystemExit as exc:  # argparse errors exit from the parser
        code = exc.code
    assert code == 2
    captured = capsys.readouterr()
    _assert_one_error_line(name, captured.out, captured.err)


@pytest.mark.cuda
def test_cuda_json():
    code, stdout, stderr = _finish(_start("--model", "gpt-tiny", "--config", "precision=amp-bf16,micro_batch=4",
                                          "--device", "cuda", "--json"))
    assert code == 0, stderr
    data = json.loads(stdout)
    assert data["device"] == "cuda" and data["peak_reserved_bytes"] >= data["peak_bytes"] > 0


@pytest.mark.parametrize(("argv", "measured", "timed"), [
    ([], 3, 3), (["--steps", "1"], 1, 3), (["--steps", "5"], 5, 5), (["--steps", "1", "--timed-steps", "1"], 1, 1),
])
def test_steps_and_timed_steps_set_the_trials_schedule(monkeypatch, argv, measured, timed):
    import autofit.cli.measure as measure_cli
    from autofit.trial.run import TrialResult

    seen = {}

    def fake_run_trial(workload, config, **kwargs):
        seen.update(kwargs)
        return TrialResult(workload="gpt-tiny", config=config, device="cpu", status="error", error="not run")

    monkeypatch.setattr(measure_cli, "run_trial", fake_run_trial)
    assert main(["measure", "--model", "gpt-tiny", "--device", "cpu", *argv]) == 1
    schedule = seen["schedule"]
    assert (schedule.warmup_steps, schedule.measured_steps, schedule.timed_steps) == (2, measured, timed)
