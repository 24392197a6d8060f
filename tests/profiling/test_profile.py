"""Golden values for the profiler, hand-computed for small GPT presets."""

import pytest
import torch

from autofit.core.config import Precision
from autofit.profiling.cache import cache_path, profile_key
from autofit.profiling.data import Profile
from autofit.profiling.precision import profile_precision
from autofit.profiling.profile import profile_workload
from autofit.workloads.gpt import gpt_preset

# gpt-tiny: vocab V, positions S, L layers of width h, tied head (see autofit/workloads/gpt.py)
V, S, L, H, HEADS = 4096, 128, 4, 192, 4


def gpt_param_count(V, S, L, h):
    embeddings = V * h + S * h                     # token + learned positions (head tied to wte)
    attention = (h * 3 * h + 3 * h) + (h * h + h)  # c_attn (qkv) + c_proj, with biases
    mlp = (h * 4 * h + 4 * h) + (4 * h * h + h)    # c_fc + c_proj
    norms = 2 * 2 * h                              # ln_1, ln_2: weight + bias
    return embeddings + L * (attention + mlp + norms) + 2 * h  # + ln_f


@pytest.fixture(scope="module")
def tiny():
    return gpt_preset("gpt-tiny")


def test_exact_parameter_count(tiny):
    _, param_count, n_layers = profile_key(tiny, "cpu")
    assert param_count == gpt_param_count(V, S, L, H) == 2_590_848
    assert n_layers == L


@pytest.mark.parametrize("precision, bytes_per_param", [
    (Precision.FP32, 16), (Precision.AMP_BF16, 16), (Precision.BF16, 8),
])
def test_adamw_model_states(tiny, precision, bytes_per_param):
    # split_ends=False here and below: these tests read layers and model states, not a split's ends
    """AdamW: weights + grads + exp_avg + exp_avg_sq = 4+4+8 (fp32 and autocast), 2+2+4 (bf16);
    plus one fp32 `step` scalar per parameter tensor."""
    pp = profile_precision(tiny, precision, split_ends=False)
    n = gpt_param_count(V, S, L, H)
    n_tensors = 2 + L * 12 + 2  # wte, wpe; per block 12 weights/biases; ln_f weight + bias
    model_state = pp.static_param_bytes + pp.grad_bytes + pp.optimizer_bytes
    assert model_state == bytes_per_param * n + 4 * n_tensors


def korthikanti_bytes(s, b, h, a):
    """Per-layer activation bytes in 16-bit with dropout (Korthikanti et al. 2022, Eq. 1)."""
    return s * b * h * (34 + 5 * a * s / h)


@pytest.mark.parametrize("seq_len", [64, 128])
def test_korthikanti_per_layer_activations_plain_attention(seq_len):
    """Plain attention + dropout in bf16: a middle layer keeps sbh(34 + 5as/h) bytes.

    The profile counts a layer's own new tensors; its input (2sbh, saved by ln_1) is the
    previous layer's output, so one layer's delta equals the formula for the layer."""
    wl = gpt_preset("gpt-tiny", attention="plain", dropout=0.1, seq_len=seq_len)
    pp = profile_precision(wl, Precision.BF16, split_ends=False)
    per_sample = pp.layers[1].forward.delta[1]
    expected = korthikanti_bytes(seq_len, 1, H, HEADS)
    assert per_sample == pytest.approx(expected, rel=0.05)
    assert pp.layers[1].forward.delta[0] == pytest.approx(0, abs=64)  # nothing batch-independent


def test_fused_attention_has_no_quadratic_term():
    """With scaled_dot_product_attention (no dropout: the fused CPU kernel has none) the layer's
    activations grow linearly in s: doubling s doubles them, and they sit near 32sbh (34sbh
    minus the two 1-byte dropout masks)."""
    per_sbh = {}
    for s in (64, 128, 256):
        pp = profile_precision(gpt_preset("gpt-tiny", attention="sdpa", dropout=0.0, seq_len=s), Precision.BF16, split_ends=False)
        per_sbh[s] = pp.layers[1].forward.delta[1] / (s * H)
    assert per_sbh[64] == pytest.approx(per_sbh[256], rel=0.01)
    assert per_sbh[128] == pytest.approx(32, rel=0.05)
    plain = profile_precision(gpt_preset("gpt-tiny", attention="plain", dropout=0.0, seq_len=256), Precision.BF16, split_ends=False)
    # without dropout, plain attention keeps only the softmax output per head: 2as^2b bytes
    plain_per_sbh = plain.layers[1].forward.delta[1] / (256 * H)
    assert plain_per_sbh == pytest.approx(per_sbh[256] + 2 * HEADS * 256 / H, rel=0.02)


def test_autocast_keeps_fp32_states_and_saves_half_weight_copies(tiny):
    fp32 = profile_precision(tiny, Precision.FP32, split_ends=False)
    amp = profile_precision(tiny, Precision.AMP_BF16, split_ends=False)
    assert amp.static_param_bytes == fp32.static_param_bytes
    assert amp.optimizer_bytes == fp32.optimizer_bytes
    # the batch-independent part of a layer's saved tensors: bf16 copies of its matmul weights
    matmul_weights = (3 * H * H + H * H + 4 * H * H + 4 * H * H)
    assert amp.layers[1].forward.delta[0] == pytest.approx(2 * matmul_weights, rel=0.02)


def test_cache_round_trip_and_key_changes(tmp_path, monkeypatch, tiny):
    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path))
    first = profile_workload(tiny, [Precision.FP32])
    assert list(tmp_path.glob("*.json"))
    again = profile_workload(tiny, [Precision.FP32])
    assert again.precisions == first.precisions
    assert Profile.from_json(first.to_json()).precisions == first.precisions
    changed = gpt_preset("gpt-tiny", dropout=0.1)
    assert profile_key(changed, "cpu")[0] != profile_key(tiny, "cpu")[0]
    assert profile_key(tiny, "cuda")[0] != profile_key(tiny, "cpu")[0]


def test_corrupt_cache_is_rebuilt(tmp_path, monkeypatch, tiny):
    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path))
    path = cache_path(tiny.name, "cpu", profile_key(tiny, "cpu")[0])  # where a profile would have been cached
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json")
    assert profile_workload(tiny, [Precision.FP32]).for_precision("fp32").grad_bytes > 0
    assert Profile.from_json(path.read_text()).for_precision("fp32").grad_bytes > 0  # rewritten whole


def test_profiling_allocates_no_real_weights():
    """Two llama-1b layers with its 128k-token embedding (770 MB of bf16 weights, 3 GB with
    gradients and AdamW state) profile within a small memory increase."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    pp = profile_precision(gpt_preset("llama-1b", n_layer=2), Precision.BF16)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    model_state = pp.static_param_bytes + pp.grad_bytes + pp.optimizer_bytes
    assert model_state > 3 * 10**9
    assert grown_kib < 300_000  # a tenth of what the tensors would take


class _TiedLM(torch.nn.Module):
    """An embedding and an output head sharing one weight (one Parameter used twice)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(512, 32)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU())
                                          for _ in range(2))
        self.head = torch.nn.Linear(32, 512, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _tied_batch(n):
    tokens = torch.randint(0, 512, (n, 17))
    return tokens[:, :-1], tokens[:, 1:]


def _tied_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_tied_weight_estimate_matches_measured_peak(precision):
    from autofit import TrainConfig
    from autofit.estimator.memory_model import estimate
    from autofit.trial.measure import measure_trial
    from autofit.workloads.base import Workload

    w = Workload(name="tied-lm", model=_TiedLM, batch=_tied_batch, loss=_tied_loss)
    profile = profile_workload(w, [precision], use_cache=False)
    weight_bytes = 512 * 32 * (4 if precision == "fp32" else 2)
    assert profile.for_precision(precision).grad_bytes < 2 * weight_bytes  # the shared weight's gradient once
    config = TrainConfig.parse(f"precision={precision},micro_batch=2")
    measured = measure_trial(w, config, measure_steps=1)
    assert measured["status"] == "ok", measured["error"]
    predicted = estimate(profile, config).peak_bytes
    assert abs(predicted - measured["peak_bytes"]) / measured["peak_bytes"] <= 0.01


class _LogitsFromLastBlock(torch.nn.Module):
    """Embedding then three Linear blocks; the last block's output is the logits unless ``head``
    (then the third Linear is a head after the list: the same ops, cut differently)."""

    def __init__(self, head: bool) -> None:
        super().__init__()
        vocab, dim = 64, 32
        blocks = [torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim), torch.nn.Linear(dim, vocab)]
        self.emb = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(blocks[:2] if head else blocks)
        self.head = blocks[2] if head else torch.nn.Identity()

    def forward(self, x):  # (B, 8) tokens -> (B, 8, 64) logits
        x = self.emb(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_a_model_whose_last_block_output_is_the_logits():
    """Nothing after the layer list (its last output's gradient reaches the model's and the
    layer's hooks at once) profiles, and the unsplit peak is that of the same ops with a head."""
    import torch.nn.functional as F

    from autofit.core.config import TrainConfig
    from autofit.estimator.memory_model import estimate_table
    from autofit.workloads.base import Workload

    def workload(head: bool) -> Workload:
        return Workload(name=f"logits-head{int(head)}", model=lambda: _LogitsFromLastBlock(head),
                        batch=lambda n: (torch.randint(0, 64, (n, 8)), torch.randint(0, 64, (n, 8))),
                        loss=lambda out, y: F.cross_entropy(out.reshape(-1, 64), y.reshape(-1)))

    configs = [TrainConfig(p, mb) for p in ("fp32", "amp-bf16") for mb in (2, 16)]
    profiles = [profile_workload(workload(head), ["fp32", "amp-bf16"], use_cache=False) for head in (False, True)]
    peaks = [estimate_table(profile, configs)["peak_bytes"].tolist() for profile in profiles]
    assert peaks[0] == peaks[1] and all(p > 0 for p in peaks[0])
    # checkpointing and a split of the list (cut differently from the head model's) are estimated too
    more = estimate_table(profiles[0], [TrainConfig("fp32", 16, 1, 1), TrainConfig("fp32", 16, 1, 0, 3)])
    assert (more["peak_bytes"] > 0).all()


def test_workers_forked_from_the_fork_server_profile_as_this_process(tmp_path, monkeypatch, trial_workload_spec):
    """With the fork server up, all precisions but one are forked (a worker each) and that one is profiled
    here; while it starts, this process profiles, and the precisions left when it is up are forked; if
    it never comes, this process profiles them all. Each way, the profile is the one this process makes
    alone, byte for byte, untied ends included."""
    import json
    import os
    import time

    from autofit.profiling import workers as profile_workers
    from autofit.runtime import forkserver
    from autofit.workloads.load import load_workload

    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)  # workers even on a one-core machine
    forked = []
    start = forkserver.start_trial
    monkeypatch.setattr(forkserver, "start_trial", lambda entry, *a, **k: forked.append(entry) or start(entry, *a, **k))
    monkeypatch.setattr(forkserver, "start_server_soon", lambda extra=None: None)  # each case says when the server is up
    workload = load_workload(trial_workload_spec("tiny_tied_lm"))
    precisions = [Precision.FP32, Precision.AMP_BF16, Precision.BF16]

    def profiled() -> dict:
        profile = json.loads(profile_workload(workload, precisions, use_cache=False).to_json())
        profile.pop("profile_s")
        return profile

    def up_after_one_here(m) -> None:
        """The server comes up once this process has profiled one precision, which waits for the forks."""
        here, ensure, one = [], forkserver.ensure_server, profile_workers.profile_one
        m.setattr(forkserver, "ensure_server", lambda: (_wait_for(lambda: here), ensure())[1])

        def profile_here(*args):
            out = one(*args)
            here.append(args[1])
            _wait_for(lambda: len(forked) == 4)
            return out
        m.setattr(profile_workers, "profile_one", profile_here)

    def _wait_for(condition, timeout_s=120.0):
        end = time.monotonic() + timeout_s
        while not condition() and time.monotonic() < end:
            time.sleep(0.01)

    try:
        forkserver.ensure_server()
        there = profiled()
        assert forked == ["autofit.profiling.workers:profile_child"] * 2
        assert there["precisions"]["fp32"]["split_ends"] is not None
        forkserver.stop_server()
        with monkeypatch.context() as m:
            up_after_one_here(m)
            coming = profiled()
        assert len(forked) == 4  # the two precisions left
        forkserver.stop_server()
        with monkeypatch.context() as m:  # a fork server that cannot start
            m.setattr(forkserver, "ensure_server", lambda: (_ for _ in ()).throw(OSError("no server")))
            alone = profiled()
        assert len(forked) == 4
        monkeypatch.setenv("AUTOFIT_PROFILE_WORKERS", "1")
        here = profiled()
    finally:
        forkserver.stop_server()
    assert there == coming == alone == here


def test_the_optimizer_steps_in_one_profiled_run_of_the_two(tiny):
    """The optimizer's state and step do not depend on the micro-batch: only the fake run at the larger
    micro-batch makes the state and steps (two steps), not the smaller one nor the real check's run;
    the model states stay exact (test_adamw_model_states)."""
    import dataclasses

    steps = []

    def counted(params):
        optimizer = tiny.optimizer(params)
        optimizer.register_step_post_hook(lambda *_: steps.append(1))
        return optimizer

    pp = profile_precision(dataclasses.replace(tiny, optimizer=counted), Precision.FP32, split_ends=False)
    assert pp.real_check.startswith("real step")  # the real run took place, without an optimizer step
    assert len(steps) == 2  # the state's warm-up and the profiled step, at the larger micro-batch
    assert pp.optimizer_bytes > 0 and pp.optimizer_peak_bytes > 0
