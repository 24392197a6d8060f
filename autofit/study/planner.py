"""The planner: pure policy. Trial records in, decisions out (what to prune and why, what to run, when to stop).

It scores the whole space once (memory estimate and time model), then at every planning step
reads the study's :class:`autofit.core.records.TrialRecord` values; it never touches the storage
(see :mod:`autofit.study` for the rules it applies).
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autofit.core.budget import format_bytes
from autofit.core.config import (
    FIELDS,
    CheckpointPolicy,
    SplitMode,
    TrainConfig,
    stage_bounds,
)
from autofit.core.objective import objective
from autofit.core.records import (
    PruneReason,
    TrialRecord,
    TrialStatus,
    best_of,
    config_samples,
)
from autofit.estimator.calibration import Calibration, calibrate, observations
from autofit.estimator.memory_table import BREAKDOWN, ENDS_NOT_PROFILED, estimate_table
from autofit.estimator.time_model import OpCounts, predict_table
from autofit.probes.device_rates import DeviceRates
from autofit.profiling.data import Profile
from autofit.runtime.schedule import DEFAULT_SCHEDULE, MeasureSchedule
from autofit.study.leaders import remeasurements
from autofit.study.settings import StudySettings

# --- the rules' constants ---------------------------------------------------------------------
SLOW_FACTOR = 20.0         # pruned: predicted this many times slower than the best predicted
TIE = 0.01                 # predictions this close are a tie: the cheaper trial runs first
BOUND = 0.5                # stop: the best candidate is predicted below this fraction of the best measured
MIN_TRIAL_TIMEOUT_S = 60.0
TRIAL_TIMEOUT_FACTOR = 4.0  # a trial may take this many times its (calibrated) prediction
TRIAL_STARTUP_S = 8.0      # interpreter start + imports of a trial child (and of each extra stage)
TIME_MARGIN_MIN = 0.10     # the time model's error margin is never taken below two samples' median spread
# For configs no trial vouches for (another precision or layout, or the other side of checkpointing),
# the margin is the calibrated model's error measured on such configs (each kind's first trial, planned
# from the others' calibration), never below this: on the committed CPU grids the prior's bias between
# two precisions (ratio of their median measured/predicted step times) was at most 1.20x
# (results/benchmarks/accuracy_prior.csv, the workload's own layer).
CROSS_MARGIN_MIN = 0.3
# Before any such trial the error across kinds is unmeasured: a kind is then still ruled out when, even
# 10x faster than its calibrated prediction, it would not beat the best measured. That is over 8x the
# worst bias between two precisions seen (1.23x on the committed grids, 1.49x on an AVX2 CPU whose bf16
# runs ~20x slower than fp32, docs/facts.md#time-model-prior-bias), and a trial of such a kind takes over
# ten times the best's.
CROSS_MARGIN_PRIOR = 9.0
REMEASURE_RESERVE = 4      # with a trial limit, exploration leaves up to 1/this of it for them
# A trial runs DEFAULT_SCHEDULE (autofit.runtime.schedule); its time limit is sized from that schedule.


class StopReason(enum.Enum):
    """Why exploration stops (:meth:`Planner._stop`); a :class:`Step` says it in words too (``stop``)."""

    TIMEOUT = "timeout"          # no trial starts after the time limit
    EXHAUSTED = "exhausted"      # every config of the space ran or was pruned
    TRIAL_LIMIT = "trial limit"  # the real trials allowed (less those left to re-measure) have run
    PATIENCE = "patience"        # real trials in a row without improving the best
    BOUND = "bound"              # the best remaining config is predicted well under the best measured


@dataclass(frozen=True)
class Prune:
    """A config to record as pruned: its index in :attr:`Planner.configs`, why, and its predictions."""

    index: int
    reason: PruneReason
    text: str
    prediction: dict


@dataclass(frozen=True)
class Step:
    """One planning step: prunes to record, then the config to run (``run`` None: stop, with
    ``stop_reason`` and ``stop``, the reason in words) and which measurement of it that is (``sample``)."""

    prunes: list[Prune]
    run: int | None
    prediction: dict | None
    stop: str | None
    calibration: Calibration
    sample: int = 1            # 1: the config's first trial; more: a re-measurement of a top config
    stop_reason: StopReason | None = None


def _remeasured_text(records: Sequence[TrialRecord], reason: StopReason) -> str:
    """What the stop line adds about the re-measurements of the leaders that ran (empty when none did):
    within the trial limit they are part of its count; otherwise they ran after the rule held."""
    extra = sum(r.sample > 1 and r.status.ran for r in records)
    if not extra:
        return ""
    if reason is StopReason.TRIAL_LIMIT:
        return f", {extra} of them {'a re-measurement' if extra == 1 else 're-measurements'} of the leaders"
    return f"; then {extra} {'re-measurement' if extra == 1 else 're-measurements'} of the leaders"


def calibration_group(config: TrainConfig) -> tuple:
    """What one trial's calibration of the time model vouches for: its precision on its layout (one
    device, or a split of that many devices in that mode). Across precisions the prior's error
    differs up to 2x on a CPU; across layouts too, since each has costs of its own that the prior
    estimates apart (a pipeline's bubble and sends, FSDP's gathers and reductions: on the committed
    gpt-tiny grid the prior was 55% fast for FSDP and 13% fast for a pipeline of the same model)."""
    layout = (1, None) if config.device_split == 1 else (config.device_split, config.split_mode)
    return (config.precision, *layout)


def vouch_key(config: TrainConfig) -> tuple:
    """What a trial's calibration vouches for within the time model's margin: its calibration
    group and whether it recomputes (checkpointing's cost is one shared term of the calibration,
    fitted from whichever side ran: a checkpointed trial says little about the same precision
    without it; on the committed convnet-bn grid one did, and ruled out the optimum), which policy it
    checkpoints with (selective recomputes less), with which optimizer (the lever's own step) and where
    that optimizer steps (an offloaded one on the host, after copying the gradients there)."""
    return (*calibration_group(config), config.checkpoint_every > 0, config.checkpoint_policy, config.optimizer,
            config.offload)


def group_name(group: tuple) -> str:
    """``bf16`` (one device), ``bf16 split=2`` (a pipeline) or ``bf16 fsdp=2``."""
    precision, split, mode = group
    if split == 1:
        return precision.value
    return f"{precision.value} {'fsdp' if mode is SplitMode.FSDP else 'split'}={split}"


def time_margin(records: Sequence[TrialRecord]) -> float | None:
    """The calibrated time model's measured error within a calibration group (precision and layout,
    :func:`calibration_group`): the largest relative error of the step time predicted for an ok
    trial whose group had already run ok when it was planned (predicted before it ran, so out of
    sample), at least TIME_MARGIN_MIN. None until there is one (a group's first trial shows the
    prior's error, which its calibration then corrects)."""
    ok = sorted((r for r in records if r.feasible and r.errors.get("step_time") is not None), key=lambda r: r.number)
    seen: set = set()
    within = []
    for r in ok:
        if calibration_group(r.config) in seen:
            within.append(abs(r.errors["step_time"]))
        seen.add(calibration_group(r.config))
    return max([TIME_MARGIN_MIN] + within) if within else None


def cross_margin(records: Sequence[TrialRecord]) -> float | None:
    """The calibrated time model's measured error for configs no trial vouches for yet
    (:func:`vouch_key`): the largest relative error of the step time predicted for an ok trial
    that was the first of its kind while another kind had run ok (so predicted across kinds, out of
    sample), at least CROSS_MARGIN_MIN. None until there is one: the first trial of a study shows
    only the uncalibrated prior's error, not how a calibration carries across kinds."""
    ok = sorted((r for r in records if r.feasible and r.errors.get("step_time") is not None), key=lambda r: r.number)
    seen: set = set()
    across = []
    for r in ok:
        key = vouch_key(r.config)
        if seen and key not in seen:
            across.append(abs(r.errors["step_time"]))
        seen.add(key)
    return max([CROSS_MARGIN_MIN] + across) if across else None


def _may_dominate(a: TrainConfig, b: TrainConfig) -> bool:
    """Whether ``a`` may dominate ``b`` on its predicted time: ``a`` does not checkpoint, or checkpoints by
    the same policy (then fewer recomputed layers are never slower). Selective against full is not a matter
    of recomputing less: selective's saved-tensor policy costs a dispatch per operator, which the time model
    does not price, and at 1024 tokens on the bench's CPU full checkpointing measured as fast or faster
    (docs/benchmarks.md); the time rules, with their margins, judge that pair instead."""
    return a.checkpoint_every == 0 or a.checkpoint_policy is b.checkpoint_policy


def _margin_name(m: float, within: float | None, cross: float | None = None) -> str:
    if m == within:
        return "the time model's measured error"
    if cross is None:
        return "the widest error across precisions, layouts and checkpointing allowed before it is measured"
    return "the time model's measured error across precisions, layouts and checkpointing"


class Planner:
    """Scores the whole space once (estimate + time model), then plans each step from the records."""

    def __init__(self, settings: StudySettings, profile: Profile, rates: DeviceRates,
                 counts: OpCounts | None = None, schedule: MeasureSchedule = DEFAULT_SCHEDULE) -> None:
        self.settings = settings
        self.schedule = schedule  # what each trial runs: its time limit is sized from it
        space = settings.search_space()
        self.configs = space.configs()
        self.index = {c: i for i, c in enumerate(self.configs)}
        # On CUDA the probe child measured the card's context and cuBLAS workspace (None: the fallbacks).
        # A pipeline split over more devices than a worker has is estimated from split ends only where the
        # search profiled them (autofit.estimator.memory_model.needs_split_ends): else it is left unestimated.
        mem = estimate_table(profile, self.configs, settings.budget_bytes, overhead=rates.memory_overhead(),
                             unprofiled_ends_invalid=True)
        times = predict_table(profile, self.configs, rates, counts)
        self.table = mem.join(times.drop(columns=list(FIELDS)))
        # trial_seconds runs for every config at every step: columns as arrays, not a row lookup each
        self._times = {k: self.table[k].to_numpy(dtype=np.float64)
                       for k in ("step_time_s", "micro_step_time_s", "optimizer_step_time_s")}
        self.n_layers = profile.n_layers
        self._groups = [calibration_group(c) for c in self.configs]  # read at every step
        self._keys = [vouch_key(c) for c in self.configs]
        self._static = self._static_reasons()
        rng = np.random.default_rng(settings.seed)
        self._tiebreak = rng.permutation(len(self.configs))  # seeded order among equal predictions

    # Reasons that do not depend on any measurement.
    def _static_reasons(self) -> list[tuple[PruneReason, str] | None]:
        out: list[tuple[PruneReason, str] | None] = [None] * len(self.configs)
        devices = self.settings.devices
        ckpts = sorted({c.checkpoint_every for c in self.configs})
        for i, (c, row) in enumerate(zip(self.configs, self.table.itertuples())):
            unprofiled = not row.valid and row.reason == ENDS_NOT_PROFILED
            if not row.valid and not (unprofiled and c.device_split > devices):
                out[i] = (PruneReason.INVALID, f"cannot run: {row.reason}")
            elif c.device_split > devices:
                out[i] = (PruneReason.DEVICES, f"device_split {c.device_split} needs {c.device_split} devices; a "
                                               f"worker has {devices} ({self.settings.device_type}); "
                                               + (row.reason if unprofiled else "estimated only"))
            else:
                longest = (self.n_layers if c.data_parallel > 1  # FSDP ranks each run every layer
                           else max(e - s for s, e in stage_bounds(self.n_layers, c.device_split)))
                if c.checkpoint_every > longest:
                    same = [k for k in ckpts if longest <= k < c.checkpoint_every]
                    if same:
                        out[i] = (PruneReason.DUPLICATE, f"checkpoint_every {c.checkpoint_every} >= the {longest} "
                                                         f"layers of a stage is one segment per stage, as "
                                                         f"checkpoint_every {min(same)}")
        return out

    def prediction(self, i: int, calibration: Calibration, ratio: float | None = None) -> dict:
        """What the trial record keeps of config ``i``'s predictions (raw and calibrated).
        ``ratio``: its calibrated time ratio, when already computed."""
        row = self.table.iloc[i]
        if ratio is None:
            ratio = float(calibration.time_ratios(self.table.iloc[[i]])[0])
        step = float(row["step_time_s"]) if math.isfinite(row["step_time_s"]) else None
        out = {
            "peak_bytes": None if not math.isfinite(row["peak_bytes"]) else int(round(row["peak_bytes"])),
            "per_device_peak_bytes": [int(b) for b in row["per_device_peak_bytes"]],
            "peak_phase": row["peak_phase"],
            **{k: None if not math.isfinite(row[k]) else int(round(row[k])) for k in BREAKDOWN},
            "calibrated_peak_bytes": None if not math.isfinite(row["peak_bytes"])
            else int(round(calibration.corrected_peak(row["peak_bytes"]))),
            "peak_factor": calibration.peak_factor,
            "prior_step_time_s": step,
            "step_time_s": None if step is None else step * ratio,
            "samples_per_s": None if step is None else self.configs[i].samples_per_step / (step * ratio),
        }
        out["objective"] = None if step is None else objective(self.configs[i], out["samples_per_s"],
                                                               self.settings.devices)
        out["trial_timeout_s"] = self._trial_timeout(i, ratio)
        return out

    def trial_seconds(self, i: int, ratio: float) -> float:
        """Predicted wall time of a trial of config ``i``: process starts, tracked and timed steps."""
        c, times = self.configs[i], self._times
        if c.device_split > 1:  # the pipeline runs every micro-batch of a step
            step = times["step_time_s"][i] * ratio
        else:
            micro_steps = self.schedule.micro_steps(c.grad_accum)
            step = (micro_steps * times["micro_step_time_s"][i] + times["optimizer_step_time_s"][i]) * ratio
        return TRIAL_STARTUP_S * c.device_split + self.schedule.step_equivalents() * step

    def _trial_timeout(self, i: int, ratio: float) -> float:
        seconds = self.trial_seconds(i, ratio)
        if not math.isfinite(seconds):
            return self.settings.trial_timeout_s
        return float(min(self.settings.trial_timeout_s, max(MIN_TRIAL_TIMEOUT_S, TRIAL_TIMEOUT_FACTOR * seconds)))

    def step(self, records: Sequence[TrialRecord], now: float | None = None) -> Step:
        """Plan from the study's records: what to prune, what to run next, or why to stop."""
        settings = self.settings
        n = len(self.configs)
        calibration = calibrate(observations(list(records), settings.budget_bytes), settings.device_type)
        claimed = np.zeros(n, dtype=bool)      # a real trial finished or is running
        failed_run = np.zeros(n, dtype=bool)   # ran and did not come back ok under the budget
        measured_step = np.full(n, np.nan)     # measured step time of configs that ran ok
        pruned_before = np.zeros(n, dtype=bool)
        finished = [r for r in records if r.status.ran]
        running = sum(r.status is TrialStatus.RUNNING for r in records)
        for r in records:
            i = self.index.get(r.config)
            if i is None:
                continue
            claimed[i] |= r.claimed
            pruned_before[i] |= r.status is TrialStatus.PRUNED
            if r.status.ran:
                failed_run[i] |= not r.feasible
                if r.feasible and r.measurement.get("step_time_s"):
                    measured_step[i] = r.measurement["step_time_s"]
        ours = [r for r in records if r.config in self.index]
        by_config = config_samples(ours)
        # The bar is the answer's figure (a config's best sample, since load only ever slows a trial down).
        answer = best_of(ours)
        best_median = None if answer is None else answer.value
        # Calibrated predictions.
        peak = self.table["peak_bytes"].to_numpy(dtype=np.float64)
        ratio = calibration.time_ratios(self.table)
        step_s = self.table["step_time_s"].to_numpy(dtype=np.float64) * ratio
        # the objective (autofit.core.objective): job samples/s on the worker's devices, replicas included
        samples = np.array([objective(c, c.samples_per_step, settings.devices) for c in self.configs], dtype=np.float64)
        sps = samples / step_s
        fits = np.nan_to_num(np.asarray(calibration.fits(peak, settings.budget_bytes), dtype=bool), nan=False)
        reasons = self._reasons(peak, sps, ratio, fits, calibration)
        cross = cross_margin(records)
        self._slow_precisions(reasons, sps, claimed, ~np.isnan(measured_step), best_median, time_margin(records),
                              cross)
        # Times are compared on one basis, the calibrated predictions (a measured time against a
        # sibling's prediction would let noise decide); a config that ran ok is known to fit.
        known = ~np.isnan(measured_step)
        vouched = {self._keys[i] for i in np.flatnonzero(known)}
        self._dominance(reasons, step_s, np.where(known, 0.0, peak), failed_run)
        # Prunes: every prunable config that has no trial yet (ran configs keep their result).
        prunes = [Prune(i, reasons[i][0], reasons[i][1], self.prediction(i, calibration, float(ratio[i])))
                  for i in range(n) if reasons[i] is not None and not claimed[i] and not pruned_before[i]]
        candidates = [i for i in range(n) if reasons[i] is None and not claimed[i]]
        predicted = {c: float(sps[self.index[c]]) for c in by_config if math.isfinite(sps[self.index[c]])}
        remeasure = remeasurements(records, by_config, self.index, predicted, settings.min_improvement)
        reserve = 0 if settings.trials is None else min(len(remeasure), settings.trials // REMEASURE_RESERVE)
        # The bound rules out what is left on the prediction alone: not a kind no trial vouches for
        # before the model's error across kinds is measured (then _slow_precisions judges it).
        unmeasured = cross is None and any(self._keys[i] not in vouched for i in candidates)
        stopped = self._stop(candidates, finished, running, sps, now, None if unmeasured else best_median, reserve)
        if stopped is None:
            chosen = self._choose(candidates, sps, ratio, records)
            return Step(prunes, chosen, self.prediction(chosen, calibration, float(ratio[chosen])), None, calibration)
        under_limit = settings.trials is None or len(finished) + running < settings.trials
        stop_reason, stop = stopped
        if remeasure and under_limit and stop_reason is not StopReason.TIMEOUT:
            i, sample = remeasure[0]
            return Step(prunes, i, self.prediction(i, calibration, float(ratio[i])), None, calibration, sample)
        return Step(prunes, None, None, stop + _remeasured_text(records, stop_reason), calibration,
                    stop_reason=stop_reason)

    def _reasons(self, peak, sps, ratio, fits, calibration) -> list[tuple[PruneReason, str] | None]:
        """The static reasons, then over budget, then too slow (against the best predicted that fits)."""
        settings = self.settings
        reasons = list(self._static)
        for i in range(len(reasons)):
            if reasons[i] is None and not fits[i]:
                reasons[i] = (PruneReason.OVER_BUDGET,
                              f"predicted peak {format_bytes(peak[i] * calibration.peak_ratio)} "
                              f"(x{1 + calibration.peak_margin:.2f} safety margin) over the budget of "
                              f"{format_bytes(settings.budget_bytes)}")
        runnable = np.array([r is None for r in reasons])
        best_predicted = float(np.nanmax(sps[runnable])) if runnable.any() else math.nan
        for i in range(len(reasons)):
            if reasons[i] is not None:
                continue
            seconds = self.trial_seconds(i, ratio[i])
            if sps[i] < best_predicted / SLOW_FACTOR:
                reasons[i] = (PruneReason.TOO_SLOW, f"predicted {sps[i]:.3g} samples/s, under 1/{SLOW_FACTOR:g} of "
                                                    f"the best predicted {best_predicted:.3g} samples/s")
            elif seconds > settings.trial_timeout_s:
                reasons[i] = (PruneReason.TOO_SLOW, f"a trial is predicted to take {seconds:.0f} s, over the "
                                                    f"{settings.trial_timeout_s:.0f} s trial limit")
        return reasons

    def _slow_precisions(self, reasons, sps, claimed, ran_ok, best_median: float | None,
                         margin: float | None, cross: float | None) -> None:
        """Prune every config left of a calibration group (precision and layout,
        :func:`calibration_group`) whose best calibrated prediction, raised by the time model's
        measured error, does not beat the best measured median by the study's ``min_improvement``;
        else, config by config, those that cannot. The error: ``margin`` (within a group,
        :func:`time_margin`) for a config a trial that ran ok (``ran_ok``: per config) vouches for
        (:func:`vouch_key`), ``cross`` (:func:`cross_margin`; None: not measured yet, then
        :data:`CROSS_MARGIN_PRIOR`) for the others. So a precision the calibrated model rules out by a
        wide margin costs no trial, and one that ran costs no more trials than its own calibration allows."""
        if best_median is None:
            return
        # A config must be able to beat the best by more than min_improvement (below it a gain is
        # noise, as for patience) at the top of the model's error margin to be worth a trial.
        bar = best_median * (1 + self.settings.min_improvement)
        vouched = {self._keys[i] for i in np.flatnonzero(ran_ok)}
        across = CROSS_MARGIN_PRIOR if cross is None else cross
        for group in dict.fromkeys(self._groups):
            members = [i for i, g in enumerate(self._groups)
                       if g == group and reasons[i] is None and not claimed[i]]
            margins = [margin if self._keys[i] in vouched else across for i in members]
            if not members:
                continue
            if None not in margins and max(sps[i] * (1 + m) for i, m in zip(members, margins)) < bar:
                top, widest = max(sps[i] for i in members), max(margins)
                for i in members:
                    reasons[i] = (PruneReason.SLOW_PRECISION,
                                  f"every {group_name(group)} config left is predicted at most {top:.3g} samples/s: "
                                  f"even {widest:.0%} faster ({_margin_name(widest, margin, cross)}) it would not beat the "
                                  f"best measured {best_median:.3g} by {self.settings.min_improvement:.0%}")
                continue
            for i, m in zip(members, margins):  # the same rule, config by config
                if m is not None and sps[i] * (1 + m) < bar:
                    reasons[i] = (PruneReason.TOO_SLOW,
                                  f"predicted {sps[i]:.3g} samples/s: even {m:.0%} faster ({_margin_name(m, margin, cross)}) "
                                  f"it would not beat the best measured {best_median:.3g} by "
                                  f"{self.settings.min_improvement:.0%}")

    def _dominance(self, reasons, step_s, peak, failed_run) -> None:
        """Prune checkpointing that buys memory the budget does not need (see :mod:`autofit.study`). Offload is
        part of the group: the time model does not cost its host step, so it must not look as fast for less."""
        groups: dict[tuple, list[int]] = {}
        for i, c in enumerate(self.configs):
            groups.setdefault((c.precision, c.micro_batch, c.grad_accum, c.device_split, c.split_mode, c.optimizer,
                               c.offload), []).append(i)
        for members in groups.values():
            alive = [i for i in members if reasons[i] is None and not failed_run[i]]
            for b in alive:
                for a in alive:
                    if a == b or not _may_dominate(self.configs[a], self.configs[b]):
                        continue
                    faster = step_s[a] < step_s[b] * (1 - 1e-3)
                    same_time_less_memory = abs(step_s[a] - step_s[b]) <= 1e-3 * step_s[b] and (
                        peak[a] < peak[b] or (peak[a] == peak[b] and self.configs[a].checkpoint_every
                                              < self.configs[b].checkpoint_every))
                    if faster or same_time_less_memory:
                        ca = self.configs[a]
                        why = "predicted faster" if faster else "predicted as fast with less memory"
                        policy = " (selective)" if ca.checkpoint_policy is CheckpointPolicy.SELECTIVE else ""
                        reasons[b] = (PruneReason.DOMINATED, f"checkpoint_every {ca.checkpoint_every}{policy} with the "
                                                             f"same precision, micro-batch, split and optimizer fits "
                                                             f"and is {why}")
                        break

    def _stop(self, candidates: list[int], finished: list[TrialRecord], running: int, sps: np.ndarray,
              now: float | None, best_median: float | None, reserve: int) -> tuple[StopReason, str] | None:
        """Why exploration stops, and that in words (None: it goes on). Re-measurements are real trials: they count
        towards the trial limit (``reserve`` of it is left for them), not towards patience."""
        settings = self.settings
        if settings.deadline is not None and (now or time.time()) >= settings.deadline:
            return StopReason.TIMEOUT, "timeout: no new trial after the time limit"
        if not candidates:
            return StopReason.EXHAUSTED, "exhausted: every config ran or was pruned"
        if settings.trials is not None and len(finished) + running >= settings.trials - reserve:
            return StopReason.TRIAL_LIMIT, f"trial limit: {settings.trials} real trials"
        ordered = sorted((r for r in finished if r.sample == 1), key=lambda r: (r.finished is None, r.finished, r.number))
        best, since = None, 0
        for r in ordered:
            value = r.value if r.feasible else None
            if value is not None and (best is None or value > best * (1 + settings.min_improvement)):
                best, since = value, 0
            else:
                since += 1
                if value is not None and value > best:
                    best = value
        if since >= settings.patience:
            return StopReason.PATIENCE, (f"patience: {since} trials in a row without a {settings.min_improvement:.0%} "
                                         "gain" + ("" if best is not None else " (none fitted the budget)"))
        if best_median is not None:
            top = max(sps[i] for i in candidates)
            if top < BOUND * best_median:
                return StopReason.BOUND, (f"bound: nothing left is predicted above {BOUND:.0%} of the best "
                                          f"({top:.3g} against {best_median:.3g} samples/s)")
        return None

    def _choose(self, candidates: list[int], sps: np.ndarray, ratio: np.ndarray,
                records: Sequence[TrialRecord]) -> int:
        """The candidate predicted fastest (calibrated; every config the estimate says does not fit,
        with its safety margin, or that the measured error rules out, is already pruned): the first
        trial is the search's best guess, not a calibration probe. Among predictions within TIE of
        the top, below what the model can tell apart, the cheapest trial runs first."""
        top = max(sps[i] for i in candidates)
        near = [i for i in candidates if sps[i] >= top * (1 - TIE)]
        return min(near, key=lambda i: (self.trial_seconds(i, ratio[i]), -sps[i], self._tiebreak[i]))

