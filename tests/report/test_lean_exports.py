"""Exports of the lean levers: the optimizer lever says first that it changes the training, in every target."""

from __future__ import annotations

import json

import pytest

from autofit.core.config import TrainConfig
from autofit.report.export_notes import HF_OPTIM
from autofit.report.exports import export
from autofit.report.tables import changes_training

LEAN = "precision=amp-bf16,micro_batch=4,grad_accum=2,checkpoint_every=1,checkpoint_policy=selective,optimizer={opt}"


@pytest.mark.parametrize("opt,optim", [("adamw8bit", "adamw_bnb_8bit"), ("adafactor", "adafactor")])
def test_hf_sets_optim_and_says_first_that_the_training_changes(opt, optim, tmp_path):
    transformers = pytest.importorskip("transformers")
    exp = export(LEAN.format(opt=opt), "hf", device="cpu")
    assert exp.kwargs["optim"] == optim == HF_OPTIM[TrainConfig(optimizer=opt).optimizer]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), **exp.kwargs)
    assert str(getattr(args.optim, "value", args.optim)) == optim
    first = exp.notes[0]
    assert first.setting == f"optimizer={opt}" and "this config changes the training" in first.text()
    assert json.loads(exp.text)["comment"][0] == first.text()
    # selective checkpointing: the Trainer checkpoints every layer fully; the note gives autofit's exact code
    ckpt = next(n for n in exp.notes if n.setting.startswith("checkpoint_every=1"))
    assert ckpt.nearest_config.checkpoint_policy.value == "full"
    assert 'checkpoint_layers(model.model.layers, 1, "selective")' in " ".join(ckpt.code)


@pytest.mark.parametrize("target", ["accelerate", "lightning", "deepspeed", "json"])
def test_every_target_says_it_first(target):
    exp = export(LEAN.format(opt="adamw8bit"), target, device="cuda")
    first = exp.notes[0]
    assert first.setting == "optimizer=adamw8bit" and "this config changes the training" in first.text()
    if target != "json":  # the optimizer comes from the user's code: the code that makes it
        assert any("bnb.optim.AdamW8bit(" in line for line in first.code)
        assert first.nearest_config == TrainConfig.parse(LEAN.format(opt="as-given"))
    assert exp.comment()[0] == first.text()


def test_a_config_without_the_lever_exports_as_before():
    exp = export("precision=amp-bf16,micro_batch=4,checkpoint_every=1", "hf", device="cpu")
    assert "optim" not in exp.kwargs and not exp.notes
    assert changes_training(TrainConfig()) is None
    assert changes_training(TrainConfig(optimizer="adafactor")).startswith(
        "it trains with optimizer=adafactor (torch.optim.Adafactor) in place of the workload's own optimizer")


def test_the_exact_selective_code_runs_on_a_transformers_model():
    transformers = pytest.importorskip("transformers")
    import torch

    from autofit.runtime.training import checkpoint_layers

    torch.manual_seed(0)
    # use_cache=False, as transformers' own checkpointing sets it: a layer that appends to a key/value cache
    # runs other operators when recomputed, which selective checkpointing refuses
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
                                   use_cache=False)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 64, (2, 16))

    def step():
        model.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    loss, grads = step()
    checkpoint_layers(model.model.layers, 1, "selective")
    sel_loss, sel_grads = step()
    assert torch.allclose(loss, sel_loss) and all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, sel_grads))


OFFLOAD = "precision=amp-bf16,micro_batch=4,grad_accum=2,offload=optimizer"


def test_deepspeed_offloads_the_optimizer_in_its_own_setting():
    exp = export(OFFLOAD, "deepspeed", device="cuda")
    assert exp.kwargs["zero_optimization"] == {"stage": 1, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    note = next(n for n in exp.notes if n.setting == "offload=optimizer")
    assert "zero_optimization.offload_optimizer says it" in note.why
    assert note.nearest_config == TrainConfig.parse(OFFLOAD.replace("optimizer", "none"))


@pytest.mark.parametrize("target", ["hf", "accelerate", "lightning", "json"])
def test_other_targets_give_the_code_that_offloads(target):
    exp = export(OFFLOAD, target, device="cuda")
    note = next(n for n in exp.notes if n.setting == "offload=optimizer")
    assert note.why.startswith("offload=optimizer: autofit measured torchao's CPUOffloadOptimizer")
    assert any("CPUOffloadOptimizer(model.parameters()" in line for line in note.code)
    assert "zero_optimization" not in json.dumps(exp.kwargs)


def test_a_config_without_offload_has_no_offload_note():
    exp = export("precision=amp-bf16,micro_batch=4", "deepspeed", device="cuda")
    assert "zero_optimization" not in exp.kwargs and not exp.notes


def test_deepspeeds_parser_reads_the_offload():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    parsed = DeepSpeedConfig(json.loads(export(OFFLOAD, "deepspeed", device="cuda").text))
    assert parsed.zero_optimization_stage == 1
    assert parsed.zero_config.offload_optimizer.device == "cpu" and parsed.zero_config.offload_optimizer.pin_memory


def test_the_committed_lean_search_example_exports_build_the_trainers_own_objects(tmp_path):
    """results/examples/hf-llama-lean-50MB: a search where only a lean lever fits; its answer uses it,
    and its committed exports build a real TrainingArguments and parse as a DeepSpeed config."""
    from pathlib import Path

    transformers = pytest.importorskip("transformers")
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    example = Path(__file__).resolve().parents[2] / "results" / "examples" / "hf-llama-lean-50MB"
    best = TrainConfig.from_dict(json.loads((example / "best.json").read_text())["config"])
    assert best.changes_optimizer
    hf = json.loads((example / "export-hf.json").read_text())
    args = transformers.TrainingArguments(output_dir=str(tmp_path), **hf["training_arguments"])
    assert str(getattr(args.optim, "value", args.optim)) == HF_OPTIM[best.optimizer]
    assert args.gradient_accumulation_steps == best.grad_accum
    ds = {k: v for k, v in json.loads((example / "export-deepspeed.json").read_text()).items()
          if k not in ("changes", "comment")}
    parsed = DeepSpeedConfig({**ds, "train_batch_size": best.micro_batch * best.grad_accum})
    assert parsed.gradient_accumulation_steps == best.grad_accum
    # the export is what `autofit export` writes from that study today
    assert export(best, "hf", device="cpu").kwargs == hf["training_arguments"]
