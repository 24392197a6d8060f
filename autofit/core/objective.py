"""What a search maximises when configs use different numbers of devices.

With ``--devices N`` (devices per worker), a config is scored on the **whole job** those N
devices would run: a config that needs ``device_split`` devices (pipeline stages or FSDP ranks)
is repeated as ``N // device_split`` data-parallel replicas, so

    job samples/s = replicas × samples/s of one replica

-- for an unsplit model N replicas, for a 2-stage pipeline N/2, for FSDP over all N devices
one. The replicas' gradient all-reduce is not measured (one replica runs here; the job's
throughput is that replica's times the replicas, an upper bound). A config needing more
devices than N cannot run here: it is scored **per device** (samples/s ÷ device_split), the
fallback that compares configs of any size, and the tables say which basis each row used.
"""

from __future__ import annotations

from autofit.core.config import TrainConfig

__all__ = ["JOB", "PER_DEVICE", "basis", "objective", "replicas"]

JOB = "job"
PER_DEVICE = "per device"


def replicas(config: TrainConfig, devices: int) -> int:
    """Data-parallel replicas of ``config`` that ``devices`` devices hold (0: it does not fit on them)."""
    return max(0, devices) // config.device_split


def basis(config: TrainConfig, devices: int) -> str:
    """``job`` where ``config`` runs on ``devices`` devices, else ``per device``."""
    return JOB if replicas(config, devices) >= 1 else PER_DEVICE


def objective(config: TrainConfig, samples_per_s: float, devices: int) -> float:
    """The search's value of one replica's ``samples_per_s``: job samples/s on ``devices``
    devices, or samples/s per device where the config needs more devices than that.

    >>> objective(TrainConfig(device_split=2), 10.0, devices=4)   # two pipelines of 2 stages
    20.0
    """
    r = replicas(config, devices)
    return samples_per_s * r if r >= 1 else samples_per_s / config.device_split
