"""The bad-input corpus: every case goes through the real command line.

Each case asserts the exit status (2 for a usage error, 1 for a run-time failure), one line
on stderr naming what was wrong and what is accepted, no traceback (unless ``--debug``), and
where a study was there before, that it is still intact. Most cases run ``autofit.cli.main``
(what ``python -m autofit`` runs) in this process, its stdout and stderr captured at the file
descriptors (so what child processes write is seen too) -- a fresh interpreter per case paid
~2 s of imports, most of this module's time. Cases marked ``process`` (user code calling
``sys.exit``, a profiling child's error relayed, an unreachable database, the exit of an
unknown command...) run as ``python -m autofit`` in a subprocess, at the same time as the
others. Most fail before any trial runs, so no case trains anything.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
BAD = TESTS / "bad_workloads.py"
SECRET_URL = "postgresql://user:secret@127.0.0.1:1/db"
TINY_MODEL = f"{TESTS / 'trial_workloads.py'}:tiny_lm"


@dataclass
class Case:
    argv: list[str]          # after `python -m autofit`; "{d}" is the case's own directory
    status: int              # the exit status expected
    says: tuple[str, ...]    # substrings (lower case) the message must hold: what was wrong, what is accepted
    files: dict = field(default_factory=dict)  # name -> text written in the case's directory first
    timeout_s: float = 180.0
    process: bool = False    # run as `python -m autofit` in a subprocess rather than main() here


def _estimate(*extra: str, model: str = "tiny", budget: str = "8GB") -> list[str]:
    return ["estimate", "--model", model, "--budget", budget, *extra]


def _search(d_out: str = "{d}/out", *extra: str, model: str = TINY_MODEL, budget: str = "1GB") -> list[str]:
    return ["search", "--model", model, "--budget", budget, "--space", "tiny", "--device", "cpu",
            "--out", d_out, "--trials", "1", *extra]


def _space_case(text: str, says: tuple[str, ...]) -> Case:
    return Case(_estimate("--space", "{d}/space.toml"), 2, says, files={"space.toml": text})


MILLION = "precision = ['fp32', 'amp-bf16']\nmicro_batch = %s\ngrad_accum = %s\ncheckpoint_every = %s\n" % (
    list(range(1, 101)), list(range(1, 101)), list(range(0, 50)))

CASES: dict[str, Case] = {
    # budgets
    "budget-bare-number": Case(_estimate(budget="8"), 2, ("'8'", "gb")),
    # autofit bench --workloads: a part that names no workload, or a suite without workloads
    "bench-workloads-unknown": Case(["bench", "--suite", "accuracy", "--workloads", "nosuchmodel", "--out", "{d}/b"], 2,
                                    ("nosuchmodel", "gpt-tiny")),
    "bench-workloads-wrong-suite": Case(["bench", "--suite", "search", "--workloads", "gpt", "--out", "{d}/b"], 2,
                                        ("--workloads", "--suite accuracy")),
    "budget-negative": Case(_estimate(budget="-1GB"), 2, ("-1gb", "positive"), process=True),
    "budget-negative-equals": Case(["estimate", "--model", "tiny", "--budget=-1GB"], 2, ("-1gb", "positive")),
    "budget-zero": Case(_estimate(budget="0GB"), 2, ("0gb", "positive")),
    "budget-unknown-unit": Case(_estimate(budget="8XB"), 2, ("8xb", "gib")),
    "budget-infinite": Case(_estimate(budget="1e999GB"), 2, ("1e999gb", "finite")),
    "budget-empty": Case(_estimate(budget=""), 2, ("''", "gb")),
    "budget-search": Case(_search(budget="lots"), 2, ("lots", "gb")),
    "budget-measure": Case(["measure", "--model", "tiny", "--budget", "8"], 2, ("'8'", "gb")),
    "budget-shorthand-unknown": Case(_estimate(budget="8Gi"), 2, ("'8gi'", "8g = 8gb", "powers of 1024")),
    # configs
    "config-unknown-key": Case(_estimate("--config", "micro_btch=8"), 2, ("micro_btch", "micro_batch")),
    "config-wrong-type": Case(_estimate("--config", "micro_batch=eight"), 2, ("eight", "integer")),
    "config-micro-batch-0": Case(_estimate("--config", "micro_batch=0"), 2, ("micro_batch 0", ">= 1")),
    "config-unknown-precision": Case(_estimate("--config", "precision=fp64"), 2, ("fp64", "amp-bf16")),
    "config-no-equals": Case(_estimate("--config", "micro_batch"), 2, ("micro_batch", "key=value")),
    "config-more-stages-than-layers": Case(_estimate("--config", "device_split=8", model=f"{BAD}:fine"), 2,
                                           ("device_split 8 > 2 layers", "device_split 1 to 2")),
    "config-measure-unknown-key": Case(["measure", "--model", "tiny", "--config", "speed=11"], 2,
                                       ("speed", "micro_batch")),
    # spaces
    "space-missing-file": Case(_estimate("--space", "{d}/nope.toml"), 2, ("nope.toml", "no such")),
    "space-unknown-name": Case(_estimate("--space", "huge"), 2, ("huge", "tiny")),
    "space-malformed-toml": _space_case("precision = [fp32\n", ("not valid toml", "space.toml")),
    "space-unknown-key": _space_case("precision = ['fp32']\nmicro_batch = [2]\nlr = [0.1]\n", ("'lr'", "micro_batch")),
    "space-empty-list": _space_case("precision = ['fp32']\nmicro_batch = []\n", ("micro_batch", "at least one")),
    "space-wrong-type": _space_case("precision = ['fp32']\nmicro_batch = ['two']\n", ("two", "integers")),
    "space-unknown-precision": _space_case("precision = ['fp64']\nmicro_batch = [2]\n", ("fp64", "amp-bf16")),
    "space-missing-key": _space_case("micro_batch = [2]\n", ("precision", "missing")),
    "space-global-batch-indivisible": _space_case("precision = ['fp32']\nmicro_batch = [2, 4]\nglobal_batch = 7\n",
                                                  ("global_batch", "7")),
    "space-million-configs": _space_case(MILLION, ("1,000,000 configs", "at most")),
    "global-batch-flag-indivisible": Case(_estimate("--space", "tiny", "--global-batch", "7"), 2, ("global_batch", "7")),
    "global-batch-flag-zero": Case(_search("{d}/out", "--global-batch", "0"), 2, ("'0'", "positive")),
    # workloads
    "workload-unknown-builtin": Case(_estimate(model="gpt-huge"), 2, ("gpt-huge", "built-in")),
    "workload-missing-file": Case(_estimate(model="{d}/missing.py:make"), 2, ("missing.py", "no such file")),
    "workload-missing-function": Case(_estimate(model=f"{BAD}:nothing_here"), 2, ("nothing_here", "no function")),
    "workload-not-callable": Case(_estimate(model=f"{BAD}:not_a_function"), 2, ("not_a_function", "no function")),
    "workload-syntax-error": Case(_estimate(model="{d}/broken.py:make"), 2, ("broken.py", "syntaxerror"),
                                  files={"broken.py": "def make(:\n"}),
    "workload-missing-module": Case(_estimate(model="no_such_pkg.models:make"), 2, ("no_such_pkg", "cannot import")),
    "workload-raises": Case(_estimate(model=f"{BAD}:raises"), 2, ("raises()", "dataset path not configured")),
    "workload-wrong-type": Case(_estimate(model=f"{BAD}:wrong_type"), 2, ("dict", "autofit.workload")),
    "workload-sys-exit": Case(_estimate(model=f"{BAD}:exits"), 2, ("exits()", "sys.exit", "workload"), process=True),
    "workload-bad-shapes": Case(_estimate(model=f"{BAD}:bad_shapes"), 2, ("bad-shapes", "batch(n)", "[2, 19]"), process=True),
    "workload-nonscalar-loss": Case(_estimate(model=f"{BAD}:nonscalar_loss"), 2, ("nonscalar", "loss(", "scalar")),
    "workload-no-layers": Case(_estimate(model=f"{BAD}:no_layers"), 2, ("modulelist", "layers=", "modulelist([m])")),
    "workload-file-without-function": Case(_estimate(model=str(BAD)), 2, ("bad_workloads.py", "no function", ":workload")),
    "workload-missing-file-without-function": Case(_estimate(model="{d}/nope.py"), 2, ("nope.py", "no such path", ":function")),
    "workload-model-returns-none": Case(_estimate(model=f"{BAD}:model_returns_none"), 2, ("model()", "nonetype", "nn.module")),
    "workload-layers-not-a-list": Case(_estimate(model=f"{BAD}:layers_not_a_list"), 2, ("layers(model)", "linear", "nn.modulelist")),
    "workload-one-tensor-batch": Case(_estimate(model=f"{BAD}:one_tensor_batch"), 2, ("one-tensor", "batch(2)", "tensor",
                                                                                      "(inputs, targets)")),
    "workload-model-instance": Case(_estimate(model=f"{BAD}:model_instance"), 2, ("workload.model", "model=net", "instance")),
    "workload-optimizer-instance": Case(_estimate(model=f"{BAD}:optimizer_instance"), 2,
                                        ("workload.optimizer", "lambda params: torch.optim.sgd(params", "instance")),
    "workload-optimizer-reads-values": Case(_estimate(model=f"{BAD}:optimizer_reads_values"), 2,
                                            ("asgd", "optimizer's step", ".item()", "adamw")),
    "workload-optimizer-needs-closure": Case(_estimate(model=f"{BAD}:optimizer_needs_closure"), 2,
                                             ("lbfgs", "closure", "optimizer.step()", "adamw")),
    "workload-all-frozen": Case(_estimate(model=f"{BAD}:frozen"), 2, ("frozen", "requires_grad")),
    "workload-hf-option-on-builtin": Case(_estimate("--seq-len", "16"), 2, ("--seq-len", "hf:")),
    # storages
    "storage-malformed-url": Case(_search("{d}/out", "--storage", "notaurl"), 2, ("notaurl", "postgresql://")),
    "storage-unknown-scheme": Case(_search("{d}/out", "--storage", "ftp://host/db"), 2, ("ftp", "sqlite")),
    "storage-unreachable-postgres": Case(_search("{d}/out", "--storage", SECRET_URL), 1,
                                         ("user:***@127.0.0.1:1/db", "cannot"), timeout_s=60, process=True),
    "report-no-study": Case(["report", "{d}"], 2, ("no study", "autofit search")),
    "report-missing-dir": Case(["report", "{d}/nope"], 2, ("nope", "no such directory", "autofit search --out")),
    "report-a-studys-file": Case(["report", "{d}/trials.csv"], 2, ("trials.csv", "is a file", "directory"),
                                 files={"study.journal": "", "trials.csv": "number\n"}),
    "report-a-plain-file": Case(["report", "{d}/notes.txt"], 2, ("notes.txt", "is a file", "output directory"),
                                files={"notes.txt": "x"}),
    "report-corrupt-meta": Case(["report", "{d}"], 2, ("study.json", "not valid json", "study.journal"),
                                files={"study.json": "{not json", "study.journal": ""}),
    "report-garbage-journal": Case(["report", "{d}"], 2, ("study.journal", "holds no study", "optuna journal"),
                                   files={"study.journal": "garbage {{{\n"}),
    "report-journal-missing": Case(["report", "{d}"], 2, ("study.journal", "missing", "'s'", "copy it back"),
                                   files={"study.json": '{"study_name": "s", "storage": null, "journal": "study.journal"}'}),
    "export-a-studys-file": Case(["export", "{d}/study.json", "--to", "hf"], 2, ("study.json", "is a file", "directory"),
                                 files={"study.json": "{}"}),
    "export-out-a-directory": Case(["export", "--config", "micro_batch=2", "--to", "json", "--device", "cpu",
                                    "--out", "{d}"], 2, ("is a directory", "file path")),
    # output
    "out-under-a-file": Case(_search("{d}/afile/out"), 1, ("afile", "directory"), files={"afile": "x"}, process=True),
    "study-name-escapes": Case(_search("{d}/out", "--study", "../../x"), 2, ("../../x", "letters")),
    "study-name-absolute": Case(_search("{d}/out", "--study", "/tmp/x"), 2, ("/tmp/x", "letters")),
    # the command line itself
    "unknown-command": Case(["serch"], 2, ("serch", "did you mean search?"), process=True),
    # an unknown option is named first (not "--budget is required"), with the close match; no abbreviations
    "unknown-option-before-missing": Case(["search", "--budjet", "8GB"], 2,
                                          ("unknown argument --budjet", "did you mean --budget?")),
    "unknown-option-equals": Case(_estimate("--confg=micro_batch=2"), 2, ("unknown argument --confg", "--config?")),
    "unknown-option-before-bad-value": Case(_search("{d}/out", "--wrkers", "2", "--trials", "many"), 2,
                                            ("unknown argument --wrkers", "--workers?")),
    "unknown-option-no-match": Case(_estimate("--zzz"), 2, ("unknown argument --zzz",)),
    "abbreviated-option": Case(["estimate", "--mod", "tiny", "--budget", "8GB"], 2,
                               ("unknown argument --mod", "did you mean --model?")),
    "unknown-option-before-command": Case(["--verbose", "search", "--budget", "8GB"], 2,
                                          ("unknown argument --verbose",)),
    "unknown-device": Case(_estimate("--device", "tpu"), 2, ("tpu", "cuda")),
    "workers-zero": Case(_search("{d}/out", "--workers", "0"), 2, ("'0'", "positive")),
    "trials-not-a-number": Case(_search("{d}/out", "--trials", "many"), 2, ("many", "positive")),
}


def _run(case: Case, d: Path, debug: bool = False, environ: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m autofit ARGV`` in a fresh interpreter, in directory ``d``, in ``environ`` (default ours)."""
    argv = [a.replace("{d}", str(d)) for a in case.argv]
    environ = dict(os.environ) if environ is None else environ
    env = {**environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), environ.get("PYTHONPATH")])),
           "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "autofit", *(["--debug"] if debug else []), *argv], cwd=d, env=env,
                          capture_output=True, text=True, timeout=case.timeout_s)


def _run_here(case: Case, d: Path) -> subprocess.CompletedProcess:
    """``autofit.cli.main(ARGV)`` in this process, in directory ``d``, with file descriptors 1 and 2
    (and sys.stdout, sys.stderr on them) captured: the same outcome ``python -m autofit`` has."""
    from autofit.cli import main

    argv = [a.replace("{d}", str(d)) for a in case.argv]
    cwd, streams = os.getcwd(), (sys.stdout, sys.stderr)
    saved = [os.dup(1), os.dup(2)]
    files = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
    for stream in streams:
        stream.flush()
    try:
        os.chdir(d)
        for fd, f in zip((1, 2), files):
            os.dup2(f.fileno(), fd)
        sys.stdout, sys.stderr = (open(fd, "w", buffering=1, closefd=False) for fd in (1, 2))  # noqa: SIM115
        try:
            status = main(argv)
        except SystemExit as exc:  # argparse's own exit
            status = exc.code if isinstance(exc.code, int) else 1
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        sys.stdout, sys.stderr = streams
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
        os.chdir(cwd)
    out, err = (f.seek(0) or f.read().decode(errors="replace") for f in files)
    for f in files:
        f.close()
    return subprocess.CompletedProcess(["autofit", *argv], status, out, err)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Every case run once: the ``process`` ones in subprocesses, a few at a time, while the others
    run here one after another. name -> CompletedProcess."""
    dirs = {}
    for name, case in CASES.items():
        d = tmp_path_factory.mktemp(name)
        for file, text in case.files.items():
            (d / file).write_text(text)
        dirs[name] = d
    results = {}
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        environ = dict(os.environ)  # taken now: the cases run here change ours meanwhile
        futures = {name: pool.submit(_run, case, dirs[name], environ=environ)
                   for name, case in CASES.items() if case.process}
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("AUTOFIT_PROFILE_WORKERS", "1")  # profile here: a child's relayed error is a process case
            # `autofit bench` without a wait policy restarts itself (os.execve) with one: that would replace pytest
            mp.setenv("OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
            for name, case in CASES.items():
                if not case.process:
                    results[name] = _run_here(case, dirs[name])
        results.update({name: future.result() for name, future in futures.items()})
    return results


def test_corpus_is_large_enough():
    assert len(CASES) >= 40


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(outcomes, name):
    case, done = CASES[name], outcomes[name]
    lines = done.stderr.strip().splitlines()
    assert done.returncode == case.status, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    # one error line, the last (a progress line such as "profiling ..." may come before it)
    assert [line for line in lines if "error" in line.lower()] == lines[-1:], done.stderr
    assert lines[-1].startswith("autofit: error: "), done.stderr
    for needle in case.says:
        assert needle in lines[-1].lower(), (needle, lines[-1])
    assert "secret" not in done.stderr + done.stdout


def test_budget_help_says_what_the_shorthand_means(capsys):
    from autofit.cli import main

    for command in ("search", "estimate", "measure", "size"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "8GB or 8G (decimal units: 8*10^9 bytes" in text and "GiB" in text, (command, text)


def test_debug_shows_the_traceback(tmp_path):
    done = _run(CASES["workload-raises"], tmp_path, debug=True)
    assert done.returncode == 2
    assert "Traceback" in done.stderr and "dataset path not configured" in done.stderr


def test_nothing_escapes_the_output_directory(outcomes, tmp_path_factory):
    # study-name-escapes ran in its own directory: nothing was created two levels up.
    d = tmp_path_factory.getbasetemp()
    assert not (d / "x").exists() and not (d.parent / "x").exists()


def test_torn_journal_line_is_repaired(tmp_path):
    """A journal whose last line was cut mid-write (a worker killed while writing) still opens:
    the torn line is dropped with a warning, and the file as it was is kept as a backup."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    out = tmp_path / "out"
    out.mkdir()
    journal = out / "study.journal"
    storage = JournalStorage(JournalFileBackend(str(journal)))
    study = optuna.create_study(storage=storage, study_name="torn", direction="maximize")
    study.add_trial(optuna.trial.create_trial(params={"micro_batch": 2}, value=1.0, distributions={
        "micro_batch": optuna.distributions.CategoricalDistribution([2, 4])}))
    whole = journal.read_bytes()
    journal.write_bytes(whole + b'{"op_code": 4, "worker_id": "ab')  # cut mid-write
    done = _run(Case(["report", str(out)], 0, ()), tmp_path)
    assert "Traceback" not in done.stderr and "JSONDecodeError" not in done.stderr, done.stderr
    warnings = [line for line in done.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "torn" in warnings[0] and "backup" in warnings[0], done.stderr
    assert journal.read_bytes() == whole
    backups = list(out.glob("study.journal.torn-*"))
    assert len(backups) == 1 and backups[0].read_bytes().startswith(whole)


def test_bad_commands_leave_an_earlier_study_intact(tmp_path):
    """Bad input aimed at a directory that holds a study changes none of its files."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    out = tmp_path / "out"
    out.mkdir()
    storage = JournalStorage(JournalFileBackend(str(out / "study.journal")))
    optuna.create_study(storage=storage, study_name="earlier", direction="maximize").set_user_attr("x", 1)
    (out / "best.json").write_text('{"config": "earlier"}\n')
    (out / "trials.csv").write_text("number,status\n0,ok\n")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    bad = [_search(str(out), budget="8"), _search(str(out), "--storage", "notaurl"),
           _search(str(out), "--study", "../escape"), _search(str(out), "--space", str(tmp_path / "none.toml"))]
    done = [_run_here(Case(argv, 2, ()), tmp_path) for argv in bad]
    for d in done:
        assert d.returncode == 2 and d.stderr.strip().splitlines()[-1].startswith("autofit: error: "), d.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
