"""autofit.runtime.ranks: combining per-rank results, the failure vocabulary, parameters as .npz (no processes)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from autofit.core.errors import ConfigError
from autofit.runtime.ranks import (
    combine_results,
    is_peer_failure,
    load_tensors,
    record_failure,
    root_cause,
    save_tensors,
)


def _ok(rank: int, peak: int, step_s: float) -> dict:
    return {"rank": rank, "status": "ok", "peak_bytes": peak, "breakdown": {"params_bytes": peak}, "step_time_s": step_s}


def test_combine_takes_the_largest_peak_and_the_slowest_rank():
    combined, ordered = combine_results([_ok(1, 300, 0.5), _ok(0, 200, 0.7)], 2, "rank")
    assert combined["per_device_peak_bytes"] == [200, 300] and combined["peak_bytes"] == 300
    assert combined["breakdown"] == {"params_bytes": 300} and combined["step_time_s"] == 0.7
    assert [r["rank"] for r in ordered] == [0, 1]


def test_combine_reports_the_cause_not_a_peers_echo():
    echo = {"rank": 0, "status": "error", "error": "rank 0: connection closed", "peer_failed": True}
    cause = {"rank": 1, "status": "error", "error": "rank 1: ValueError: bad", "peer_failed": False}
    oom = {"rank": 2, "status": "oom", "error": "rank 2: over", "peer_failed": True}
    combined, ordered = combine_results([echo, cause, _ok(3, 1, 1.0)], 4, "rank")
    assert (combined["status"], combined["error"], ordered) == ("error", "rank 1: ValueError: bad", None)
    combined, _ = combine_results([echo, cause, oom], 3, "rank")
    assert (combined["status"], combined["error"]) == ("oom", "rank 2: over")
    combined, _ = combine_results([_ok(0, 1, 1.0)], 3, "stage")
    assert (combined["status"], combined["error"]) == ("error", "stage(s) [1, 2] returned no result")


def test_failures_name_the_origin_and_the_kind():
    try:
        try:
            raise ConfigError("device_split 5 for 4 layers")
        except ConfigError as inner:
            raise RuntimeError("[Stage 0] failed to run forward") from inner
    except RuntimeError as exc:
        assert isinstance(root_cause(exc), ConfigError)
        result = {"rank": 0}
        record_failure(result, exc, label="stage", tracker=None, budget_bytes=None)
    assert result["status"] == "error" and result["error"] == "stage 0: ConfigError: device_split 5 for 4 layers"
    assert result["peer_failed"] is False and "Traceback" in result["traceback"]
    assert is_peer_failure(RuntimeError("Connection reset by peer")) and is_peer_failure(dist.DistError("x"))


def test_an_over_budget_tracker_makes_it_oom():
    class Exceeded:
        exceeded_bytes = 1234

    result = {"rank": 1}
    record_failure(result, RuntimeError("wrapped"), label="rank", tracker=Exceeded(), budget_bytes=1000)
    assert result["status"] == "oom"
    assert result["error"] == "rank 1: live tensor bytes reached 1234 (over the budget of 1000 bytes)"


def test_tensors_round_trip_exactly_in_their_dtypes(tmp_path):
    named = {"a.weight": torch.randn(3, 4), "b.bias": torch.randn(5).to(torch.bfloat16),
             "c": torch.randn(2, 2).half()}
    save_tensors(named, tmp_path / "p.npz")
    back = load_tensors(tmp_path / "p.npz")
    assert back.keys() == named.keys()
    for name, tensor in named.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor)
