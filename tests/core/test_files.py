"""write_atomic's temporary files, and which of them a search may remove: a killed writer's, never a live one's."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from autofit.core.files import (
    STALE_TEMP_S,
    remove_stale_temp_files,
    stale_temp_files,
    temp_path,
    write_atomic,
)


def _dead_pid() -> int:
    """The pid of a process that exited and was reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_write_atomic_names_its_temporary_file_by_process_and_host(tmp_path):
    tmp = temp_path(tmp_path / "trials.csv")
    assert tmp.name.startswith(f".trials.csv.tmp{os.getpid()}@") and tmp.parent == tmp_path
    write_atomic(tmp_path / "trials.csv", "a\n")
    assert [p.name for p in tmp_path.iterdir()] == ["trials.csv"]


def test_only_a_gone_writers_temporary_files_are_stale(tmp_path):
    host = temp_path(tmp_path / "x").name.rpartition("@")[2]
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])  # exits; not reaped until wait()
    try:
        while open(f"/proc/{zombie.pid}/stat").read().rpartition(")")[2].split()[0] != "Z":
            time.sleep(0.05)
        dead = _dead_pid()
        names = {
            f".trials.csv.tmp{dead}@{host}": True,            # its writer was killed on this host
            f".best.json.tmp{dead}": True,                     # the same, named before hosts were
            f".summary.md.tmp{zombie.pid}@{host}": True,       # killed, not reaped yet
            f".report.html.tmp{os.getpid()}@{host}": False,    # a live writer: this process
            f".best_so_far.png.tmp{sleeper.pid}@{host}": False,  # another live one (a concurrent search)
            f".trials.csv.tmp{dead}@another-host": False,      # another machine's (a shared directory): fresh
            ".notes.tmp": False, "notes.tmp1": False, f"trials.csv.tmp{dead}": False,  # not autofit's
        }
        for name in names:
            (tmp_path / name).write_text("half")
        old = tmp_path / f".study.json.tmp{dead}@another-host"  # another machine's, but hours old
        old.write_text("half")
        os.utime(old, (time.time() - STALE_TEMP_S - 60,) * 2)
        names[old.name] = True
        (tmp_path / f".dir.tmp{dead}@{host}").mkdir()  # not a file
        expected = sorted(n for n, stale in names.items() if stale)
        assert [p.name for p in stale_temp_files(tmp_path)] == expected
        assert sorted(remove_stale_temp_files(tmp_path)) == expected
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            [n for n, stale in names.items() if not stale] + [f".dir.tmp{dead}@{host}"])
    finally:
        sleeper.kill()
        sleeper.wait()
        zombie.wait()
