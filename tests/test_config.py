import json

import pytest

from autofit.config import Precision, TrainConfig, stage_bounds
from autofit.errors import ConfigError


def test_defaults_and_json_contract():
    cfg = TrainConfig()
    assert cfg.to_dict() == {"precision": "fp32", "micro_batch": 1, "grad_accum": 1, "checkpoint_every": 0, "device_split": 1}
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_precision_strings_accepted_and_frozen():
    cfg = TrainConfig(precision="AMP-BF16", micro_batch=8)
    assert cfg.precision is Precision.AMP_BF16
    with pytest.raises(Exception):
        cfg.micro_batch = 2


@pytest.mark.parametrize("kwargs", [
    {"precision": "fp64"}, {"micro_batch": 0}, {"grad_accum": 0}, {"checkpoint_every": -1},
    {"device_split": 0}, {"micro_batch": 2.5}, {"micro_batch": True},
])
def test_invalid_values(kwargs):
    with pytest.raises(ConfigError):
        TrainConfig(**kwargs)


def test_parse_overrides():
    cfg = TrainConfig.parse("precision=amp-bf16, micro_batch=8,grad_accum=4,checkpoint_every=2,device_split=2")
    assert cfg == TrainConfig(Precision.AMP_BF16, 8, 4, 2, 2)
    assert TrainConfig.parse("micro-batch=3").micro_batch == 3


@pytest.mark.parametrize("text", ["micro_batch", "micro_batch=", "batch=2", "micro_batch=two", "precision=fp8"])
def test_parse_rejects(text):
    with pytest.raises(ConfigError) as err:
        TrainConfig.parse(text)
    assert "\n" not in str(err.value)


def test_stage_bounds_balanced_and_contiguous():
    assert stage_bounds(4, 1) == [(0, 4)]
    assert stage_bounds(5, 2) == [(0, 3), (3, 5)]
    assert stage_bounds(32, 8)[-1] == (28, 32)
    with pytest.raises(ConfigError):
        stage_bounds(2, 3)
