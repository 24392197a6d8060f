"""The built wheel carries what an installed autofit reads at run time (issue 8: the search
spaces were missing from a non-editable install)."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO_DIR = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory):
    """The file names inside a wheel built offline from a copy of the sources (the checkout
    keeps no build/ or egg-info)."""
    pytest.importorskip("setuptools")
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_DIR / name, src / name)
    shutil.copytree(REPO_DIR / "autofit", src / "autofit", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--wheel-dir", str(out), str(src)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (wheel,) = out.glob("autofit-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist())


def test_wheel_contains_the_builtin_search_spaces(wheel_names):
    shipped = {p.name for p in (REPO_DIR / "autofit" / "search_spaces").glob("*.toml")}
    assert "default.toml" in shipped
    for name in shipped:
        assert f"autofit/search_spaces/{name}" in wheel_names


def test_wheel_contains_every_module_and_nothing_outside_the_package(wheel_names):
    modules = {p.relative_to(REPO_DIR).as_posix() for p in (REPO_DIR / "autofit").rglob("*.py")}
    assert modules <= wheel_names
    top = {n.split("/")[0] for n in wheel_names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"autofit"}
