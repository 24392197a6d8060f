"""``--model hf:SPEC``: configs resolved offline, tasks, one-line errors (tiny configs only)."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from autofit import WorkloadError, hf_workload, load_workload  # noqa: E402
from autofit.cli import main  # noqa: E402

TINY_LLAMA = "llama?num_hidden_layers=2&hidden_size=64&intermediate_size=128&num_attention_heads=4&vocab_size=128"


def test_model_type_with_overrides_builds_that_config():
    w = hf_workload("hf:" + TINY_LLAMA, seq_len=16)
    model = w.model()
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 64
    assert model.config.head_dim == 16  # derived from the overrides, not the 7B default of 128
    inputs, labels = w.batch(3)
    assert inputs.shape == (3, 16) and labels is inputs  # causal LM: labels are the inputs
    loss = w.loss(model(inputs), labels)
    assert loss.ndim == 0 and 3.0 < float(loss.detach()) < 7.0  # ~ln(128) for random init


def test_alias_override_and_default_seq_len():
    w = load_workload("hf:gpt2?num_hidden_layers=1&n_embd=32&n_head=2&vocab_size=64")
    model = w.model()
    assert model.config.n_layer == 1
    assert w.batch(1)[0].shape == (1, 1024)  # GPT-2's n_positions
    assert w.tokens_per_sample == 1024


def test_local_dir_and_json_file_take_precedence(tmp_path):
    config = transformers.Qwen3Config(num_hidden_layers=3, hidden_size=32, intermediate_size=64,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=96)
    config.save_pretrained(tmp_path / "llama")  # a directory named like a model_type: the directory wins
    w = hf_workload(f"{tmp_path / 'llama'}?intermediate_size=48", seq_len=8)
    assert type(w.model()).__name__ == "Qwen3ForCausalLM"
    assert w.model().config.intermediate_size == 48
    w2 = hf_workload(str(tmp_path / "llama" / "config.json"))
    assert w2.model().config.num_hidden_layers == 3


def test_source_round_trips_through_load_workload():
    w = hf_workload(TINY_LLAMA, seq_len=12, task="seq-cls")
    again = load_workload(w.source)
    assert again.source == w.source and again.meta["task"] == "seq-cls"
    inputs, labels = again.batch(2)
    assert inputs.shape == (2, 12) and labels.shape == (2,)
    assert type(again.model()).__name__ == "LlamaForSequenceClassification"


def test_encoder_and_vision_default_tasks():
    bert = hf_workload("bert?num_hidden_layers=1&hidden_size=32&num_attention_heads=2&intermediate_size=64"
                       "&vocab_size=50", seq_len=8)
    assert bert.meta["task"] == "seq-cls"
    vit = hf_workload("vit?num_hidden_layers=1&hidden_size=32&num_attention_heads=2&intermediate_size=64"
                      "&image_size=32&patch_size=8")
    assert vit.meta["task"] == "image-cls" and vit.tokens_per_sample is None
    pixels, labels = vit.batch(2)
    assert pixels.shape == (2, 3, 32, 32)
    model = vit.model()
    assert float(vit.loss(model(pixels), labels).detach()) > 0


@pytest.mark.parametrize("spec, message", [
    ("hf:llama?no_such_field=3", "LlamaConfig has no field 'no_such_field'"),
    ("hf:llama?hidden_size=big", "'hidden_size' expected int"),
    ("hf:llama?hidden_size", "expected field=value"),
    ("hf:some-org/not-cached-model", "needs the network"),
])
def test_bad_specs_are_one_line_errors(spec, message, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = main(["estimate", "--model", spec, "--budget", "1GB", "--config", "micro_batch=1"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_hf_options_need_an_hf_model(capsys):
    assert main(["estimate", "--model", "gpt-tiny", "--seq-len", "64", "--budget", "1GB"]) == 2
    assert "--seq-len applies to hf: models only" in capsys.readouterr().err


def test_bad_lora_is_a_one_line_error():
    with pytest.raises(WorkloadError, match="invalid --lora item 'rank=8'"):
        hf_workload(TINY_LLAMA, lora="rank=8")


def test_estimate_json_for_an_hf_model(capsys):
    code = main(["estimate", "--model", "hf:" + TINY_LLAMA, "--seq-len", "16", "--budget", "1GB", "--device", "cpu",
                 "--config", "precision=bf16,micro_batch=2,checkpoint_every=1", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["fits"] is True and data["workload"] == "hf-llama"
    n_params = data["param_count"]
    assert data["model_state_bytes"] >= 8 * n_params  # bf16 weights, grads and AdamW's two states


def test_lora_estimate_drops_grads_and_optimizer_state_to_the_adapter():
    from autofit import TrainConfig
    from autofit.estimator.memory_model import estimate
    from autofit.profiling.profile import profile_workload
    from autofit.trial.measure import measure_trial

    pytest.importorskip("peft")
    w = hf_workload("llama?num_hidden_layers=2&hidden_size=128&intermediate_size=256&num_attention_heads=2"
                    "&vocab_size=4096", seq_len=64, lora="r=4")
    model = w.model()
    adapter = [p for n, p in model.named_parameters() if p.requires_grad]
    assert adapter and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    adapter_bytes = 4 * sum(p.numel() for p in adapter)
    pp = profile_workload(w, ["fp32"], use_cache=False).for_precision("fp32")
    assert pp.grad_bytes == adapter_bytes
    assert pp.optimizer_bytes == 2 * adapter_bytes + 4 * len(adapter)  # exp_avg, exp_avg_sq, a step per tensor
    config = TrainConfig.parse("precision=fp32,micro_batch=4,checkpoint_every=1")
    predicted = estimate(profile_workload(w, ["fp32"]), config).peak_bytes
    measured = measure_trial(w, config, measure_steps=1)
    assert measured["status"] == "ok", measured["error"]
    assert abs(predicted - measured["peak_bytes"]) / measured["peak_bytes"] <= 0.02


def test_two_stage_split_matches_unsplit_loss_and_update():
    """Hand-cut stages of a Llama (gloo, two processes): the same losses and parameters as unsplit."""
    import torch

    from autofit import TrainConfig
    from autofit.runtime.training import build_trainee, make_micro_batches, train_step
    from autofit.trial.pipeline import measure_split

    w = hf_workload("hf:" + TINY_LLAMA, seq_len=16)
    config = TrainConfig(micro_batch=2, grad_accum=4, device_split=2)
    result = measure_split(w, config, device_type="cpu", budget_bytes=None, collect_params=True,
                           warmup_steps=2, measure_steps=1)
    assert result["status"] == "ok", result["error"]
    torch.manual_seed(0)
    trainee = build_trainee(w, TrainConfig(micro_batch=2, grad_accum=4))
    torch.manual_seed(1)
    micro_batches = make_micro_batches(w, config, torch.device("cpu"))
    losses = [float(train_step(trainee, micro_batches)) for _ in range(len(result["losses"]))]
    assert result["losses"] == pytest.approx(losses, rel=1e-4)
    reference = dict(trainee.model.named_parameters())
    assert set(result["params"]) == set(reference)
    for name, value in result["params"].items():
        torch.testing.assert_close(value, reference[name].detach(), rtol=1e-4, atol=1e-5, msg=name)


def test_a_model_that_cannot_be_cut_is_refused_with_the_reason():
    from autofit.workloads.hf.stages import cut_stage

    bert = hf_workload("bert?num_hidden_layers=2&hidden_size=32&num_attention_heads=2&intermediate_size=64"
                       "&vocab_size=50", seq_len=8, task="causal-lm")
    import torch
    with pytest.raises(WorkloadError, match="cannot be split into pipeline stages"):
        cut_stage(bert.model(), [(0, 1), (1, 2)], 0, torch.zeros(1, 8, dtype=torch.long))


# Decoders whose base names its parts otherwise than Llama does: Phi (final_layernorm, embed_dropout),
# GPT-NeoX (gpt_neox.embed_in, emb_dropout, final_layer_norm) and Gemma (an embedding that scales
# itself, tied to the head).
OTHER_LAYOUTS = {
    "phi": "phi?num_hidden_layers=2&hidden_size=32&intermediate_size=64&num_attention_heads=2&vocab_size=64",
    "gpt_neox": "gpt_neox?num_hidden_layers=2&hidden_size=32&intermediate_size=64&num_attention_heads=2&vocab_size=64",
    "gemma": "gemma?num_hidden_layers=2&hidden_size=32&intermediate_size=64&num_attention_heads=2"
             "&num_key_value_heads=1&head_dim=16&vocab_size=64",
}


@pytest.mark.parametrize("name", sorted(OTHER_LAYOUTS))
def test_stages_of_other_rotary_layouts_reproduce_the_unsplit_logits(name):
    from autofit.workloads.hf.stages import cut_stage

    w = hf_workload(OTHER_LAYOUTS[name], seq_len=8)
    example = torch.randint(0, 64, (2, 8))
    torch.manual_seed(0)
    full = w.model().eval()
    with torch.no_grad():
        expected = full(example).logits
    stages = []
    for rank in (0, 1):
        torch.manual_seed(0)  # the same weights in every stage
        stage, replicated = cut_stage(w.model().eval(), [(0, 1), (1, 2)], rank, example)
        stages.append(stage)
    with torch.no_grad():
        staged = stages[1](stages[0](example))
    torch.testing.assert_close(staged, expected)
    prefix = "gpt_neox.embed_in" if name == "gpt_neox" else "model.embed_tokens"
    assert replicated == ([{0: f"{prefix}.weight", 1: "lm_head.weight"}] if name == "gemma" else [])
    embedding = prefix.split(".")[1]
    assert stages[0].lm_head is None and getattr(getattr(stages[1], prefix.split(".")[0]), embedding) is None


def test_a_model_whose_layers_need_more_than_the_stages_give_is_refused_with_the_reason():
    from autofit.workloads.hf.stages import cut_stage

    # rotary (alibi=false), but its layers still take an alibi argument
    falcon = hf_workload("falcon?num_hidden_layers=2&hidden_size=32&num_attention_heads=2&vocab_size=64", seq_len=8)
    with pytest.raises(WorkloadError, match="FalconForCausalLM cannot be split: its layers take more"):
        cut_stage(falcon.model(), [(0, 1), (1, 2)], 0, torch.zeros(1, 8, dtype=torch.long))


def test_builtin_llama_7b_and_default_hf_llama_agree():
    """Same parameter count, weights, gradients and AdamW state (bf16, built on the meta device);
    AdamW's only difference is its 4-byte ``step`` per tensor (the built-in fuses q, k, v)."""
    import torch

    from autofit.workloads import BUILTINS

    def model_state(workload):
        with torch.device("meta"):
            params = list(workload.model().to(torch.bfloat16).parameters())
            optimizer = workload.optimizer(params)
            for p in params:
                p.grad = torch.zeros_like(p)
            optimizer.step()
        state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        return (sum(p.numel() for p in params), nbytes(params), nbytes(p.grad for p in params),
                nbytes(state) - 4 * len(params))

    builtin, hf = model_state(BUILTINS["llama-7b"]()), model_state(hf_workload("llama"))
    assert builtin == hf
    assert builtin[0] == 6_738_415_616


def test_splits_of_a_model_that_cannot_be_cut_are_pruned_with_the_reason():
    from autofit import TrainConfig
    from autofit.estimator.memory_table import estimate_table
    from autofit.profiling.profile import profile_workload

    vit = hf_workload("vit?num_hidden_layers=2&hidden_size=32&num_attention_heads=2&intermediate_size=64"
                      "&image_size=32&patch_size=8")
    profile = profile_workload(vit, ["fp32"], use_cache=False)
    table = estimate_table(profile, [TrainConfig(micro_batch=2), TrainConfig(micro_batch=2, device_split=2)])
    assert list(table["valid"]) == [True, False]
    assert "ViTForImageClassification cannot be split into pipeline stages" in table["reason"][1]
    llama = profile_workload(hf_workload(TINY_LLAMA, seq_len=8), ["fp32"], use_cache=False)
    assert llama.split_refusal is None


@pytest.mark.parametrize("tie", ["true", "false"])
def test_tied_embeddings_are_tied_in_the_profile_and_estimated_right(tie):
    from autofit import TrainConfig
    from autofit.estimator.memory_model import estimate
    from autofit.profiling.cache import profile_key
    from autofit.profiling.profile import profile_workload
    from autofit.trial.measure import measure_trial

    w = hf_workload(f"gpt2?n_layer=2&n_embd=64&n_head=2&vocab_size=2048&tie_word_embeddings={tie}", seq_len=32)
    model = w.model()
    real_count = sum(p.numel() for p in model.parameters())  # parameters() yields a shared one once
    assert profile_key(w, "cpu")[1] == real_count  # the fake build shares what the real one shares
    config = TrainConfig.parse("precision=fp32,micro_batch=2")
    predicted = estimate(profile_workload(w, ["fp32"], use_cache=False), config).peak_bytes
    measured = measure_trial(w, config, measure_steps=1)
    assert measured["status"] == "ok", measured["error"]
    assert abs(predicted - measured["peak_bytes"]) / measured["peak_bytes"] <= 0.01


@pytest.mark.parametrize("use_cache", [True, False])
def test_a_user_built_model_that_caches_keys_while_training_is_warned_about(use_cache, caplog):
    """transformers' use_cache keeps every layer's keys and values alive beside what backward needs: the
    profile sees it (the layers' retained bytes) and says so (hf: workloads turn it off themselves)."""
    from autofit import Workload
    from autofit.profiling.profile import profile_workload

    def model():
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0,
            use_cache=use_cache))

    workload = Workload(name=f"gpt2-cache-{use_cache}", model=model, batch=lambda n: (torch.randint(0, 64, (n, 16)),) * 2,
                        loss=lambda out, labels: torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), labels.flatten()),
                        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    profile_workload(workload, ["fp32"], use_cache=False)
    warned = [r for r in caplog.records if r.levelname == "WARNING" and "set use_cache=False" in r.getMessage()]
    assert len(warned) == (1 if use_cache else 0)


def test_a_model_type_resolves_where_transformers_exports_no_top_level_config_mapping(monkeypatch, tmp_path):
    # transformers 5.17 (the H200's) has no transformers.CONFIG_MAPPING; the spec reads the auto module's
    monkeypatch.delattr(transformers, "CONFIG_MAPPING", raising=False)
    lazy_getattr = type(transformers).__getattr__  # transformers' lazy module would import it again

    def getattr_without_config_mapping(module, name):
        if name == "CONFIG_MAPPING":
            raise AttributeError("module 'transformers' has no attribute 'CONFIG_MAPPING'")
        return lazy_getattr(module, name)

    monkeypatch.setattr(type(transformers), "__getattr__", getattr_without_config_mapping)
    from autofit.workloads.hf.spec import resolve_config

    assert type(resolve_config("llama?num_hidden_layers=2")).__name__ == "LlamaConfig"
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    assert resolve_config(str(path)).n_layer == 2


def test_a_trial_of_an_hf_model_imports_its_modelling_module_which_the_fork_server_preloads():
    import importlib.util
    import sys

    w = hf_workload(TINY_LLAMA, seq_len=12, lora="r=4")
    assert w.preload == ("transformers", "transformers.modeling_utils", "transformers.models.llama.modeling_llama", "peft")
    assert all(importlib.util.find_spec(m) is not None for m in w.preload)
    w.model()
    assert all(m in sys.modules for m in w.preload)  # what building the model imports: nothing preloaded in vain
    assert "peft" not in hf_workload(TINY_LLAMA, seq_len=12).preload
