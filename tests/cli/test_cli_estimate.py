"""`autofit estimate` and `autofit models` as a user runs them: JSON contracts and one-line errors."""

import json
import subprocess
import sys

import pytest

from autofit.cli import main

ESTIMATE_KEYS = {"workload", "budget_bytes", "config", "param_count", "params_bytes", "grads_bytes",
                 "optimizer_bytes", "activations_bytes", "temporary_bytes", "overhead_bytes",
                 "model_state_bytes", "peak_bytes", "per_device_peak_bytes", "fits"}


def autofit(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "autofit", *args], capture_output=True, text=True, timeout=timeout)


def test_estimate_one_config_json():
    proc = autofit("estimate", "--model", "gpt-tiny", "--budget", "1GB", "--device", "cpu",
                   "--config", "precision=bf16,micro_batch=4,grad_accum=2,checkpoint_every=1,device_split=2", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert ESTIMATE_KEYS <= set(data)
    assert data["config"] == {"precision": "bf16", "micro_batch": 4, "grad_accum": 2, "checkpoint_every": 1, "device_split": 2,
                              "split_mode": "pipeline", "optimizer": "as-given", "checkpoint_policy": "full",
                              "offload": "none"}
    assert data["budget_bytes"] == 10**9 and data["fits"] is True
    assert len(data["per_device_peak_bytes"]) == 2 and data["peak_bytes"] == max(data["per_device_peak_bytes"])
    assert data["model_state_bytes"] == 8 * data["param_count"] + 4 * 52  # bf16 AdamW + an fp32 step per tensor (52 tensors)


def test_estimate_space_json_sorted(tmp_path):
    space = tmp_path / "s.toml"
    space.write_text('precision = ["fp32", "bf16"]\nmicro_batch = [1, 8]\nglobal_batch = 8\ncheckpoint_every = [0, 1]\n')
    proc = autofit("estimate", "--model", "gpt-tiny", "--budget", "30MiB", "--device", "cpu", "--space", str(space), "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert set(data) >= {"workload", "budget_bytes", "configs"}
    peaks = [c["peak_bytes"] for c in data["configs"]]
    assert peaks == sorted(peaks) and len(peaks) == 8
    assert {"precision", "micro_batch", "grad_accum", "checkpoint_every", "device_split", "peak_bytes", "fits"} <= set(data["configs"][0])
    assert any(c["fits"] for c in data["configs"]) and not all(c["fits"] for c in data["configs"])


def test_estimate_table_says_what_would_fit():
    proc = autofit("estimate", "--model", "gpt-tiny", "--budget", "4MiB", "--device", "cpu", "--space", "default")
    assert proc.returncode == 1, proc.stderr  # nothing fits: a script can branch on it
    assert "Nothing in the space fits" in proc.stdout
    assert "4.19 MB (4.00 MiB)" in proc.stdout  # the budget in both unit systems
    assert "fewest devices" in proc.stdout or "nothing fits" in proc.stdout


@pytest.mark.parametrize("budget, status", [("1KiB", 1), ("1GiB", 0)])
@pytest.mark.parametrize("how", [[], ["--json"], ["--config", "precision=fp32,micro_batch=2"],
                                 ["--config", "precision=fp32,micro_batch=2", "--json"]])
def test_estimate_exit_status_says_whether_anything_fits(trial_workload_spec, write_space, tmp_path, capsys, budget,
                                                         status, how):
    space = write_space(tmp_path / "s.toml", precision=["fp32"], micro_batch=[1, 2])
    args = ["--space", str(space)] if "--config" not in how else []
    assert main(["estimate", "--model", trial_workload_spec("tiny"), "--budget", budget, "--device", "cpu",
                 *args, *how]) == status
    out = capsys.readouterr().out
    if "--json" in how:  # the JSON still comes, whatever the status
        data = json.loads(out)
        fits = [c["fits"] for c in data["configs"]] if "configs" in data else [data["fits"]]
        assert any(fits) == (status == 0)
    else:
        assert ("Nothing in the space fits" in out or "DOES NOT FIT" in out) == (status == 1)


@pytest.mark.parametrize("argv", [["estimate", "--model", "gpt-tiny", "--budget", "1GB", "--device", "cuda"],
                                  ["size", "--family", "gpt-tiny", "--budget", "1GB", "--device", "cuda"]])
def test_cuda_on_a_cpu_only_build_is_refused_up_front(argv, monkeypatch, capsys):
    # A CPU-only build cannot train on fake CUDA tensors (Tensor.copy_ raises, backward aborts the process).
    import torch

    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device cuda: this PyTorch" in err and "CPU-only build" in err, err
    assert "install a CUDA build of PyTorch" in err and "--device cpu" in err


def test_models_json():
    proc = autofit("models", "--json")
    assert proc.returncode == 0
    models = {m["name"]: m for m in json.loads(proc.stdout)}
    assert {"gpt-tiny", "llama-7b", "convnet-bn"} <= set(models)
    assert models["llama-7b"]["param_count"] == 6_738_415_616
    assert all(m["description"] for m in models.values())


@pytest.mark.parametrize("args, needle", [
    (["--model", "gpt-tiny", "--budget", "8"], "invalid budget"),
    (["--model", "gpt-tiny", "--budget", "0GB"], "invalid budget"),
    (["--model", "gpt-tiny", "--budget=-3GB"], "invalid budget"),
    (["--model", "gpt-tiny", "--budget", "8GB", "--config", "micro_batch=0"], "micro_batch"),
    (["--model", "gpt-tiny", "--budget", "8GB", "--config", "precision=fp8"], "precision"),
    (["--model", "gpt-tiny", "--budget", "8GB", "--config", "batch=3"], "unknown config key"),
    (["--model", "gpt-tiny", "--budget", "8GB", "--space", "/nonexistent.toml"], "no such search-space file"),
    (["--model", "no-such-model", "--budget", "8GB"], "unknown model"),
    (["--model", "/nonexistent/file.py:make", "--budget", "8GB"], "no such file"),
    (["--model", "autofit.workloads:nothing_here", "--budget", "8GB"], "has no function"),
    (["--model", "json:dumps", "--budget", "8GB"], "raised TypeError"),
    (["--model", "os:getcwd", "--budget", "8GB"], "expected autofit.Workload"),
    (["--model", "no_such_package_xyz:make", "--budget", "8GB"], "cannot import module"),
    (["--model", "gpt-tiny"], "required"),
])
def test_bad_inputs_one_line_exit_2(args, needle, capsys):
    try:
        status = main(["estimate", *args])
    except SystemExit as exc:  # argparse's own errors
        status = exc.code
    err = capsys.readouterr().err
    assert status == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], err


def test_bad_input_in_a_real_process_has_no_traceback():
    proc = autofit("estimate", "--model", "nope.py:make", "--budget", "8 gigs")
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_debug_shows_the_librarys_debug_lines(monkeypatch, capsys):
    # A probe's traceback is logged at DEBUG (autofit.probes.failures): --debug prints it, nothing else does.
    import logging

    from autofit import cli

    logger = logging.getLogger("autofit")
    monkeypatch.setattr(logger, "handlers", [])  # a handler on this test's stderr
    monkeypatch.setattr(logger, "level", logger.level)
    assert main(["estimate", "--model", "gpt-tiny", "--budget", "8", "--debug"]) == 2
    logging.getLogger("autofit.probes").debug("the probe's traceback\nline two")
    logging.getLogger("autofit.probes").warning("a warning")
    err = capsys.readouterr().err
    assert "autofit: debug: the probe's traceback\nline two\n" in err and "autofit: warning: a warning" in err
    cli._warnings_to_stderr(debug=False)
    logging.getLogger("autofit.probes").debug("hidden")
    assert "hidden" not in capsys.readouterr().err


def test_estimate_lean_space_names_the_levers_and_what_cannot_run(trial_workload_spec, write_space, tmp_path, capsys,
                                                                   monkeypatch):
    import importlib.util

    from autofit.runtime import optimizers

    real = importlib.util.find_spec  # as where bitsandbytes is not installed
    monkeypatch.setattr(optimizers.importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    space = write_space(tmp_path / "s.toml", precision=["fp32"], micro_batch=[2], checkpoint_every=[0, 1],
                        optimizer=["as-given", "adafactor", "adamw8bit"], checkpoint_policy=["full", "selective"])
    assert main(["estimate", "--model", trial_workload_spec("tiny"), "--budget", "1GB", "--device", "cpu",
                 "--space", str(space)]) == 0
    out = capsys.readouterr().out
    assert "9 configs, 6 predicted to fit" in out
    assert "3 cannot run: optimizer=adamw8bit needs bitsandbytes, which is not installed: pip install 'autofit[optim]'" in out
    assert " optimizer " in out and "adafactor" in out and " 1s " in out  # the optimizer column, ckpt 1s: selective
    assert "note: 3 of the 6 configs that fit replace the workload's AdamW (adafactor): that changes the training" in out
    assert main(["estimate", "--model", trial_workload_spec("tiny"), "--budget", "1GB", "--device", "cpu",
                 "--space", str(space), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {c["optimizer"] for c in data["configs"]} == {"as-given", "adafactor"}
    assert data["cannot_run"] == [{"reason": "optimizer=adamw8bit needs bitsandbytes, which is not installed: "
                                             "pip install 'autofit[optim]'", "configs": 3}]


def test_a_workload_whose_optimizer_the_lean_levers_cannot_replace_keeps_it(trial_workload_spec, capsys):
    """SGD with momentum: the lean space's adafactor and adamw8bit configs are pruned, each saying why, and
    every config that fits keeps the workload's own optimizer."""
    assert main(["estimate", "--model", trial_workload_spec("tiny_sgd"), "--budget", "1GB", "--device", "cpu",
                 "--space", "lean", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {c["optimizer"] for c in data["configs"]} == {"as-given"}
    reasons = {r["reason"] for r in data["cannot_run"]}
    for choice in ("adafactor", "adamw8bit"):
        assert any(f"the workload's optimizer is SGD: optimizer={choice} would change the training" in r
                   for r in reasons), reasons
