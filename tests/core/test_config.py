import json

import pytest

from autofit.core.config import (
    CheckpointPolicy,
    Offload,
    OptimizerChoice,
    Precision,
    SplitMode,
    TrainConfig,
    stage_bounds,
)
from autofit.core.errors import ConfigError


def test_defaults_and_json_contract():
    cfg = TrainConfig()
    assert cfg.to_dict() == {"precision": "fp32", "micro_batch": 1, "grad_accum": 1, "checkpoint_every": 0,
                             "device_split": 1, "split_mode": "pipeline", "optimizer": "as-given",
                             "checkpoint_policy": "full", "offload": "none"}
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    fsdp = TrainConfig(micro_batch=2, device_split=4, split_mode="fsdp")
    assert TrainConfig.from_dict(json.loads(json.dumps(fsdp.to_dict()))) == fsdp


def test_json_from_before_split_mode_loads_as_pipeline():
    old = {"precision": "amp-bf16", "micro_batch": 4, "grad_accum": 2, "checkpoint_every": 1, "device_split": 2}
    assert TrainConfig.from_dict(old).split_mode is SplitMode.PIPELINE


def test_json_from_before_the_lean_levers_loads_as_the_workloads_optimizer_and_full_checkpointing():
    old = {"precision": "amp-bf16", "micro_batch": 4, "grad_accum": 2, "checkpoint_every": 1, "device_split": 1,
           "split_mode": "pipeline"}
    cfg = TrainConfig.from_dict(old)
    assert cfg.optimizer is OptimizerChoice.AS_GIVEN and cfg.checkpoint_policy is CheckpointPolicy.FULL
    assert not cfg.changes_optimizer
    # the short form of a config that uses neither lever reads as it always did (study identities hash it)
    assert cfg.short() == "amp-bf16 mb=4 ga=2 ckpt=1 split=1"
    lean = TrainConfig.from_dict({**old, "optimizer": "adamw8bit", "checkpoint_policy": "selective"})
    assert lean.short() == "amp-bf16 mb=4 ga=2 ckpt=1/sel split=1 opt=adamw8bit"
    assert lean.changes_optimizer
    assert TrainConfig.from_dict(json.loads(json.dumps(lean.to_dict()))) == lean


def test_offload_round_trips_and_json_from_before_it_loads_as_none():
    old = {"precision": "amp-bf16", "micro_batch": 4, "grad_accum": 2, "checkpoint_every": 1, "device_split": 1,
           "split_mode": "pipeline", "optimizer": "as-given", "checkpoint_policy": "full"}
    cfg = TrainConfig.from_dict(old)
    assert cfg.offload is Offload.NONE and cfg.short() == "amp-bf16 mb=4 ga=2 ckpt=1 split=1"
    assert "offload" not in cfg.to_text()  # a command from before the lever reads as it did
    off = TrainConfig.from_dict({**old, "offload": "optimizer"})
    assert off.offload is Offload.OPTIMIZER
    assert off.short() == "amp-bf16 mb=4 ga=2 ckpt=1 split=1 offload=opt"
    assert TrainConfig.from_dict(json.loads(json.dumps(off.to_dict()))) == off
    assert TrainConfig.parse(off.to_text()) == off and "offload=optimizer" in off.to_text()
    assert TrainConfig.parse("offload=OPTIMIZER").offload is Offload.OPTIMIZER
    with pytest.raises(ConfigError, match="invalid offload 'gpu': expected one of none, optimizer"):
        TrainConfig.parse("offload=gpu")


def test_lean_levers_parse_and_name_their_choices():
    cfg = TrainConfig.parse("checkpoint_every=2,checkpoint-policy=SELECTIVE,optimizer=Adafactor")
    assert cfg.checkpoint_policy is CheckpointPolicy.SELECTIVE and cfg.optimizer is OptimizerChoice.ADAFACTOR
    assert TrainConfig.parse("optimizer=as_given").optimizer is OptimizerChoice.AS_GIVEN
    with pytest.raises(ConfigError, match="invalid optimizer 'sgd': expected one of as-given, adafactor, adamw8bit"):
        TrainConfig.parse("optimizer=sgd")
    with pytest.raises(ConfigError, match="invalid checkpoint_policy 'some': expected one of full, selective"):
        TrainConfig.parse("checkpoint_every=1,checkpoint_policy=some")


def test_selective_without_checkpointing_is_refused_when_asked_and_full_when_derived():
    with pytest.raises(ConfigError, match="checkpoint_policy=selective needs checkpoint_every >= 1"):
        TrainConfig.parse("checkpoint_policy=selective")
    # built in code (e.g. a config with its checkpointing turned off): nothing to apply it to, so full
    assert TrainConfig(checkpoint_every=0, checkpoint_policy="selective").checkpoint_policy is CheckpointPolicy.FULL
    assert TrainConfig(checkpoint_every=0, checkpoint_policy="selective") == TrainConfig()


def test_fsdp_ranks_each_run_a_micro_batch():
    # data parallel: a step of the job is micro_batch x grad_accum x ranks samples
    assert TrainConfig(micro_batch=4, grad_accum=2, device_split=4, split_mode="fsdp").samples_per_step == 32
    assert TrainConfig(micro_batch=4, grad_accum=2, device_split=4).samples_per_step == 8
    assert TrainConfig(micro_batch=4, device_split=2, split_mode="FSDP").short() == "fp32 mb=4 ga=1 ckpt=0 fsdp=2"


def test_precision_strings_accepted_and_frozen():
    cfg = TrainConfig(precision="AMP-BF16", micro_batch=8)
    assert cfg.precision is Precision.AMP_BF16
    with pytest.raises(Exception):
        cfg.micro_batch = 2


@pytest.mark.parametrize("kwargs", [
    {"precision": "fp64"}, {"micro_batch": 0}, {"grad_accum": 0}, {"checkpoint_every": -1},
    {"device_split": 0}, {"micro_batch": 2.5}, {"micro_batch": True}, {"split_mode": "zero3"},
])
def test_invalid_values(kwargs):
    with pytest.raises(ConfigError):
        TrainConfig(**kwargs)


def test_bad_split_mode_message_names_the_choices():
    with pytest.raises(ConfigError, match="invalid split_mode 'zero3': expected one of pipeline, fsdp"):
        TrainConfig.parse("split_mode=zero3")


def test_parse_overrides():
    cfg = TrainConfig.parse("precision=amp-bf16, micro_batch=8,grad_accum=4,checkpoint_every=2,device_split=2")
    assert cfg == TrainConfig(Precision.AMP_BF16, 8, 4, 2, 2)
    assert TrainConfig.parse("micro-batch=3").micro_batch == 3
    assert TrainConfig.parse("device_split=2,split-mode=fsdp").split_mode is SplitMode.FSDP


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
