"""Calibration: what real trials teach the estimate and the time model about one workload on one device.

After each real trial the study compares what was measured with what was predicted before it ran:

- **memory**: ``peak_ratio`` is the median of measured / predicted peak over ok trials (but an
  FSDP rank's, whose estimate is an upper bound by design); the
  ``peak_margin`` is the largest under-prediction left after that correction (an ``oom`` trial
  counts as an under-prediction of at least budget / predicted), plus a small slack. Until a few
  trials have run the margin cannot fall below a prior that shrinks with each trial. A config
  then fits when ``predicted * peak_ratio * (1 + peak_margin) <= budget``.
- **time**: each ok trial gives a ratio measured / predicted step time. The prior's errors
  depend on the precision (a probe's matmul rate is not a training step's) and on the
  micro-batch (small matrices run below the probe's rate, large activations fall out of the
  caches), so the log ratio is fitted as a sum of a precision effect and a micro-batch effect
  (plus checkpointing and split), with penalties that keep it sane with few
  trials (:meth:`Calibration.time_ratios`). One precision's trials at several micro-batches
  then also correct the other precisions' predictions at those micro-batches.

A Calibration is plain data, rebuilt from the trials at any time (:func:`calibrate`), so every
worker of a study, and ``autofit report``, computes the same one from the storage.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd

from autofit.core.config import TrainConfig
from autofit.core.records import TrialRecord, TrialStatus

# Added to the largest observed under-prediction: measurement noise between runs.
MARGIN_SLACK = 0.02
# Before any trial a config must fit with this margin on top of the estimate; it shrinks as
# PRIOR_WEIGHT / (PRIOR_WEIGHT + trials) once trials run. The estimator is built from a profile
# of the model in hand, not a formula (the formulas are 20-32% low,
# docs/facts.md#formula-estimates-run-low). On the CPU the profile's own real steps have already
# checked its bytes on this device (autofit.profiling.real_check), so the prior is the slack that
# calibration keeps anyway: a larger one kept the predicted best at 97.5% of the budget from being
# the first trial, on an estimate exact to the byte (docs/estimate.md#calibration). CUDA adds
# the allocator's fragmentation (5-30%, docs/facts.md#allocator-fragmentation), which the
# estimate models from small steps of one GPU.
PRIOR_MARGIN = {"cpu": MARGIN_SLACK, "cuda": 0.10}
# The prior counts as one trial's evidence: on the CPU, once two trials have measured the model's error on this
# workload, that error (plus MARGIN_SLACK) governs. With three, a best config within 3% of the
# budget stayed pruned on an estimate exact to the byte until a third trial had run, and the
# search could end before it (gpt-tiny at 64 MiB in results/benchmarks/search_grid.csv).
PRIOR_WEIGHT = 1.0
# Penalties of the step-time model (in log space): RIDGE shrinks effects towards none (weak: a
# few trials should move them); SMOOTHNESS ties neighbouring micro-batches together (strong: an
# unmeasured micro-batch takes after its measured neighbours).
RIDGE = 0.01
SMOOTHNESS = 0.5


@dataclass(frozen=True)
class Observation:
    """One real trial, as calibration sees it: what was predicted before it ran and what it measured."""

    config: TrainConfig
    status: TrialStatus                          # ok, oom, error, timeout
    predicted_peak_bytes: float
    predicted_step_time_s: float                 # the uncalibrated prior
    measured_peak_bytes: float | None = None
    measured_step_time_s: float | None = None
    budget_bytes: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", TrialStatus(self.status))  # "ok" and TrialStatus.OK alike


@dataclass(frozen=True)
class TimePoint:
    """A measured config and its ratio measured / predicted step time."""

    precision: str
    micro_batch: int
    grad_accum: int
    checkpoint_every: int
    device_split: int
    ratio: float
    split_mode: str = "pipeline"   # calibration data written before the field existed: pipelines
    optimizer: str = "as-given"    # ... before the optimizer lever: the workload's own
    checkpoint_policy: str = "full"
    offload: str = "none"          # ... before the offload lever: on the device


@dataclass(frozen=True)
class Calibration:
    """Corrections learned from real trials; :meth:`prior` before any.

    ``peak_ratio``/``peak_margin``: see the module docstring; ``peak_errors`` and
    ``time_errors``: relative errors (predicted - measured) / measured of the uncalibrated
    predictions, one per ok trial; ``n_trials``: real trials seen (any status).
    """

    device_type: str = "cpu"
    peak_ratio: float = 1.0
    peak_margin: float = PRIOR_MARGIN["cpu"]
    time_points: tuple[TimePoint, ...] = field(default_factory=tuple)
    peak_errors: tuple[float, ...] = field(default_factory=tuple)
    time_errors: tuple[float, ...] = field(default_factory=tuple)
    n_trials: int = 0

    @classmethod
    def prior(cls, device_type: str = "cpu") -> "Calibration":
        return cls(device_type=device_type, peak_margin=PRIOR_MARGIN.get(device_type, 0.10))

    @property
    def peak_factor(self) -> float:
        """What a raw predicted peak is multiplied by before it is compared with the budget."""
        return self.peak_ratio * (1.0 + self.peak_margin)

    def corrected_peak(self, predicted_peak_bytes):
        """The calibrated (central) peak: predicted times ``peak_ratio``. Works on arrays."""
        return predicted_peak_bytes * self.peak_ratio

    def fits(self, predicted_peak_bytes, budget_bytes: int):
        """Whether the peak fits with the safety margin. Works on arrays."""
        return predicted_peak_bytes * self.peak_factor <= budget_bytes

    def time_ratios(self, table: pd.DataFrame) -> np.ndarray:
        """Per row of ``table`` (with the config columns): the ratio to apply to its predicted time.

        ``log(ratio) = mu + a[precision] + b[micro_batch] + c * checkpointed + d[split_mode] * log2(split)
        + e * selective + f[optimizer] + g * offloaded``
        (accumulation is in the prior's step composition already), fitted by least squares to the measured ratios with a ridge
        penalty (an unseen precision gets the mean, ``a = 0``) and a smoothness penalty on ``b``
        over log2(micro_batch) (an unseen micro-batch is interpolated from its neighbours). So
        what one precision's trials show about micro-batches carries over to the others. Each
        split mode has its own split effect: a pipeline's and FSDP's coordination costs differ
        (the prior was 13-20% fast for a gpt-tiny pipeline and 55% fast for its FSDP), so once
        both have run, neither's correction is the other's. Selective checkpointing and each of the
        ``optimizer`` lever's choices have a term of their own (their steps differ from what the
        prior costs: selective recomputation is memory-bound, bitsandbytes' CPU step is Python), and so
        has ``offload=optimizer`` (a host step and copies the prior does not cost), zero until a trial
        of theirs runs.
        """
        n = len(table)
        if not self.time_points:
            return np.ones(n)
        points = pd.DataFrame([asdict(p) for p in self.time_points])
        y = np.log(points["ratio"].to_numpy(dtype=np.float64))
        precisions = sorted(set(points["precision"]) | set(table["precision"]))
        levels = np.array(sorted(set(points["micro_batch"]) | set(table["micro_batch"])), dtype=np.float64)
        modes = sorted(set(points["split_mode"]) | set(_split_modes(table)))
        optimizers = sorted((set(points["optimizer"]) | set(_column(table, "optimizer", "as-given"))) - {"as-given"})

        def design(frame: pd.DataFrame) -> np.ndarray:
            m = len(frame)
            x = np.zeros((m, 1 + len(precisions) + len(levels) + 1 + len(modes) + 1 + len(optimizers) + 1))
            x[:, 0] = 1.0
            prec = frame["precision"].to_numpy()
            for j, name in enumerate(precisions):
                x[:, 1 + j] = prec == name
            mb = frame["micro_batch"].to_numpy(dtype=np.float64)
            for j, level in enumerate(levels):
                x[:, 1 + len(precisions) + j] = mb == level
            k = 1 + len(precisions) + len(levels)
            x[:, k] = frame["checkpoint_every"].to_numpy() > 0
            splits = np.log2(frame["device_split"].to_numpy(dtype=np.float64))
            mode = _split_modes(frame)
            for j, name in enumerate(modes):
                x[:, k + 1 + j] = splits * (mode == name)
            k += 1 + len(modes)
            x[:, k] = (frame["checkpoint_every"].to_numpy() > 0) & (_column(frame, "checkpoint_policy", "full") == "selective")
            chosen = _column(frame, "optimizer", "as-given")
            for j, name in enumerate(optimizers):
                x[:, k + 1 + j] = chosen == name
            x[:, -1] = _column(frame, "offload", "none") == "optimizer"
            return x

        x = design(points)
        p = x.shape[1]
        penalties = [np.sqrt(RIDGE) * np.eye(p)[1:]]  # every coefficient but the mean is shrunk to 0
        start = 1 + len(precisions)
        for j in range(len(levels) - 1):  # neighbouring micro-batches have similar ratios (per octave)
            row = np.zeros(p)
            octaves = np.log2(levels[j + 1] / levels[j])
            row[start + j], row[start + j + 1] = -1.0 / octaves, 1.0 / octaves
            penalties.append(np.sqrt(SMOOTHNESS) * row[None, :])
        a = np.vstack([x] + penalties)
        b = np.concatenate([y, np.zeros(a.shape[0] - len(y))])
        coef, *_ = np.linalg.lstsq(a, b, rcond=None)
        return np.exp(design(table) @ coef)

    def to_dict(self) -> dict:
        """JSON-ready (stored on the study and in ``calibration.json``)."""
        data = asdict(self)
        data["time_points"] = [asdict(p) for p in self.time_points]
        data["peak_factor"] = self.peak_factor
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "Calibration":
        data = {k: v for k, v in data.items() if k != "peak_factor"}
        data["time_points"] = tuple(TimePoint(**p) for p in data.get("time_points", ()))
        data["peak_errors"] = tuple(data.get("peak_errors", ()))
        data["time_errors"] = tuple(data.get("time_errors", ()))
        return cls(**data)


def _column(frame: pd.DataFrame, name: str, default: str) -> np.ndarray:
    """Column ``name`` as string values (``default`` where a table from before the field lacks it)."""
    if name not in frame.columns:
        return np.full(len(frame), default, dtype=object)
    return np.array([getattr(v, "value", v) for v in frame[name]], dtype=object)


def _split_modes(frame: pd.DataFrame) -> np.ndarray:
    """The split mode of each row, as its string value (``pipeline`` where the column is absent)."""
    if "split_mode" not in frame.columns:
        return np.full(len(frame), "pipeline", dtype=object)
    return np.array([getattr(m, "value", m) for m in frame["split_mode"]], dtype=object)


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    """(predicted - measured) / measured: negative is an under-prediction. None when either is missing."""
    if predicted is None or measured is None or not measured or not math.isfinite(predicted):
        return None
    return (predicted - measured) / measured


def measured_peak(measurement: dict) -> float | None:
    """The measured peak to compare with the estimate: on CUDA what the card held (reserved + context,
    as the estimate predicts it), else the live tensor bytes."""
    return measurement.get("peak_card_bytes") or measurement.get("peak_bytes")


def observations(records: list[TrialRecord], budget_bytes: int) -> list[Observation]:
    """What calibration needs from every real trial that finished (ok, oom, error, timeout)."""
    out = []
    for r in records:
        if not r.status.ran or "peak_bytes" not in r.prediction:
            continue
        out.append(Observation(
            config=r.config, status=r.status, predicted_peak_bytes=float(r.prediction["peak_bytes"]),
            predicted_step_time_s=float(r.prediction.get("prior_step_time_s") or math.nan),
            # a re-measurement (and an earlier version's head-to-head) times throughput only: the peak it
            # carries is its config's own trial's, counted there
            measured_peak_bytes=None if r.measurement.get("peak_from_trial") is not None else measured_peak(r.measurement),
            measured_step_time_s=r.measurement.get("step_time_s"),
            budget_bytes=budget_bytes))
    return out


def calibrate(observations: list[Observation], device_type: str = "cpu") -> Calibration:
    """The calibration after ``observations`` (real trials of one workload on one device).

    Trials with status ``error`` or ``timeout`` say nothing about memory or time and are only counted.
    """
    prior = Calibration.prior(device_type)
    ok = [o for o in observations if o.status is TrialStatus.OK and o.measured_peak_bytes and o.predicted_peak_bytes > 0]
    ratios = [o.measured_peak_bytes / o.predicted_peak_bytes for o in ok]
    # An FSDP rank's estimate is an upper bound by design (one gathered buffer more: estimator.fsdp_memory),
    # so its ratio under 1 says nothing of other configs' estimates, which it would lower: it only counts
    # towards the margin.
    exact = [r for r, o in zip(ratios, ok) if o.config.data_parallel == 1]
    peak_ratio = float(np.median(exact)) if exact else 1.0
    # Under-predictions after the central correction; an oom is at least budget / prediction.
    residuals = [r / peak_ratio - 1.0 for r in ratios]
    for o in observations:
        if o.status is TrialStatus.OOM and o.budget_bytes and o.predicted_peak_bytes > 0:
            residuals.append(o.budget_bytes / (o.predicted_peak_bytes * peak_ratio) - 1.0)
    n = len(ratios) + sum(o.status is TrialStatus.OOM for o in observations)
    shrinking_prior = prior.peak_margin * PRIOR_WEIGHT / (PRIOR_WEIGHT + n)
    observed = max([0.0] + residuals) + (MARGIN_SLACK if residuals else 0.0)
    peak_margin = max(shrinking_prior, observed)
    points = []
    time_errors = []
    for o in ok:
        if o.measured_step_time_s and o.predicted_step_time_s and math.isfinite(o.predicted_step_time_s):
            c = o.config
            points.append(TimePoint(c.precision.value, c.micro_batch, c.grad_accum, c.checkpoint_every,
                                    c.device_split, o.measured_step_time_s / o.predicted_step_time_s,
                                    c.split_mode.value, c.optimizer.value, c.checkpoint_policy.value,
                                    c.offload.value))
            time_errors.append(relative_error(o.predicted_step_time_s, o.measured_step_time_s))
    return Calibration(
        device_type=device_type, peak_ratio=peak_ratio, peak_margin=peak_margin, time_points=tuple(points),
        peak_errors=tuple(relative_error(o.predicted_peak_bytes, o.measured_peak_bytes) for o in ok),
        time_errors=tuple(time_errors), n_trials=len(observations),
    )
