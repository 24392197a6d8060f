"""Cache keys follow a workload's code by content: the same file in another checkout, or touched,
reuses the cached profile and layer timings; an edit anywhere in the file (a module-level helper
that no class or workload function shows) is keyed anew."""

from __future__ import annotations

import json
import os

import pytest

from autofit.probes import layer_timing as layer_probe
from autofit.profiling.cache import profile_key
from autofit.workloads.load import load_workload

WORKLOAD = '''
import torch
import torch.nn.functional as F
from torch import nn

from autofit.workloads.base import Workload

SCALE = {scale}


def act(x):  # a module-level helper the blocks call
    return torch.relu(x) * SCALE


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return x + act(self.fc(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make():
    return Workload(name="keyed", model=Net, batch=lambda n: (torch.randn(n, 8), torch.randint(0, 2, (n,))),
                    loss=F.cross_entropy)
'''


def _write(directory, scale: float = 1.0, mtime: float = 1_700_000_000.0) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "net.py"
    path.write_text(WORKLOAD.format(scale=scale))
    os.utime(path, (mtime, mtime))
    return f"{path}:make"


def _key(spec: str) -> str:
    return profile_key(load_workload(spec), "cpu")[0]


@pytest.fixture
def original(tmp_path):
    spec = _write(tmp_path / "checkout-a")
    return spec, _key(spec)


def test_the_same_file_elsewhere_or_touched_has_the_same_keys(original, tmp_path):
    spec, key = original
    other = _write(tmp_path / "checkout-b", mtime=1_800_000_000.0)  # another checkout, another mtime
    assert _key(other) == key
    path = spec.rpartition(":")[0]
    os.utime(path, (1_900_000_000.0, 1_900_000_000.0))  # touch
    assert _key(spec) == key
    # the layer timings are found under the profile's key, whatever the file's path or mtime
    cached = layer_probe._cache_path(key, ["fp32"], "cpu")
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps({"seconds": {"fp32": [0.125, 0.5]}}))
    notes = []
    assert layer_probe.measure_layer_timings(other, ["fp32"], "cpu", note=notes.append, key=_key(other)).seconds == {
        "fp32": [0.125, 0.5]}
    assert "read from the cache" in notes[0]


def test_an_edit_of_a_helper_changes_the_keys(original, tmp_path):
    spec, key = original
    edited = _write(tmp_path / "checkout-a", scale=2.0)  # same path, same mtime, other content
    assert edited == spec
    edited_key = _key(edited)
    assert edited_key != key
    assert layer_probe._cache_path(edited_key, ["fp32"], "cpu") != layer_probe._cache_path(key, ["fp32"], "cpu")


def _function_from(path, name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"keyed_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def test_code_digests_do_not_depend_on_where_the_files_lie(tmp_path):
    from autofit.profiling.cache import code_digests

    def layout(model_dir: str, helper_dir: str):
        (tmp_path / model_dir).mkdir(parents=True)
        (tmp_path / helper_dir).mkdir(parents=True, exist_ok=True)
        (tmp_path / model_dir / "model.py").write_text("def build():\n    return 1\n")
        (tmp_path / helper_dir / "helper.py").write_text("def act():\n    return 2\n")
        return [_function_from(tmp_path / model_dir / "model.py", "build"),
                _function_from(tmp_path / helper_dir / "helper.py", "act")]

    # the model file sorts before its helper's by path in one checkout, after it in the other
    first = code_digests(layout("a/model", "b/helper"))
    second = code_digests(layout("z/model", "c/helper"))
    assert len(first) == 2 and first == second
