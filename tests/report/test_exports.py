"""Exports: each target's real object is built from what autofit exports (a renamed argument upstream fails here)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import autofit
from autofit.cli import main
from autofit.core.config import TrainConfig
from autofit.core.errors import ConfigError
from autofit.report.exports import export

ROOT = Path(__file__).resolve().parents[2]
PRECISIONS = ("fp32", "amp-fp16", "amp-bf16", "bf16")


@pytest.fixture(scope="module")
def tiny_spec():
    return f"{ROOT / 'tests' / 'trial_workloads.py'}:tiny"


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("every", (0, 1, 2))
def test_hf_training_arguments(precision, every, tmp_path):
    transformers = pytest.importorskip("transformers")
    exp = export(f"precision={precision},micro_batch=8,grad_accum=4,checkpoint_every={every}", "hf", device="cpu")
    with warnings.catch_warnings():  # the names of the installed transformers: no deprecated alias
        warnings.filterwarnings("error", message=".*checkpointing.*deprecated", category=FutureWarning)
        args = transformers.TrainingArguments(output_dir=str(tmp_path), **exp.kwargs)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (8, 4)
    # pure bf16 has no flag: the nearest, autocast bf16, with a note
    assert (args.bf16, args.fp16) == (precision in ("amp-bf16", "bf16"), precision == "amp-fp16")
    assert args.gradient_checkpointing is (every == 1)
    if every == 1:
        assert args.gradient_checkpointing_kwargs == {"use_reentrant": False}
    # what it cannot say is in the comment field, never dropped
    kinds = {note.setting.split("=")[0] for note in exp.notes} - {"all together"}
    assert ("precision" in kinds) == (precision == "bf16")
    assert ("checkpoint_every" in kinds) == (every == 2)
    assert json.loads(exp.text)["comment"] == exp.comment()


def test_hf_notes_give_the_nearest_setting_and_its_estimated_peak():
    exp = export("precision=bf16,micro_batch=8,grad_accum=2,checkpoint_every=2", "hf", workload="gpt-tiny",
                 budget="1GB", device="cpu")
    by_setting = {note.setting: note for note in exp.notes}
    ckpt, bf16 = by_setting["checkpoint_every=2"], by_setting["precision=bf16"]
    assert ckpt.nearest_config == TrainConfig.parse("precision=bf16,micro_batch=8,grad_accum=2,checkpoint_every=1")
    assert bf16.nearest_config.precision.value == "amp-bf16"
    for note in (ckpt, bf16):  # the estimate's own peak for the nearest setting
        assert note.nearest_peak_bytes == autofit.estimate("gpt-tiny", note.nearest_config, device="cpu").peak_bytes
        assert "fits the 1.00 GB" in note.text() and note.code
    assert any("checkpoint_layers(" in line for line in ckpt.code)
    # both at once: what the TrainingArguments give as they are, and its peak
    together = by_setting["all together"]
    assert together.nearest_config == TrainConfig.parse("precision=amp-bf16,micro_batch=8,grad_accum=2,checkpoint_every=1")
    assert together.nearest_peak_bytes == autofit.estimate("gpt-tiny", together.nearest_config, device="cpu").peak_bytes


@pytest.mark.parametrize("precision,mixed", [("fp32", "no"), ("amp-fp16", "fp16"), ("amp-bf16", "bf16"),
                                             ("bf16", "bf16")])
def test_accelerate_config_file_loads(precision, mixed, tmp_path):
    pytest.importorskip("accelerate")
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType

    exp = export(f"precision={precision},micro_batch=4,grad_accum=3,checkpoint_every=1", "accelerate", device="cpu")
    path = exp.write(tmp_path / "accelerate.yaml")
    loaded = load_config_from_file(str(path))
    assert loaded.mixed_precision == mixed
    assert loaded.distributed_type == DistributedType.NO and loaded.num_processes == 1 and loaded.use_cpu
    # the file has no batch size, accumulation or checkpointing: each is a comment line with its code
    comments = [line for line in path.read_text().splitlines() if line.startswith("#")]
    assert any("batch_size=4" in c for c in comments)
    assert any("gradient_accumulation_steps=3" in c for c in comments)
    assert any("checkpoint_every=1" in c for c in comments)
    assert any("precision=bf16" in c for c in comments) == (precision == "bf16")


@pytest.mark.parametrize("precision,expected", [("fp32", "32-true"), ("amp-bf16", "bf16-mixed"),
                                                ("bf16", "bf16-true"), ("amp-fp16", "bf16-mixed")])
def test_lightning_trainer_accepts_the_arguments(precision, expected, tmp_path):
    lightning = pytest.importorskip("lightning")
    exp = export(f"precision={precision},micro_batch=16,grad_accum=2", "lightning", device="cpu")
    trainer = lightning.Trainer(**exp.kwargs, default_root_dir=str(tmp_path), logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    assert trainer.accumulate_grad_batches == 2
    assert trainer.precision == expected  # on the CPU Lightning turns 16-mixed into bf16-mixed ...
    assert exp.extra == {"datamodule": {"batch_size": 16}}
    # ... and the export says so rather than let it happen silently, with the code that keeps fp16
    assert any(n.setting == "precision=amp-fp16" for n in exp.notes) == (precision == "amp-fp16")
    if precision == "amp-fp16":
        import torch
        from lightning.pytorch.plugins import MixedPrecision

        exact = lightning.Trainer(plugins=[MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))],
                                  accelerator="cpu", logger=False, enable_checkpointing=False,
                                  enable_progress_bar=False, enable_model_summary=False)
        assert exact.precision == "16-mixed"


def test_the_exact_checkpoint_code_runs_on_a_transformers_model():
    # What a note gives for checkpoint_every=2: checkpoint_layers on the decoder layers. Same loss and
    # gradients, and each layer's forward runs twice (once more in backward): checkpointed.
    transformers = pytest.importorskip("transformers")
    import torch

    from autofit.runtime.training import checkpoint_layers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 64, (2, 16))
    calls = []
    # a pre-hook: recomputation stops early, after the last saved tensor, before a post-hook would run
    model.model.layers[1].mlp.register_forward_pre_hook(lambda *_: calls.append(1))

    def step():
        model.zero_grad()
        calls.clear()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()], len(calls)

    loss, grads, plain_calls = step()
    note = next(n for n in export("checkpoint_every=2", "hf", device="cpu").notes if n.setting == "checkpoint_every=2")
    assert "checkpoint_layers(model.model.layers, 2)" in " ".join(note.code)
    checkpoint_layers(model.model.layers, 2)
    ckpt_loss, ckpt_grads, ckpt_calls = step()
    assert (plain_calls, ckpt_calls) == (1, 2)
    assert torch.allclose(loss, ckpt_loss) and all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, ckpt_grads))


@pytest.mark.parametrize("config", [
    "precision=amp-bf16,micro_batch=8,grad_accum=4",
    "precision=amp-fp16,micro_batch=2,grad_accum=1,checkpoint_every=2",
    "precision=bf16,micro_batch=4,grad_accum=2",
    "precision=fp32,micro_batch=4,grad_accum=8,checkpoint_every=1,device_split=2",
])
def test_deepspeed_config_parser_accepts_the_json(config):
    # DeepSpeed installs on the CPU in about a minute (DS_BUILD_OPS=0), so CI runs its own parser.
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = TrainConfig.parse(config)
    exp = export(cfg, "deepspeed", device="cpu")
    parsed = DeepSpeedConfig(json.loads(exp.text))
    assert parsed.train_micro_batch_size_per_gpu == cfg.micro_batch
    assert parsed.gradient_accumulation_steps == cfg.grad_accum
    assert parsed.train_batch_size == cfg.micro_batch * cfg.grad_accum  # one data-parallel rank
    assert parsed.torch_autocast_enabled == cfg.precision.is_amp
    if cfg.precision.is_amp:
        assert str(parsed.torch_autocast_dtype) == ("torch.bfloat16" if "bf16" in config else "torch.float16")
    assert parsed.bfloat16_config.enabled == (cfg.precision.value == "bf16")
    if cfg.device_split > 1:
        assert parsed.pipeline["stages"] == 2 and parsed.pipeline["activation_checkpoint_interval"] == 1
    assert bool(exp.notes) == (cfg.precision.value == "bf16" or cfg.checkpoint_every > 0 or cfg.device_split > 1)


def test_fsdp_exports_build_each_targets_object(tmp_path):
    cfg = "precision=amp-bf16,micro_batch=4,grad_accum=2,device_split=2,split_mode=fsdp"
    transformers = pytest.importorskip("transformers")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), **export(cfg, "hf", device="cpu").kwargs)
    assert args.fsdp_config["version"] == 2 and args.per_device_train_batch_size == 4
    pytest.importorskip("accelerate")
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType

    loaded = load_config_from_file(str(export(cfg, "accelerate", device="cuda").write(tmp_path / "a.yaml")))
    assert loaded.distributed_type == DistributedType.FSDP and loaded.num_processes == 2
    assert loaded.fsdp_config["fsdp_version"] == 2
    lightning = pytest.importorskip("lightning")
    from lightning.pytorch.strategies import StrategyRegistry

    assert export(cfg, "lightning", device="cuda").kwargs["strategy"] in StrategyRegistry
    cpu = export(cfg, "lightning", device="cpu")  # Lightning's fsdp needs GPUs: ddp here, and a note says so
    trainer = lightning.Trainer(**cpu.kwargs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, default_root_dir=str(tmp_path))
    assert trainer.num_devices == 2 and any(n.setting == "split_mode=fsdp" for n in cpu.notes)
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    assert DeepSpeedConfig(export(cfg, "deepspeed").kwargs).zero_optimization_stage == 3
    with pytest.raises(ConfigError, match="pipeline splits"):
        export(cfg, "torchrun", workload="gpt-tiny")


def test_json_export_round_trips():
    cfg = TrainConfig.parse("precision=amp-bf16,micro_batch=8,grad_accum=4,checkpoint_every=2,device_split=2")
    record = json.loads(export(cfg, "json", device="cuda").text)
    assert TrainConfig.from_dict(record["config"]) == cfg and record["comment"] == []


def _without_launcher_log(stderr: str) -> str:
    """torchrun's stderr less the launcher's own log lines (``W1130 23:32:20.31 ... torch/distributed/elastic/...``),
    whose report of a rank killed by a signal would otherwise push out what that rank wrote last (``terminate
    called ...``, or the Python stacks ``PYTHONFAULTHANDLER`` prints on SIGABRT)."""
    launcher_line = re.compile(r"[IWEF]\d{4} [\d:.]+ \d+ \S*torch/distributed/(elastic|run)")
    return "\n".join(line for line in stderr.splitlines() if not launcher_line.match(line))[-6000:]


def test_torchrun_command_runs_autofits_pipeline_runner(tiny_spec):
    exp = export("precision=fp32,micro_batch=2,grad_accum=2,device_split=2", "torchrun", workload=tiny_spec,
                 device="cpu")
    argv = exp.kwargs
    assert argv[:4] == ["torchrun", "--standalone", "--nproc-per-node", "2"]
    # PYTHONFAULTHANDLER: a rank that aborts (SIGABRT, seen twice in CI, cause unseen) prints where it was
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONFAULTHANDLER": "1"}
    # the same command, with this interpreter's torchrun
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", *argv[1:]], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, _without_launcher_log(proc.stderr)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["status"] == "ok" and result["peak_bytes"] > 0


def test_torchrun_refuses_a_config_that_does_not_split():
    with pytest.raises(ConfigError, match="device_split=1"):
        export("micro_batch=8", "torchrun", workload="gpt-tiny", device="cpu")


def test_cli_notes_on_stderr_and_out_file(tmp_path, capsys):
    out = tmp_path / "args.json"
    assert main(["export", "--to", "hf", "--config", "checkpoint_every=2,micro_batch=4", "--device", "cpu",
                 "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "autofit: note: checkpoint_every=2" in err and "peak not estimated: no workload given" in err
    assert json.loads(out.read_text())["training_arguments"]["per_device_train_batch_size"] == 4


@pytest.mark.parametrize("argv,message", [
    (["export", "--to", "hf"], "a study directory or --config"),
    (["export", "--to", "hf", "--config", "micro_batch=0"], "micro_batch"),
    (["export", "--to", "torchrun", "--config", "device_split=2"], "--model spec"),
])
def test_cli_errors_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_unknown_target_is_refused():
    with pytest.raises(ConfigError, match="expected one of hf, accelerate"):
        export("micro_batch=8", "keras")


# --- exports that change the training say so first ------------------------------------------------------


def _trained_global_batch(exp, cfg: TrainConfig) -> int:
    """Samples per optimizer step when the export is used as it is (the notes' code not applied)."""
    k, ranks = exp.kwargs, cfg.device_split if cfg.split_mode.value == "fsdp" else 1
    if exp.target == "hf":  # per rank; the launcher starts the ranks
        return k["per_device_train_batch_size"] * k["gradient_accumulation_steps"] * ranks
    if exp.target == "accelerate":  # no batch in the file (a note gives the DataLoader's), no accumulation
        return cfg.micro_batch * k["num_processes"]
    if exp.target == "lightning":
        devices = k["devices"] if k.get("strategy") in ("fsdp", "ddp") else 1
        return exp.extra["datamodule"]["batch_size"] * k["accumulate_grad_batches"] * devices
    if exp.target == "deepspeed":
        return k["train_micro_batch_size_per_gpu"] * k["gradient_accumulation_steps"] * ranks
    if exp.target == "torchrun":
        return TrainConfig.parse(k[k.index("--config") + 1]).samples_per_step
    return TrainConfig.from_dict(k["config"]).samples_per_step


@pytest.mark.parametrize("target", ("hf", "accelerate", "lightning", "deepspeed", "torchrun", "json"))
@pytest.mark.parametrize("config", [
    "precision=amp-bf16,micro_batch=8,grad_accum=8",
    "precision=fp32,micro_batch=4,grad_accum=1,checkpoint_every=2",
    "precision=amp-bf16,micro_batch=4,grad_accum=2,device_split=2,split_mode=fsdp",
    "precision=fp32,micro_batch=2,grad_accum=4,device_split=2",
])
@pytest.mark.parametrize("device", ("cpu", "cuda"))
def test_every_target_keeps_the_global_batch_where_it_can_and_says_so_first_where_not(target, config, device):
    cfg = TrainConfig.parse(config)
    try:
        exp = export(cfg, target, workload="gpt-tiny" if target == "torchrun" else None, device=device)
    except ConfigError:  # torchrun runs pipeline splits only
        assert target == "torchrun"
        return
    before, trained = cfg.samples_per_step, _trained_global_batch(exp, cfg)
    # only an Accelerate config file cannot hold the accumulation
    assert (trained != before) == (target == "accelerate" and cfg.grad_accum > 1), (trained, before)
    said = [c for c in exp.changes if c.what == "global batch"]
    if trained == before:
        assert not said
        return
    assert [(c.before, c.after) for c in said] == [(str(before), str(trained))]
    assert said[0].factor == pytest.approx(trained / before)
    line = f"global batch {before} -> {trained} (x{trained / before:.4g})"
    assert exp.text.splitlines()[0] == f"# WARNING: this export changes the training: {said[0].text()}"
    assert said[0].text().startswith(line) and f"gradient_accumulation_steps={cfg.grad_accum}" in said[0].text()


@pytest.mark.parametrize("target,precision,device,after", [
    ("hf", "bf16", "cuda", "amp-bf16"), ("accelerate", "bf16", "cuda", "amp-bf16"),
    ("deepspeed", "bf16", "cuda", "bf16 with fp32 master weights"), ("lightning", "amp-fp16", "cpu", "amp-bf16"),
    ("lightning", "amp-fp16", "cuda", None), ("lightning", "bf16", "cuda", None), ("hf", "amp-fp16", "cuda", None),
    ("accelerate", "amp-bf16", "cuda", None), ("deepspeed", "amp-fp16", "cuda", None), ("json", "bf16", "cuda", None),
])
def test_a_precision_change_is_said_first(target, precision, device, after):
    exp = export(f"precision={precision},micro_batch=4", target, device=device)
    said = [c for c in exp.changes if c.what == "precision"]
    body = None if target == "accelerate" else json.loads(exp.text)
    if after is None:
        assert not said and "WARNING" not in exp.text and (body is None or "changes" not in body)
        return
    assert [(c.before, c.after) for c in said] == [(precision, after)]
    if body is not None:
        assert list(body)[0] == "changes"  # the first key of the file
    first = exp.text.splitlines()[0] if body is None else body["changes"][0]
    assert f"precision {precision} -> {after}: " in first and f"to keep {precision}: " in first


@pytest.mark.parametrize("optimizer,optim,changed", [
    ("AdamW", None, False), ("Adam", None, False), ("SGD", "sgd", False), ("RMSprop", "rmsprop", False),
    ("ASGD", None, True),
])
def test_hf_export_keeps_the_workloads_optimizer_or_says_it_changes(optimizer, optim, changed):
    import dataclasses

    import torch
    from trial_workloads import tiny_lm

    kind = getattr(torch.optim, optimizer)
    workload = dataclasses.replace(tiny_lm(), optimizer=lambda params: kind(params, lr=0.01))
    exp = export("precision=fp32,micro_batch=4", "hf", workload=workload, device="cpu")
    assert exp.kwargs.get("optim") == optim
    said = [c.text() for c in exp.changes if c.what == "optimizer"]
    assert bool(said) == changed
    if changed:
        assert said[0].startswith("optimizer ASGD -> AdamW: ") and "optimizers=(optimizer, None)" in said[0]
        assert json.loads(exp.text)["changes"] == said


def test_cli_says_a_change_first_on_stderr_and_at_the_top_of_the_file(tmp_path, capsys):
    out = tmp_path / "accelerate.yaml"
    assert main(["export", "--to", "accelerate", "--config", "precision=amp-bf16,micro_batch=8,grad_accum=8",
                 "--device", "cpu", "--out", str(out)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("autofit: warning: this export changes the training: global batch 64 -> 8 (x0.125): ")
    assert err[1].startswith("autofit: note: ")
    said = err[0].removeprefix("autofit: warning: this export changes the training: ")
    assert out.read_text().splitlines()[0] == f"# WARNING: this export changes the training: {said}"
