"""autofit's own search, as shipped, as one of the suite's strategies (beside the peers of
:mod:`autofit.bench.strategies`)."""

from __future__ import annotations

from autofit.bench.problem import Oracle, Problem
from autofit.bench.strategies import PEERS, Criterion, Strategy
from autofit.bench.verdict import AUTOFIT_NAME
from autofit.core.config import TrainConfig


class NotAvailable(Exception):
    """A strategy that cannot run in this checkout (e.g. autofit's search before it lands)."""


def autofit_search(problem: Problem, oracle: Oracle, seed: int = 0, first_use_s: float = 0.0) -> TrainConfig | None:
    """autofit's search (:func:`autofit.api.run_study.search`, defaults as shipped) over the problem's grid.

    Its trials go through ``oracle`` (passed to the search as its ``trial_runner``), so a live oracle runs them for real and a replay oracle answers from the grid; everything else --
    estimate, time model, calibration, Optuna storage, reports -- runs for real and is timed.
    ``first_use_s`` is charged to the clock: profiling the workload on fake tensors and probing
    the device with cold caches, measured once per workload (the runs themselves find both cached).
    """
    import tempfile

    from autofit.api.run_study import search
    from autofit.core.space import SearchSpace
    from autofit.trial.run import TrialResult

    def result_of(outcome, device, budget_bytes):
        if outcome.result is not None:
            return outcome.result
        return TrialResult(workload=problem.workload, config=outcome.config, device=device, status=outcome.status,
                           peak_bytes=outcome.peak_bytes,
                           per_device_peak_bytes=[outcome.peak_bytes] if outcome.peak_bytes else [],
                           samples_per_s=outcome.samples_per_s, step_time_s=outcome.step_time_s if outcome.ok else None,
                           wall_s=outcome.cost_s, budget_bytes=budget_bytes,
                           error=None if outcome.ok else f"{outcome.status} (replayed from the measured grid)")

    def run_trial(workload, config, *, device, budget_bytes, timeout_s, memory=True):
        return result_of(oracle.run(config, memory), device, budget_bytes)

    if first_use_s:
        oracle.charge(first_use_s, "cold profile and device probe")
    space = SearchSpace(precision=problem.precisions, micro_batch=problem.micro_batches,
                        checkpoint_every=problem.checkpoints, device_split=problem.device_splits,
                        split_mode=problem.split_modes, optimizer=problem.optimizers,
                        checkpoint_policy=problem.checkpoint_policies, global_batch=problem.global_batch)
    with tempfile.TemporaryDirectory(prefix="autofit-bench-study-") as out:
        # devices: the grid's largest split (its stages or ranks are processes sharing this CPU)
        result = search(problem.workload, problem.budget_bytes, space=space, out_dir=out, device=problem.device,
                        seed=seed, devices=max(problem.device_splits), trial_runner=run_trial)
        oracle.answers = answers_after_each_trial(out, len(oracle.history))
    stop = getattr(result, "stop_reason", None)
    if stop:
        oracle.notes.append(f"stopped: {stop}")
    return result.best


def answers_after_each_trial(out_dir: str, n_trials: int) -> list[TrainConfig | None] | None:
    """autofit's answer after each of its real trials, as its report would give it then
    (:func:`autofit.core.records.best_of` of the study's real trials up to that one, a head-to-head's order
    included), in the order the oracle ran them; None when the study's real trials are not the oracle's."""
    from autofit.core.records import best_of
    from autofit.study.storage import load_snapshot

    real = sorted((r for r in load_snapshot(out_dir).records if r.status.ran), key=lambda r: r.number)
    if len(real) != n_trials:
        return None
    return [None if (best := best_of(real[: i + 1])) is None else best.config for i in range(len(real))]


AUTOFIT = Strategy(AUTOFIT_NAME, autofit_search, Criterion.THROUGHPUT, False,
                   "autofit's search as shipped: estimate prunes, time model orders, real trials confirm")
STRATEGIES: tuple[Strategy, ...] = (AUTOFIT,) + PEERS
