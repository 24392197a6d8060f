"""autofit size: families, the scaled-profile shortcut against direct profiles, maximality, CLI."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from autofit.cli import main
from autofit.core.config import Precision, TrainConfig
from autofit.core.space import load_space
from autofit.estimator.memory_model import needs_split_ends
from autofit.estimator.memory_table import estimate_table
from autofit.estimator.time_model import op_counts, predict_table
from autofit.probes.device_rates import probe_rates
from autofit.profiling.profile import profile_workload
from autofit.sizing.family import SizeError, load_family, parse_vary
from autofit.sizing.scaling import lagrange_weights, shape_profiles
from autofit.sizing.size import pareto_frontier, size
from autofit.workloads.gpt import preset_from_spec
from autofit.workloads.load import load_workload

PRECISIONS = [Precision.FP32, Precision.AMP_BF16]
# Every structure the memory model distinguishes: accumulation, checkpointing, pipeline splits.
CONFIGS = [TrainConfig(p, mb, ga, ck, ds) for p in PRECISIONS for mb in (1, 4) for ga in (1, 3)
           for ck in (0, 1, 2) for ds in (1, 2, 3)]


def _direct(spec: str, optimizers=()):
    workload = load_workload(spec)
    return profile_workload(workload, PRECISIONS, optimizers=optimizers), op_counts(workload)


def _compare(family_spec: str, vary: dict, axes: list[str], check: list[dict], rtol: float = 0.01,
             configs=CONFIGS, optimizers=()) -> None:
    """Scaled profiles of ``check`` shapes against direct profiles: peaks, step times, parameters."""
    family = load_family(family_spec)
    shapes = [family.resolve(dict(zip(vary, combo))) for combo in itertools.product(*vary.values())]
    scaled, info = shape_profiles(family, shapes, axes, PRECISIONS, optimizers=optimizers)
    assert info["interpolated"] >= 1  # the shortcut was taken, not only direct profiles
    rates = probe_rates()
    for want in check:
        shape = family.resolve(want)
        sp = scaled[shapes.index(shape)]
        direct, counts = _direct(family.spec(shape), optimizers)
        assert sp.profile.param_count == direct.param_count
        got = estimate_table(sp.profile, configs)["peak_bytes"].to_numpy()
        ref = estimate_table(direct, configs)["peak_bytes"].to_numpy()
        ok = ~np.isnan(ref)
        np.testing.assert_allclose(got[ok], ref[ok], rtol=rtol, err_msg=family.spec(shape))
        got_t = predict_table(sp.profile, configs, rates, sp.counts)["step_time_s"].to_numpy()
        ref_t = predict_table(direct, configs, rates, counts)["step_time_s"].to_numpy()
        np.testing.assert_allclose(got_t[ok], ref_t[ok], rtol=rtol, err_msg=family.spec(shape))


def test_scaled_profiles_match_direct_profiles_across_width_and_depth():
    # widths 96..384 (heads follow at head size 48): anchors 96, 192, 384; 144 and 288 interpolated
    vary = {"n_layer": [1, 3], "n_embd": [96, 144, 192, 288, 384], "seq_len": [32]}
    _compare("gpt-tiny", vary, ["n_embd"], [{"n_layer": 3, "n_embd": 144, "seq_len": 32},
                                            {"n_layer": 3, "n_embd": 288, "seq_len": 32},
                                            {"n_layer": 3, "n_embd": 384, "seq_len": 32}])


def test_scaled_profiles_match_direct_profiles_with_the_lean_levers():
    # the optimizer lever's state and selective checkpointing's kept outputs scale with the shape too
    lean = [TrainConfig(p, mb, 1, ck, ds, optimizer=opt, checkpoint_policy=policy)
            for p in PRECISIONS for mb in (1, 4) for ck, policy in ((0, "full"), (1, "selective"), (2, "selective"))
            for ds in (1, 2) for opt in ("as-given", "adafactor", "adamw8bit")]
    vary = {"n_layer": [3], "n_embd": [96, 144, 192, 288, 384], "seq_len": [32]}
    _compare("gpt-tiny", vary, ["n_embd"], [{"n_layer": 3, "n_embd": 144, "seq_len": 32},
                                            {"n_layer": 3, "n_embd": 288, "seq_len": 32}],
             configs=lean, optimizers=("adafactor", "adamw8bit"))


def test_scaled_profiles_match_direct_profiles_across_sequence_length():
    # explicit attention with dropout keeps (T, T) scores and masks: terms quadratic in the sequence.
    # Which operator is highest at micro-batch 1 changes between the anchors here, so the interpolated
    # peak of one config (of 48) reads 1.4% over the direct profile's: 1.5%.
    vary = {"n_layer": [2], "seq_len": [16, 24, 32, 48, 64]}
    _compare("gpt-tiny+attention=plain,dropout=0.1,n_embd=96,n_head=2", vary, ["seq_len"],
             [{"n_layer": 2, "seq_len": 24}, {"n_layer": 2, "seq_len": 48}], rtol=0.015)


def test_lagrange_weights_reproduce_a_quadratic():
    anchors = [2.0, 5.0, 11.0]
    f = lambda x: 3 * x * x - 7 * x + 1  # noqa: E731
    assert float(lagrange_weights(anchors, 7.0) @ np.array([f(a) for a in anchors])) == pytest.approx(f(7.0))


GRID = {"n_layer": [1, 2, 3, 4, 6, 8, 12], "n_embd": [96, 144, 192, 288, 384]}


@pytest.fixture(scope="module")
def tiny_result():
    return size("gpt-tiny", "90MB", vary=GRID, space="tiny")


def test_answer_is_maximal_by_direct_estimate(tiny_result):
    """The answer fits, and the next larger shape along each varied field fits in no config of the
    space -- both checked on direct profiles of the full models, not on the shortcut."""
    top = tiny_result.top
    assert top is not None
    space = [c for c in load_space("tiny").configs() if c.device_split <= tiny_result.devices]
    family = load_family("gpt-tiny")

    def fits_any(spec: str) -> bool:
        profile = profile_workload(load_workload(spec), PRECISIONS, split_ends=needs_split_ends(space))
        table = estimate_table(profile, space, tiny_result.budget_bytes)
        return bool((table["valid"] & table["fits"].astype(bool)).any())

    assert fits_any(top["spec"])
    larger = []
    for name, values in GRID.items():
        bigger = [v for v in values if v > top[name]]
        if bigger:
            shape = family.resolve({**{f: top[f] for f in GRID}, name: bigger[0]})
            larger.append(family.spec(shape))
    assert len(larger) == 2, "the answer should be inside the grid along both fields for this budget"
    for spec in larger:
        assert not fits_any(spec), spec


def test_table_frontier_and_json(tiny_result):
    table = tiny_result.table
    fits = table[table["fits"]]
    assert len(fits) and (~table["fits"]).any()  # the budget splits the grid
    assert (fits["peak_bytes"] <= tiny_result.budget_bytes).all()
    assert tiny_result.top["param_count"] == fits["param_count"].max()
    front = tiny_result.frontier.sort_values("param_count")
    assert front["tokens_per_s"].is_monotonic_decreasing  # more parameters, less throughput along it
    data = json.loads(json.dumps(tiny_result.to_dict()))
    assert data["top"]["config"]["precision"] in ("fp32", "amp-bf16")
    assert isinstance(data["top"]["peak_bytes"], int) and isinstance(data["top"]["param_count"], int)
    assert len(data["shapes"]) == 35 and data["timing"]["configs_scored"] == 35 * len(load_space("tiny").configs())


def test_min_tokens_per_s_lowers_the_answer(tiny_result):
    fits = tiny_result.table[tiny_result.table["fits"]]
    floor = float(fits["tokens_per_s"].median())
    slower = size("gpt-tiny", "90MB", vary=GRID, space="tiny", min_tokens_per_s=floor)
    assert slower.top["tokens_per_s"] >= floor
    assert slower.top["param_count"] < tiny_result.top["param_count"]


def test_pareto_frontier():
    params = np.array([10, 8, 8, 5, 3, 12])
    speed = np.array([1.0, 3.0, 2.0, 2.5, 4.0, 9.0])
    fits = np.array([True, True, True, True, True, False])
    assert pareto_frontier(params, speed, fits).tolist() == [True, True, False, False, True, False]


def test_confirm_runs_a_real_trial_under_the_budget():
    result = size("gpt-tiny", "40MB", vary={"n_layer": [1, 2], "n_embd": [96]}, space="tiny", confirm=1,
                  trial_timeout_s=120)
    row = result.table.iloc[0]
    assert row["measured_status"] == "ok", row["measured_note"]
    assert 0 < row["measured_peak_bytes"] <= result.budget_bytes
    assert result.table["measured_status"].notna().sum() == 1


def test_confirm_says_why_it_cannot_run_a_shape():
    # about 10B parameters: 160 GB of fp32 training state, more RAM than a test machine has free
    result = size("gpt2", "1000GB", vary={"n_layer": [48], "n_embd": [4096]}, space="tiny", confirm=1)
    row = result.table.iloc[0]
    assert row["fits"] and row["measured_status"] is None
    assert row["measured_note"].startswith("not run: needs about") and "of RAM" in row["measured_note"]


def test_family_specs_load_the_shape_they_name():
    family = load_family("llama-1b")
    shape = family.resolve({"n_layer": 2, "n_embd": 1024})
    meta = load_workload(family.spec(shape)).meta
    assert (meta["n_layer"], meta["n_embd"], meta["n_head"], meta["n_kv_head"], meta["ffn_hidden"]) == (2, 1024, 16, 4,
                                                                                                       4096)
    assert preset_from_spec("gpt2+dropout=0.0,n_layer=2").meta["dropout"] == 0.0


@pytest.mark.parametrize("argv, message", [
    (["--family", "nope"], "unknown family 'nope'"),
    (["--family", "gpt-tiny", "--vary", "depth=4"], "invalid --vary field 'depth'"),
    (["--family", "gpt-tiny", "--vary", "n_layer=a,2"], "values must be positive integers"),
    (["--family", "gpt-tiny", "--vary", "n_layer"], "expected field=v1,v2"),
    (["--family", "gpt-tiny", "--vary", "n_embd=100"], "no valid shape in the grid"),
    (["--family", "gpt-tiny+n_layr=2"], "invalid override 'n_layr=2'"),
    (["--family", "gpt-tiny", "--budget", "8 parsecs"], "budget"),
])
def test_cli_errors_are_one_line(capsys, argv, message):
    argv = ["size", *argv] + ([] if "--budget" in argv else ["--budget", "1GB"])
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_parse_vary_defaults_and_merges():
    family = load_family("gpt2")
    default = parse_vary(None, family)
    assert set(default) == {"n_layer", "n_embd"} and 768 in default["n_embd"]
    assert parse_vary(["n_layer=4,2", "n_layer=8"], family) == {"n_layer": [2, 4, 8]}
    with pytest.raises(SizeError):
        parse_vary(["n_layer=0"], family)


def test_cli_json_and_out(tmp_path, capsys):
    out = tmp_path / "size"
    code = main(["size", "--family", "gpt-tiny", "--budget", "40MB", "--vary", "n_layer=1,2", "--vary",
                 "n_embd=96,192", "--space", "tiny", "--json", "--out", str(out)])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["top"]["spec"].startswith("gpt-tiny")
    assert json.loads((out / "size.json").read_text())["top"] == data["top"]
    assert (out / "shapes.csv").read_text().count("\n") == 5
    summary = (out / "summary.md").read_text()
    assert "answer: " in summary and summary.startswith("# autofit size --family gpt-tiny --budget 40MB --vary n_layer=1,2")
    pytest.importorskip("matplotlib")
    assert (out / "frontier.png").stat().st_size > 0


def test_hf_family_scales_like_its_direct_profiles():
    pytest.importorskip("transformers")
    spec = ("hf:llama?num_hidden_layers=1&hidden_size=64&intermediate_size=128&num_attention_heads=2"
            "&num_key_value_heads=1&vocab_size=512#seq_len=32")
    family = load_family(spec)
    assert family.roles.depth == "num_hidden_layers" and family.base["seq_len"] == 32
    _compare(spec, {"num_hidden_layers": [2], "hidden_size": [64, 128, 192, 256]}, ["hidden_size"],
             [{"num_hidden_layers": 2, "hidden_size": 128}], rtol=0.02)  # measured: 1.3% on one config


def test_anchors_whose_real_check_notes_differ_still_interpolate(monkeypatch):
    """The real-step note is words with numbers in them (e.g. "the step needs 61 MiB, over ..."),
    which differ between anchors: only numbers are interpolated, so the notes must not stop it."""
    import dataclasses

    import autofit.sizing.scaling as scaling

    original = scaling._profile_base
    calls = []

    def noted(*args, **kwargs):
        base = original(*args, **kwargs)
        calls.append(1)
        note = f"anchor {len(calls)}: the step needs {len(calls)} MiB"
        return dataclasses.replace(base, precisions={k: dataclasses.replace(v, real_check=note)
                                                     for k, v in base.precisions.items()})

    monkeypatch.setattr(scaling, "_profile_base", noted)
    family = load_family("gpt-tiny")
    shapes = [family.resolve({"n_layer": 2, "n_embd": e, "seq_len": 32}) for e in (96, 144, 192, 384)]
    scaled, info = shape_profiles(family, shapes, ["n_embd"], PRECISIONS)  # raised SizeError before
    assert info["interpolated"] >= 1 and len(calls) >= 3
    assert all(sp is not None and sp.profile.param_count > 0 for sp in scaled)


def test_anchors_keep_only_the_optimizer_choices_asked_for():
    """A cached one-layer profile may hold optimizer choices another command profiled: an anchor
    keeps only those asked for, so anchors read from the cache and anchors traced now interpolate."""
    import dataclasses

    from autofit.sizing.scaling import _only_options

    @dataclasses.dataclass(frozen=True)
    class Option:
        choice: str

    @dataclasses.dataclass(frozen=True)
    class Precision:
        optimizer_options: tuple = ()

    cached = Precision((Option("adafactor"), Option("adamw8bit")))
    assert _only_options(cached, ()).optimizer_options == ()
    assert _only_options(cached, ("adamw8bit",)).optimizer_options == (Option("adamw8bit"),)
    assert _only_options(Precision(), ("adafactor",)) == Precision()


def test_one_device_profiles_no_split_ends_and_anchors_from_the_cache_drop_theirs(monkeypatch, tmp_path):
    """On one device no config splits: a tied family's untied ends (a third more profiling per anchor) are
    not traced, and an anchor whose cached profile holds them drops them, so anchors interpolate alike."""
    import dataclasses

    from autofit.profiling import precision as profile_module
    from autofit.sizing.scaling import _without_ends

    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path))
    ends = []
    traced = profile_module.profile_split_ends
    monkeypatch.setattr(profile_module, "profile_split_ends", lambda *a, **k: ends.append(1) or traced(*a, **k))
    result = size("gpt-tiny", "90MB", vary={"n_layer": [2, 4], "n_embd": [96, 192]}, space="tiny", devices=1)
    assert ends == [] and result.top is not None
    with_ends = profile_workload(load_workload("gpt-tiny+n_layer=1"), ["fp32"]).for_precision("fp32")
    assert with_ends.split_ends is not None
    assert _without_ends(with_ends) == dataclasses.replace(with_ends, split_ends=None, split_ends_skipped=True)
