from pathlib import Path

import pytest

from autofit.core.config import Precision, TrainConfig
from autofit.core.errors import SpaceError
from autofit.core.space import builtin_spaces, load_space, space_from_dict

REPO_DIR = Path(__file__).resolve().parents[2]


def write(tmp_path, text):
    path = tmp_path / "space.toml"
    path.write_text(text)
    return path


def test_default_space_loads_and_derives_accumulation():
    space = load_space()
    configs = space.configs()
    assert space.global_batch == 64
    assert all(c.micro_batch * c.grad_accum == 64 for c in configs)
    assert {c.precision for c in configs} == set(Precision)


def test_every_shipped_space_loads():
    assert {"default", "tiny"} <= set(builtin_spaces())
    for name in builtin_spaces():
        assert len(load_space(name)) > 0


def test_every_example_space_loads():
    examples = sorted((REPO_DIR / "search_spaces").glob("*.toml"))
    assert examples
    for path in examples:
        assert len(load_space(path)) > 0


def test_space_by_name_reads_package_data():
    space = load_space("tiny")
    assert space.source.endswith("tiny.toml") and "search_spaces" in space.source
    assert len(space) == 16  # 2 precisions x 2 micro-batches x 2 checkpoint intervals x 2 splits
    assert load_space(None).source.endswith("default.toml")


def test_an_existing_path_wins_over_a_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").write_text('precision = ["fp32"]\nmicro_batch = [3]\n')
    assert [c.micro_batch for c in load_space("tiny").configs()] == [3]


def test_unknown_name_lists_the_builtins():
    with pytest.raises(SpaceError, match="no such search-space file.*default, .*tiny"):
        load_space("nosuchspace")


def test_global_batch_keeps_only_divisors(tmp_path):
    space = load_space(write(tmp_path, 'precision = ["fp32"]\nmicro_batch = [2, 3, 4]\nglobal_batch = 8\n'))
    assert [c.micro_batch for c in space.configs()] == [2, 4]
    assert [c.grad_accum for c in space.configs()] == [4, 2]


def test_without_global_batch_takes_the_product(tmp_path):
    space = load_space(write(tmp_path, 'precision = "bf16"\nmicro_batch = [1, 2]\ngrad_accum = [1, 4]\n'))
    assert len(space.configs()) == 4
    assert TrainConfig("bf16", 2, 4) in space.configs()


@pytest.mark.parametrize("text, key", [
    ('precision = ["fp32"]\nmicro_batch = [1]\nbatch = 3\n', "batch"),
    ('precision = []\nmicro_batch = [1]\n', "precision"),
    ('precision = ["fp32"]\nmicro_batch = []\n', "micro_batch"),
    ('precision = ["fp32"]\nmicro_batch = [3, 5]\nglobal_batch = 8\n', "global_batch"),
    ('precision = ["fp8"]\nmicro_batch = [1]\n', "precision"),
    ('precision = ["fp32"]\nmicro_batch = [0]\n', "micro_batch"),
    ('precision = ["fp32"]\nmicro_batch = ["a"]\n', "micro_batch"),
    ('micro_batch = [1]\n', "precision"),
])
def test_bad_spaces_name_file_and_key(tmp_path, text, key):
    path = write(tmp_path, text)
    with pytest.raises(SpaceError) as err:
        load_space(path)
    message = str(err.value)
    assert str(path) in message and key in message and "\n" not in message


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(SpaceError, match="no such"):
        load_space(tmp_path / "nope.toml")
    with pytest.raises(SpaceError, match="not valid TOML"):
        load_space(write(tmp_path, "precision = [\n"))


def test_fsdp_split_mode_divides_the_global_batch_over_ranks():
    space = space_from_dict({"precision": "fp32", "micro_batch": [1, 2, 4], "global_batch": 8,
                             "device_split": [1, 2], "split_mode": ["pipeline", "fsdp"]})
    configs = {(c.micro_batch, c.grad_accum, c.device_split, c.split_mode.value) for c in space.configs()}
    # one device is listed once; fsdp ranks each run a micro-batch: 8 = 4 x 1 x 2
    assert (4, 1, 2, "fsdp") in configs and (4, 2, 2, "pipeline") in configs
    assert not any(ds == 1 and mode == "fsdp" for _, _, ds, mode in configs)
    assert all(c.samples_per_step == 8 for c in space.configs())


def test_bad_split_mode_in_space_names_the_choices():
    with pytest.raises(SpaceError, match="'split_mode' has invalid values \\['zero'\\]; expected pipeline, fsdp"):
        space_from_dict({"precision": "fp32", "micro_batch": 1, "split_mode": "zero"})


def test_lean_space_adds_the_optimizer_and_the_checkpoint_policy_to_the_default_levers():
    from autofit.core.config import CheckpointPolicy, OptimizerChoice

    default, lean = load_space("default"), load_space("lean")
    for dim in ("precision", "micro_batch", "checkpoint_every", "device_split", "split_mode"):
        assert getattr(lean, dim) == getattr(default, dim)
    assert lean.global_batch == default.global_batch
    assert set(lean.optimizer) == set(OptimizerChoice)
    assert set(lean.checkpoint_policy) == set(CheckpointPolicy)
    configs = lean.configs()
    # no checkpointing is one config whatever the policy: 1 + 3 x 2 checkpoint settings, 3 optimizers
    assert len(configs) == len(default.configs()) // 4 * 7 * 3
    assert all(c.checkpoint_policy is CheckpointPolicy.FULL for c in configs if c.checkpoint_every == 0)
    # the lever changes the training: the default space keeps the workload's own optimizer
    assert {c.optimizer for c in default.configs()} == {OptimizerChoice.AS_GIVEN}


def test_bad_optimizer_in_space_names_the_choices(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text('precision = ["fp32"]\nmicro_batch = [1]\noptimizer = ["lion"]\n')
    with pytest.raises(SpaceError, match="'optimizer' has invalid values.*as-given, adafactor, adamw8bit"):
        load_space(path)


def test_offload_is_a_dimension_a_space_can_list():
    from autofit.core.config import Offload

    space = space_from_dict({"precision": "fp32", "micro_batch": [1, 2], "offload": ["none", "optimizer"]})
    assert [(c.micro_batch, c.offload) for c in space.configs()] == [
        (1, Offload.NONE), (1, Offload.OPTIMIZER), (2, Offload.NONE), (2, Offload.OPTIMIZER)]
    # the built-in spaces leave it out: it means something only on CUDA (pruned on the CPU, saying why)
    assert {c.offload for c in load_space("lean").configs()} == {Offload.NONE}
    with pytest.raises(SpaceError, match="'offload' has invalid values \\['params'\\]; expected none, optimizer"):
        space_from_dict({"precision": "fp32", "micro_batch": 1, "offload": ["params"]})
