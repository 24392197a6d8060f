"""Model families for ``autofit size``: a model whose size is set by a few integer fields.

A :class:`Family` names which field is the depth, the width, the heads, the feed-forward width
and the sequence length, holds the base model's values, and turns a shape into a ``--model``
spec that :func:`autofit.workloads.load.load_workload` loads (so trials can rebuild it in a fresh
process). Built in: the decoder family of :mod:`autofit.workloads.gpt`, any preset as its base.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from autofit.core.errors import AutofitError


class SizeError(AutofitError):
    """A bad family, --vary or sizing option."""




@dataclass(frozen=True)
class Roles:
    """Which config field plays which part; ``kv_heads`` may be None (no grouped-query field)."""

    depth: str
    width: str
    heads: str
    ffn: str | None    # None: the model derives it from the width itself
    seq: str
    kv_heads: str | None = None


GPT_ROLES = Roles(depth="n_layer", width="n_embd", heads="n_head", ffn="ffn_hidden", seq="seq_len",
                  kv_heads="n_kv_head")
GPT_ROLES_ORDER = ("n_layer", "n_embd", "n_head", "n_kv_head", "ffn_hidden", "seq_len", "vocab_size")
# Default grid: depths, and widths as multiples of the base model's head size (heads follow width).
DEFAULT_DEPTHS = (2, 4, 6, 8, 10, 12, 16, 20, 24, 28, 32, 40, 48)
DEFAULT_HEAD_MULTIPLES = (2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64)


@dataclass(frozen=True)
class Family:
    """A model family: base values of its size fields and how a shape becomes a ``--model`` spec.

    ``base`` holds every size field's value for the base model (resolved: no None);
    ``make_spec(values)`` returns the spec :func:`autofit.workloads.load.load_workload` loads.
    """

    name: str
    base: dict
    roles: Roles
    make_spec: Callable[[dict], str]
    extra_fields: tuple[str, ...] = ()  # other integer fields that may be varied (e.g. vocab_size)

    @property
    def fields(self) -> tuple[str, ...]:
        r = self.roles
        return tuple(f for f in (r.depth, r.width, r.heads, r.kv_heads, r.ffn, r.seq) if f) + self.extra_fields

    def resolve(self, varied: dict) -> dict:
        """All size fields for a shape: the varied ones as given, the others following the base.

        When the width changes and these are not varied themselves: the head count keeps the
        base head size, key/value heads keep the base grouping, the feed-forward width keeps
        the base ratio to the width. Raises SizeError when that is not a whole number.
        """
        r, base = self.roles, self.base
        out = {**base, **varied}
        width = out[r.width]
        if r.heads not in varied and width != base[r.width]:
            head_size = base[r.width] // base[r.heads]
            if width % head_size:
                raise SizeError(f"{r.width}={width} is not a multiple of the base head size {head_size}; "
                                f"vary {r.heads} too")
            out[r.heads] = width // head_size
        if r.kv_heads and r.kv_heads not in varied:
            group = base[r.heads] // base[r.kv_heads]
            if out[r.heads] % group:
                raise SizeError(f"{r.heads}={out[r.heads]} is not a multiple of the base grouping {group}")
            out[r.kv_heads] = out[r.heads] // group
        if r.ffn and r.ffn not in varied and width != base[r.width]:
            out[r.ffn] = int(round(width * base[r.ffn] / base[r.width]))
        return out

    def spec(self, values: dict) -> str:
        return self.make_spec(values)

    def default_vary(self) -> dict:
        head_size = self.base[self.roles.width] // self.base[self.roles.heads]
        return {self.roles.depth: list(DEFAULT_DEPTHS),
                self.roles.width: [head_size * k for k in DEFAULT_HEAD_MULTIPLES]}


def gpt_family(spec: str) -> Family:
    """The built-in decoder family based on ``spec``: a preset of ``autofit.workloads.gpt.PRESETS``,
    optionally with GPTConfig overrides (``gpt2+dropout=0.0``). Raises WorkloadError for a bad spec."""
    from autofit.workloads.gpt import GPTConfig, preset_from_spec

    preset, _, fixed = spec.partition("+")
    cfg = GPTConfig(**{k: v for k, v in preset_from_spec(spec).meta.items() if k != "kind"})
    base = {"n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "n_head": cfg.n_head, "n_kv_head": cfg.kv_heads,
            "ffn_hidden": cfg.ffn_width, "seq_len": cfg.seq_len, "vocab_size": cfg.vocab_size}
    overrides = dict(item.partition("=")[::2] for item in filter(None, fixed.split(",")))
    preset_cfg = GPTConfig(**{k: v for k, v in preset_from_spec(preset).meta.items() if k != "kind"})

    def make_spec(values: dict) -> str:
        # What differs from the preset (the family's own overrides first), and nothing the
        # preset's rules derive.
        changed = {k: v for k, v in values.items() if v != getattr(preset_cfg, k, None)}
        derived = dataclasses.replace(cfg, n_embd=values["n_embd"], n_head=values["n_head"], n_kv_head=None,
                                      ffn_hidden=None, seq_len=values["seq_len"])
        if changed.get("n_kv_head") == derived.kv_heads and cfg.n_kv_head is None:
            del changed["n_kv_head"]
        if changed.get("ffn_hidden") == derived.ffn_width and cfg.ffn_hidden is None:
            del changed["ffn_hidden"]
        items = {**{k: v for k, v in overrides.items() if k not in values},
                 **{k: changed[k] for k in GPT_ROLES_ORDER if k in changed}}
        return preset + "".join(f"{'+' if i == 0 else ','}{k}={v}" for i, (k, v) in enumerate(items.items()))

    return Family(name=spec, base=base, roles=GPT_ROLES, make_spec=make_spec, extra_fields=("vocab_size",))


# Hugging Face config fields by role, first match wins (GPT-2's configs answer to these names too).
HF_ROLE_FIELDS = {"depth": ("num_hidden_layers",), "width": ("hidden_size",), "heads": ("num_attention_heads",),
                  "kv_heads": ("num_key_value_heads",), "ffn": ("intermediate_size", "n_inner")}


def hf_family(text: str) -> Family:
    """An ``hf:SPEC[#seq_len=N]`` model as a family: its config's layers, hidden size, heads,
    key/value heads and intermediate size, plus the sequence length, are the size fields.

    Raises WorkloadError for a spec :func:`autofit.workloads.load.load_workload` refuses, SizeError
    for a config without layers, hidden size or heads."""
    from autofit.workloads.hf.spec import split_spec
    from autofit.workloads.load import load_workload

    workload = load_workload(text)
    config = workload.model.config
    source = workload.source.removeprefix("hf:")
    spec_part, *options = source.split("#")
    model, overrides = split_spec(spec_part)
    names = {}
    for role, candidates in HF_ROLE_FIELDS.items():
        found = next((c for c in candidates if isinstance(getattr(config, c, None), int)), None)
        if found is None and role in ("depth", "width", "heads"):
            raise SizeError(f"{text}: {type(config).__name__} has no {' or '.join(candidates)}: not a sizable family")
        names[role] = found
    base = {field_name: getattr(config, field_name) for field_name in names.values() if field_name}
    base["seq_len"] = workload.tokens_per_sample
    roles = Roles(seq="seq_len", **names)

    aliases = getattr(config, "attribute_map", {}) or {}

    def make_spec(values: dict) -> str:
        changed = {k: str(v) for k, v in values.items() if k != "seq_len" and v != base[k]}
        aliased = {aliases.get(k) for k in changed} - {None}  # GPT-2's n_layer is num_hidden_layers
        merged = {k: v for k, v in overrides.items() if k not in aliased}
        merged.update(changed)  # in place where the spec had the field: one shape, one spelling
        query = "&".join(f"{k}={v}" for k, v in merged.items())
        opts = [o for o in options if not o.startswith("seq_len=")] + [f"seq_len={values['seq_len']}"]
        return "hf:" + model + (f"?{query}" if query else "") + "".join(f"#{o}" for o in opts)

    return Family(name=text, base=base, roles=roles, make_spec=make_spec)


def load_family(name: str | Family) -> Family:
    """``--family``: a built-in decoder preset, optionally with overrides (``gpt2+dropout=0.0``), or
    an ``hf:`` model. Raises SizeError for anything else."""
    if isinstance(name, Family):
        return name
    from autofit.workloads.gpt import PRESETS

    if name.startswith("hf:"):
        return hf_family(name)
    if name.partition("+")[0] in PRESETS:
        return gpt_family(name)
    raise SizeError(f"unknown family {name!r}: expected a built-in decoder preset ({', '.join(PRESETS)}), "
                    "optionally with +field=value overrides, or hf:MODEL")


def parse_vary(items: list[str] | dict | None, family: Family) -> dict:
    """``["n_layer=4,8", "n_embd=256,512"]`` (or a mapping) as ``{field: [values]}``, checked.

    None gives the family's default grid. Raises SizeError naming the bad item.
    """
    if items is None or len(items) == 0:
        return family.default_vary()
    if isinstance(items, dict):
        items = [f"{k}={','.join(str(v) for v in vs)}" for k, vs in items.items()]
    out: dict = {}
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip()
        if not sep or not values.strip():
            raise SizeError(f"invalid --vary {item!r}: expected field=v1,v2,... e.g. {family.roles.depth}=4,8,12")
        if key not in family.fields:
            raise SizeError(f"invalid --vary field {key!r}: expected one of {', '.join(family.fields)}")
        try:
            parsed = [int(v) for v in values.split(",") if v.strip()]
        except ValueError:
            raise SizeError(f"invalid --vary {item!r}: values must be positive integers") from None
        if not parsed or min(parsed) < 1:
            raise SizeError(f"invalid --vary {item!r}: values must be positive integers")
        out[key] = sorted(set(parsed) | set(out.get(key, [])))
    return out


