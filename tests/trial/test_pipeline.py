"""Device split through torch.distributed.pipelining: two real stage processes with gloo."""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autofit.core.config import TrainConfig
from autofit.core.errors import ConfigError
from autofit.runtime.training import build_trainee, make_micro_batches, train_step
from autofit.trial.pipeline import BREAKDOWN_KEYS, measure_split, stage_bounds
from autofit.workloads.base import Workload

# A GPT-like model small enough for CPU tests; its vocabulary is large next to its width,
# so the last stage (head, logits, loss) holds more than the first.
VOCAB, WIDTH, HEADS, N_LAYERS, SEQ = 256, 32, 2, 4, 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.fc, self.out = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):  # (B, T, C)
        B, T, C = x.shape
        q, k, v = (t.view(B, T, HEADS, C // HEADS).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, tie: bool = True):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(N_LAYERS))
        self.ln_f, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)
        if tie:
            self.head.weight = self.wte.weight  # used on the first and the last stage

    def forward(self, idx):  # (B, T) token ids -> (B, T, VOCAB) logits
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _batch(n: int):
    idx = torch.randint(0, VOCAB, (n, SEQ + 1))
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def _lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def tiny_gpt(tie: bool = True) -> Workload:
    # SGD: a parameter update is linear in the gradient, so comparing updates compares gradients.
    return Workload(name="tiny-gpt", model=lambda: TinyGPT(tie), batch=_batch, loss=_lm_loss,
                    optimizer=lambda params: torch.optim.SGD(params, lr=0.1), layers=lambda m: m.blocks,
                    tokens_per_sample=SEQ)


def tiny_gpt_untied() -> Workload:
    return tiny_gpt(tie=False)


class TinyLSTM(nn.Module):
    """Blocks that return tuples and strided outputs (nn.LSTM), as the lstm-lm built-in."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(nn.LSTM(WIDTH, WIDTH, batch_first=True) for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x, _ = block(x)
        return self.head(x)


def tiny_lstm() -> Workload:
    return Workload(name="tiny-lstm", model=TinyLSTM, batch=_batch, loss=_lm_loss,
                    optimizer=lambda params: torch.optim.SGD(params, lr=0.1), layers=lambda m: m.blocks)


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
            if x.sum() > 0:  # data-dependent control flow: torch.export cannot capture it
                x = -x
        return x


UNTRACEABLE = Workload(name="untraceable", model=DataDependent, batch=lambda n: (torch.randn(n, 4), torch.randn(n, 4)),
                       loss=F.mse_loss, layers=lambda m: m.blocks)

STEPS = dict(warmup_steps=2, measure_steps=1)  # 2 warm-up + 1 tracked + 3 timed = 6 optimizer steps


def reference(workload: Workload, config: TrainConfig, steps: int, seed: int = 0):
    """The unsplit run on the same seeds as measure_split: losses per step and final parameters."""
    config = dataclasses.replace(config, device_split=1)
    torch.manual_seed(seed)
    trainee = build_trainee(workload, config)
    torch.manual_seed(seed + 1)
    micro_batches = make_micro_batches(workload, config, torch.device("cpu"))
    losses = [float(train_step(trainee, micro_batches)) for _ in range(steps)]
    return losses, {name: p.detach().clone() for name, p in trainee.model.named_parameters()}


# One run per configuration, shared by the tests that look at it.
CONFIG = TrainConfig(micro_batch=2, grad_accum=4, device_split=2)
_runs: dict = {}


def split_run(key: str) -> dict:
    if key not in _runs:
        if key == "1f1b":  # spawned stages: the workload is re-loaded from this file by its spec
            workload = dataclasses.replace(tiny_gpt(), source=f"{__file__}:tiny_gpt")
            _runs[key] = measure_split(workload, CONFIG, device_type="cpu", budget_bytes=None,
                                       collect_params=True, **STEPS)
        elif key == "1f1b-ckpt":  # forked stages: a workload built in code, no source
            _runs[key] = measure_split(tiny_gpt(), dataclasses.replace(CONFIG, checkpoint_every=1),
                                       device_type="cpu", budget_bytes=None, **STEPS)
        elif key == "gpipe":
            _runs[key] = measure_split(tiny_gpt(), CONFIG, device_type="cpu", budget_bytes=None,
                                       schedule="gpipe", **STEPS)
    return _runs[key]


@pytest.mark.parametrize("n_layers, split, expected", [
    (4, 1, [(0, 4)]),
    (4, 2, [(0, 2), (2, 4)]),
    (5, 2, [(0, 3), (3, 5)]),
    (7, 3, [(0, 3), (3, 5), (5, 7)]),
    (12, 5, [(0, 3), (3, 6), (6, 8), (8, 10), (10, 12)]),
    (3, 3, [(0, 1), (1, 2), (2, 3)]),
])
def test_stage_bounds(n_layers, split, expected):
    bounds = stage_bounds(n_layers, split)
    assert bounds == expected
    sizes = [end - start for start, end in bounds]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("n_layers, split", [(3, 4), (1, 2), (4, 0)])
def test_stage_bounds_rejects_impossible_split(n_layers, split):
    with pytest.raises(ConfigError, match="device_split"):
        stage_bounds(n_layers, split)


def test_split_matches_unsplit_loss_and_update():
    result = split_run("1f1b")
    assert result["status"] == "ok", result["error"]
    assert result["schedule"] == "1f1b" and result["stage_layers"] == [[0, 2], [2, 4]]
    ref_losses, ref_params = reference(tiny_gpt(), CONFIG, steps=len(result["losses"]))
    assert len(result["losses"]) == 6
    assert result["losses"] == pytest.approx(ref_losses, rel=1e-5)
    split_params = result["params"]
    # The tied weight is replicated on both stages; their gradients are summed, so it stays tied.
    assert torch.equal(split_params.pop("head.weight"), split_params["wte.weight"])
    assert set(split_params) == set(ref_params)
    for name, value in split_params.items():
        torch.testing.assert_close(value, ref_params[name], rtol=1e-4, atol=1e-5, msg=name)


def test_split_reports_plausible_per_stage_peaks():
    result = split_run("1f1b")
    assert result["status"] == "ok", result["error"]
    peaks = result["per_device_peak_bytes"]
    assert len(peaks) == 2 and min(peaks) > 0 and result["peak_bytes"] == max(peaks)
    assert result["breakdown"] == result["per_device_breakdown"][peaks.index(max(peaks))]
    for stage, (peak, breakdown) in enumerate(zip(result["per_device_peak_bytes"], result["per_device_breakdown"])):
        assert set(breakdown) == set(BREAKDOWN_KEYS) and sum(breakdown.values()) == peak
        assert breakdown["activations_bytes"] > 0
    # Parameters per stage: layers split 2 + 2; the tied weight is on both stages.
    model = TinyGPT(tie=False)
    block = sum(p.numel() for p in model.blocks[0].parameters())
    wte, wpe = model.wte.weight.numel(), model.wpe.weight.numel()
    ln_f = sum(p.numel() for p in model.ln_f.parameters())
    assert result["per_device_breakdown"][0]["params_bytes"] == 4 * (wte + wpe + 2 * block)
    assert result["per_device_breakdown"][1]["params_bytes"] == 4 * (2 * block + ln_f + wte)
    # One receive buffer per micro-batch of the (micro_batch, SEQ, WIDTH) fp32 boundary tensor.
    boundary = CONFIG.micro_batch * SEQ * WIDTH * 4
    assert result["activation_recv_bytes"] == [0, CONFIG.grad_accum * boundary]
    assert result["grad_recv_bytes"] == [CONFIG.grad_accum * boundary, 0]
    assert result["step_time_s"] > 0


def test_checkpointing_on_each_stage():
    plain, ckpt = split_run("1f1b"), split_run("1f1b-ckpt")
    assert ckpt["status"] == "ok", ckpt["error"]
    config = dataclasses.replace(CONFIG, checkpoint_every=1)
    ref_losses, _ = reference(tiny_gpt(), config, steps=len(ckpt["losses"]))
    assert ckpt["losses"] == pytest.approx(ref_losses, rel=1e-5)
    assert ckpt["losses"] == pytest.approx(plain["losses"], rel=1e-5)
    for stage in range(2):
        assert (ckpt["per_device_breakdown"][stage]["activations_bytes"]
                < plain["per_device_breakdown"][stage]["activations_bytes"])


def test_gpipe_same_result_more_activations():
    plain, gpipe = split_run("1f1b"), split_run("gpipe")
    assert gpipe["status"] == "ok", gpipe["error"]
    assert gpipe["schedule"] == "gpipe"
    assert gpipe["losses"] == pytest.approx(plain["losses"], rel=1e-5)
    first_1f1b, last_1f1b = (b["activations_bytes"] for b in plain["per_device_breakdown"])
    first_gpipe, last_gpipe = (b["activations_bytes"] for b in gpipe["per_device_breakdown"])
    # GPipe holds all 4 micro-batches on both stages, so the last stage, with the embedding's
    # counterpart, the (B, T, VOCAB) logits and the loss, holds more than the first.
    assert last_gpipe > first_gpipe
    # 1F1B holds at most p - i micro-batches on stage i: 2 on the first, 1 on the last.
    assert last_1f1b < 0.5 * last_gpipe
    assert first_1f1b < first_gpipe


def test_tuple_returning_layers():
    config = TrainConfig(micro_batch=1, grad_accum=2, device_split=2)
    result = measure_split(tiny_lstm(), config, device_type="cpu", budget_bytes=None, **STEPS)
    assert result["status"] == "ok", result["error"]
    ref_losses, _ = reference(tiny_lstm(), config, steps=len(result["losses"]))
    assert result["losses"] == pytest.approx(ref_losses, rel=1e-5)


def test_amp_fp16_grad_scaler_across_stages():
    # Only the last stage scales the loss; every stage unscales and skips (or not) together.
    config = TrainConfig(precision="amp-fp16", micro_batch=1, grad_accum=2, device_split=2)
    result = measure_split(tiny_gpt(), config, device_type="cpu", budget_bytes=None, **STEPS)
    assert result["status"] == "ok", result["error"]
    ref_losses, _ = reference(tiny_gpt(), config, steps=len(result["losses"]))
    assert result["losses"] == pytest.approx(ref_losses, rel=1e-3)


def test_budget_exceeded_is_oom_not_an_exception():
    result = measure_split(tiny_gpt(), TrainConfig(micro_batch=1, grad_accum=2, device_split=2), device_type="cpu",
                           warmup_steps=2, measure_steps=1, budget_bytes=100_000)
    assert result["status"] == "oom" and "budget" in result["error"]


def _child_pids() -> set[int]:
    pids: set[int] = set()
    for children in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
        pids.update(int(pid) for pid in children.read_text().split())
    return pids


def _segfault_loss(logits, targets):
    os.kill(os.getpid(), signal.SIGSEGV)  # the loss runs on the last stage only


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_crashed_stage_is_an_error_and_leaves_no_process():
    before = _child_pids()
    crashing = dataclasses.replace(tiny_gpt(), loss=_segfault_loss)
    result = measure_split(crashing, TrainConfig(micro_batch=1, grad_accum=2, device_split=2), device_type="cpu",
                           warmup_steps=2, measure_steps=1, budget_bytes=None, timeout_s=120)
    assert result["status"] == "error"
    assert "stage 1" in result["error"] and "SIGSEGV" in result["error"]  # the cause, not stage 0's echo
    assert _child_pids() <= before


def test_untraceable_model_is_a_clear_error():
    result = measure_split(UNTRACEABLE, TrainConfig(micro_batch=2, grad_accum=2, device_split=2), device_type="cpu",
                           warmup_steps=2, measure_steps=1, budget_bytes=None, timeout_s=120)
    assert result["status"] == "error"
    assert "torch.export" in result["error"]


def test_more_stages_than_layers_is_an_error_status():
    result = measure_split(tiny_gpt(), TrainConfig(micro_batch=1, grad_accum=1, device_split=5), device_type="cpu",
                           warmup_steps=2, measure_steps=1, budget_bytes=None, timeout_s=120)
    assert result["status"] == "error" and "device_split=5" in result["error"]


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_split_on_two_gpus_matches_unsplit():
    # NCCL, stage i on cuda:i; the spawned stages re-load the workload from this file.
    workload = dataclasses.replace(tiny_gpt(), source=f"{__file__}:tiny_gpt")
    result = measure_split(workload, CONFIG, device_type="cuda", budget_bytes=None, **STEPS)
    assert result["status"] == "ok", result["error"]
    assert len(result["per_device_peak_bytes"]) == 2 and min(result["per_device_peak_bytes"]) > 0
    ref_losses, _ = reference(tiny_gpt(), CONFIG, steps=len(result["losses"]))
    assert result["losses"] == pytest.approx(ref_losses, rel=1e-4)
