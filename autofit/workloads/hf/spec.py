"""``hf:SPEC`` resolved to a ``transformers`` config: only the config is read, never weights.

SPEC, in this order of precedence:

1. a local directory holding ``config.json``, or a path to a ``.json`` config file;
2. a ``model_type`` known to ``transformers`` (``gpt2``, ``llama``, ``qwen3``, ``bert``, ``vit``…),
   built from that config class's defaults;
3. otherwise a Hugging Face Hub id, resolved by ``AutoConfig`` from the local cache, or the network.

Overrides follow a ``?``: ``llama?num_hidden_layers=4&hidden_size=256``. Each key must be a field
of the config class (or one of its aliases, e.g. GPT-2's ``num_hidden_layers`` for ``n_layer``);
values are JSON literals (``4``, ``1e-5``, ``true``, ``null``, ``[1, 2]``) or else strings, and the
config class's own validation checks their types. Every mistake is a one-line WorkloadError.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from autofit.core.errors import WorkloadError

PREFIX = "hf:"


def require_transformers():
    """Import ``transformers`` or fail with the install hint."""
    try:
        import transformers
    except ImportError:
        raise WorkloadError("hf: models need the 'hf' extra: pip install 'autofit[hf]' "
                            "(transformers and peft)") from None
    return transformers


def config_mapping():
    """``model_type`` -> config class. Read from its defining module: the top-level ``transformers.CONFIG_MAPPING``
    is not exported by every 5.x release (5.17 lacks it)."""
    require_transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING


SOURCE_OPTIONS = ("seq_len", "task", "lora")  # a workload source's ``#`` options, in the order it writes them


def split_source(source: str) -> tuple[str, dict[str, str]]:
    """``"hf:gpt2?n_layer=2#seq_len=64#task=causal-lm"`` -> ``("hf:gpt2?n_layer=2", {"seq_len": "64",
    "task": "causal-lm"})``: a workload source (what trials reload) as its ``--model`` and its options.
    A source that is not ``hf:`` has no options. Raises WorkloadError for an unknown option."""
    if not source.startswith(PREFIX):
        return source, {}
    model, *items = source.split("#")
    options: dict[str, str] = {}
    for item in items:
        key, _, value = item.partition("=")
        if key not in SOURCE_OPTIONS:
            raise WorkloadError(f"{source!r}: unknown option {key!r}: expected seq_len, task or lora")
        options[key] = value
    return model, options


def source_flags(source: str) -> list[str]:
    """The command-line flags that give ``source`` back: ``--model`` and, for an ``hf:`` source's ``#``
    options, ``--seq-len``, ``--task`` and ``--lora`` (``autofit.cli._args.model_spec`` folds them in
    again, in this order). E.g. ``["--model", "hf:gpt2?n_layer=2", "--seq-len", "64", "--task", "causal-lm"]``."""
    model, options = split_source(source)
    flags = ["--model", model]
    for key in SOURCE_OPTIONS:
        if key in options:
            flags += ["--" + key.replace("_", "-"), options[key]]
    return flags


def split_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``"llama?hidden_size=256&num_hidden_layers=4"`` -> ``("llama", {"hidden_size": "256", ...})``."""
    base, _, query = spec.partition("?")
    if not base:
        raise WorkloadError(f"hf:{spec}: empty model name; expected hf:MODEL_TYPE, hf:path/to/dir or hf:org/name")
    overrides: dict[str, str] = {}
    for item in filter(None, query.split("&")):
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise WorkloadError(f"hf:{spec}: invalid override {item!r}: expected field=value, "
                                "e.g. hf:llama?num_hidden_layers=4")
        overrides[key.strip()] = value.strip()
    return base, overrides


def parse_value(text: str) -> Any:
    """A JSON literal when the text is one (numbers, true/false, null, lists), else the string itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _field_names(config_cls) -> set[str]:
    names = {f.name for f in dataclasses.fields(config_cls)} if dataclasses.is_dataclass(config_cls) else set()
    if not names:  # configs that are not dataclasses: their defaults are their fields
        names = set(config_cls().to_dict())
    return names | set(getattr(config_cls, "attribute_map", {}))


def _check_fields(config_cls, overrides: dict[str, Any], spec: str) -> None:
    known = _field_names(config_cls)
    for key in overrides:
        if key not in known:
            hint = ", ".join(sorted(k for k in known if "layer" in k or "hidden" in k or "size" in k)[:8])
            raise WorkloadError(f"hf:{spec}: {config_cls.__name__} has no field {key!r} (fields include {hint})")


def _build(config_cls, values: dict[str, Any], spec: str):
    try:
        return config_cls(**values)
    except Exception as exc:  # the config class's own type validation
        message = " ".join(str(exc).split())
        raise WorkloadError(f"hf:{spec}: invalid override for {config_cls.__name__}: {message}") from None


def _from_json_file(path: Path, overrides: dict[str, Any], spec: str):
    transformers = require_transformers()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise WorkloadError(f"hf:{spec}: cannot read {path} as JSON ({exc})") from None
    model_type = data.get("model_type") if isinstance(data, dict) else None
    mapping = config_mapping()  # a lazy mapping: its .get() does not see unloaded classes, ``in`` and [] do
    if model_type not in mapping:
        raise WorkloadError(f"hf:{spec}: {path} has no model_type known to transformers {transformers.__version__} "
                            f"(got {model_type!r})")
    config_cls = mapping[model_type]
    _check_fields(config_cls, overrides, spec)
    data = {k: v for k, v in data.items() if k not in ("model_type", "transformers_version")}
    try:
        return config_cls.from_dict({**data, **overrides})
    except Exception as exc:
        raise WorkloadError(f"hf:{spec}: invalid config in {path}: {' '.join(str(exc).split())}") from None


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the Hub answers at all: checked once, quickly, instead of the client's retries."""
    import os
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout_s):
            return True
    except OSError:
        return False


def _from_hub(name: str, overrides: dict[str, Any], spec: str):
    transformers = require_transformers()
    try:  # the local cache first: no network call at all when the config is there
        config = transformers.AutoConfig.from_pretrained(name, local_files_only=True)
    except Exception:
        if not _hub_reachable():
            raise WorkloadError(
                f"hf:{name} is not a local directory, a .json config or a model_type known to transformers, "
                "and as a Hub id it needs the network, which is not reachable (no cached config either)") from None
        try:
            config = transformers.AutoConfig.from_pretrained(name)
        except Exception as exc:
            raise WorkloadError(f"hf:{name}: AutoConfig could not load it from the Hub "
                                f"({type(exc).__name__}: {_last_line(exc)})") from None
    _check_fields(type(config), overrides, spec)
    if not overrides:
        return config
    try:
        return transformers.AutoConfig.from_pretrained(name, local_files_only=True, **overrides)
    except Exception as exc:
        raise WorkloadError(f"hf:{spec}: invalid override for {type(config).__name__}: {_last_line(exc)}") from None


def _last_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]


def resolve_config(spec: str):
    """The ``transformers`` config named by ``spec`` (without the ``hf:`` prefix), overrides applied."""
    require_transformers()
    base, raw = split_spec(spec)
    overrides = {k: parse_value(v) for k, v in raw.items()}
    path = Path(base)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise WorkloadError(f"hf:{spec}: directory {base} has no config.json")
        return _from_json_file(path / "config.json", overrides, spec)
    if path.suffix == ".json":
        if not path.is_file():
            raise WorkloadError(f"hf:{spec}: no such file {base}")
        return _from_json_file(path, overrides, spec)
    mapping = config_mapping()
    if base in mapping:
        config_cls = mapping[base]
        _check_fields(config_cls, overrides, spec)
        return _build(config_cls, overrides, spec)
    return _from_hub(base, overrides, spec)
