"""The command line starts the trials' fork server before it imports torch, for the commands that fork
from it on the CPU, and only where the device is surely the CPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

from autofit import cli
from autofit.runtime import forkserver


@pytest.fixture
def starts(monkeypatch, tmp_path):
    """The fork server starts asked for (none is started); no GPU driver's device files."""
    asked = []
    monkeypatch.setattr(forkserver, "start_server_soon", lambda extra=None: asked.append(extra))
    monkeypatch.setattr(cli, "_GPU_DEVICE_FILES", (str(tmp_path / "no-such-device"),))
    monkeypatch.delenv("AUTOFIT_TRIAL_SERVER", raising=False)
    monkeypatch.setattr(cli, "cpus_available", lambda: 2)
    return asked


@pytest.mark.parametrize("argv", [
    ["search", "--budget", "8GB"],
    ["--debug", "search", "--budget", "8GB", "--device", "cpu"],
    ["size", "--family", "gpt2", "--budget", "8GB", "--device=cpu"],
    ["measure", "--model", "gpt-tiny"],
])
def test_a_command_that_forks_on_the_cpu_starts_it(starts, argv):
    assert cli.start_fork_server_early(argv) is True
    assert starts == [None]


@pytest.mark.parametrize("argv", [
    ["search", "--budget", "8GB", "--device", "cuda"],
    ["search", "--device=cpu", "--budget", "8GB", "--device=cuda"],  # the last one given counts, as for argparse
    ["search", "--help"],
    ["report", "results/x"],
    ["estimate", "--model", "gpt-tiny"],
    ["bench"],
    ["--version"],
    [],
])
def test_a_command_that_may_not_fork_on_the_cpu_starts_nothing(starts, argv):
    assert cli.start_fork_server_early(argv) is False
    assert starts == []


def test_where_a_gpu_driver_is_present_only_an_explicit_cpu_device_starts_it(starts, monkeypatch, tmp_path):
    (tmp_path / "nvidiactl").touch()
    monkeypatch.setattr(cli, "_GPU_DEVICE_FILES", (str(tmp_path / "nvidiactl"),))
    assert cli.start_fork_server_early(["search", "--budget", "8GB"]) is False
    assert cli.start_fork_server_early(["search", "--budget", "8GB", "--device", "cpu"]) is True
    assert starts == [None]


def test_on_one_cpu_nothing_is_started_early(starts, monkeypatch):
    monkeypatch.setattr(cli, "cpus_available", lambda: 1)
    assert cli.start_fork_server_early(["search", "--budget", "8GB", "--device", "cpu"]) is False
    assert starts == []


def test_trials_spawned_without_the_fork_server_start_nothing(starts, monkeypatch):
    monkeypatch.setenv("AUTOFIT_TRIAL_SERVER", "0")
    assert cli.start_fork_server_early(["search", "--budget", "8GB"]) is False
    assert starts == []


def test_the_command_line_and_the_package_import_no_torch_before_the_command_is_parsed():
    # what lets the fork server's imports overlap this process's: nothing of ours before it needs torch
    code = ("import sys, autofit, autofit.cli, autofit.runtime.forkserver; "
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
