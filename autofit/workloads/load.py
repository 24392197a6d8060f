"""Resolving a ``--model`` spec to a :class:`~autofit.workloads.base.Workload`: a built-in name, a GPT preset,
``path/file.py:function``, ``package.module:function`` or ``hf:SPEC``.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
from pathlib import Path

from autofit.core.errors import WorkloadError
from autofit.workloads.base import Workload


def load_workload(spec: str | Workload) -> Workload:
    """Resolve ``--model``: a built-in name (a GPT preset may add ``+field=value,...``, e.g.
    ``gpt2+n_layer=24``), ``hf:SPEC``, ``path/to/file.py:function`` or ``package.module:function``.

    The function is called with no arguments and must return a Workload.
    Raises WorkloadError with a one-line reason otherwise.
    """
    if isinstance(spec, Workload):
        return spec
    if spec.startswith("hf:"):  # a Hugging Face model from its config (the hf extra)
        from autofit.workloads.hf import load_hf_source

        return load_hf_source(spec)
    from autofit.workloads import BUILTINS
    from autofit.workloads.gpt import PRESETS, preset_from_spec

    if spec in BUILTINS:
        return dataclasses.replace(BUILTINS[spec](), source=spec)
    if "+" in spec and spec.partition("+")[0] in PRESETS:  # a preset with GPTConfig overrides
        return dataclasses.replace(preset_from_spec(spec), source=spec)
    if ":" not in spec and (spec.endswith(".py") or Path(spec).is_file()):
        where = "names a file" if Path(spec).is_file() else "is no file (no such path) and names"
        raise WorkloadError(f"{spec!r} {where} but no function: add :function, the one returning an "
                            f"autofit.Workload (e.g. {spec}:workload)")
    if ":" not in spec:
        raise WorkloadError(
            f"unknown model {spec!r}: expected a built-in ({', '.join(BUILTINS)}), "
            "path/to/file.py:function or package.module:function"
        )
    target, _, func_name = spec.rpartition(":")
    module = _import_target(target, spec)
    func = getattr(module, func_name, None)
    if func is None or not callable(func):
        raise WorkloadError(f"{spec!r}: {target} has no function {func_name!r}")
    try:
        workload = func()
    except SystemExit as exc:  # user code must not end autofit's process
        raise WorkloadError(f"{spec!r}: {func_name}() called sys.exit({exc.code!r}); a workload function must "
                            "return an autofit.Workload") from exc
    except WorkloadError as exc:  # already says what is wrong (e.g. Workload's own checks)
        raise WorkloadError(f"{spec!r}: {exc}") from exc
    except Exception as exc:  # user code: report, don't crash
        raise WorkloadError(f"{spec!r}: {func_name}() raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(workload, Workload):
        raise WorkloadError(f"{spec!r}: {func_name}() returned {type(workload).__name__}, expected autofit.Workload")
    return dataclasses.replace(workload, source=spec)


def _import_target(target: str, spec: str):
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target)
        if not path.is_file():
            raise WorkloadError(f"{spec!r}: no such file {target}")
        module_name = f"autofit_user_{abs(hash(str(path.resolve())))}"
        loader_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[module_name] = module  # dataclasses and pickling look modules up here
        try:
            loader_spec.loader.exec_module(module)
        except (Exception, SystemExit) as exc:
            raise WorkloadError(f"{spec!r}: importing {target} raised {type(exc).__name__}: {exc}") from exc
        return module
    try:
        return importlib.import_module(target)
    except ImportError as exc:
        # `python -m autofit` can import a module of the current directory; an installed `autofit` cannot
        local = Path(*target.split(".")).with_suffix(".py")
        hint = f"; for the file {local} here, give its path: {local}:{spec.rpartition(':')[2]}" if local.is_file() else ""
        raise WorkloadError(f"{spec!r}: cannot import module {target!r} ({exc}){hint}") from exc
    except Exception as exc:
        raise WorkloadError(f"{spec!r}: importing {target} raised {type(exc).__name__}: {exc}") from exc

