"""Tiny workloads shared by the tests, loaded by ``tests/trial_workloads.py:function`` source strings.

``tiny_lm`` (spec :data:`TINY_LM`) is the search tests' language model; the MLPs are the trial
tests'.

Some misbehave on purpose (raise, segfault, hang). A workload that sees ``AUTOFIT_TEST_PIDFILE``
in its environment appends its process id there (and the hang one its grandchild's), so a
test can check that the process is gone afterwards.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from autofit.workloads.base import Workload

DIM, CLASSES = 32, 8
LM_VOCAB, LM_DIM, LM_SEQ = 64, 32, 8
TINY_LM = f"{Path(__file__).resolve()}:tiny_lm"  # the --model spec of tiny_lm()
SLOW_TINY_LM = f"{Path(__file__).resolve()}:slow_tiny_lm"
SLOW_STEP_S = 0.2


class Block(nn.Module):
    """x + GELU(Linear(x)): the residual inside the block, so blocks chain (checkpointing needs it)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, dim) -> (B, dim)
        return x + F.gelu(self.fc(x))


class MLP(nn.Module):
    """Deterministic (no dropout) residual MLP: ``blocks`` is the layer list."""

    def __init__(self, dim: int = DIM, depth: int = 4, classes: int = CLASSES) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, dim)
        for block in self.blocks:
            x = block(x)
        return self.head(x)  # (B, classes)


def _record_pid(*pids: int) -> None:
    path = os.environ.get("AUTOFIT_TEST_PIDFILE")
    if path:
        with open(path, "a") as f:
            f.write("".join(f"{pid}\n" for pid in pids))


def mlp_workload(name: str = "tiny-mlp", dim: int = DIM, depth: int = 4, batch=None, loss=None) -> Workload:
    """A tiny MLP classifier; ``batch``/``loss`` override the defaults (to misbehave)."""

    def make_batch(n: int):
        generator = torch.Generator().manual_seed(n)
        return torch.randn(n, dim, generator=generator), torch.randint(0, CLASSES, (n,), generator=generator)

    def make_model() -> nn.Module:
        torch.manual_seed(0)
        return MLP(dim, depth)

    return Workload(name=name, model=make_model, batch=batch or make_batch, loss=loss or F.cross_entropy,
                    tokens_per_sample=1)


def tiny() -> Workload:
    _record_pid(os.getpid())
    return mlp_workload()


def tiny_sgd() -> Workload:
    """The tiny MLP trained with SGD and momentum: an optimizer the lean levers do not replace."""
    import dataclasses

    return dataclasses.replace(mlp_workload(name="tiny-mlp-sgd"),
                               optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))


def wide() -> Workload:
    """About 1 MiB of weights: a small budget is exceeded for sure."""
    _record_pid(os.getpid())
    return mlp_workload(name="wide-mlp", dim=256)


def raising() -> Workload:
    _record_pid(os.getpid())

    def bad_loss(outputs, targets):
        raise ValueError("loss exploded\nshape mismatch (8, 8) vs (8,)")

    return mlp_workload(name="raising", loss=bad_loss)


def segfault() -> Workload:
    _record_pid(os.getpid())

    def crashing_batch(n: int):
        os.kill(os.getpid(), signal.SIGSEGV)
        time.sleep(60)

    return mlp_workload(name="segfault", batch=crashing_batch)


def hang() -> Workload:
    """Starts a grandchild (as a pipeline stage would), then hangs in batch()."""

    def hanging_batch(n: int):
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        _record_pid(os.getpid(), helper.pid)
        time.sleep(600)

    return mlp_workload(name="hang", batch=hanging_batch)


def picky() -> Workload:
    """The tiny MLP, except that a batch of 3 segfaults and a batch of 5 hangs: several trials of one
    source, some of which misbehave."""
    _record_pid(os.getpid())
    plain = mlp_workload()

    def picky_batch(n: int):
        if n == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
            time.sleep(60)
        if n == 5:
            time.sleep(600)
        return plain.batch(n)

    return mlp_workload(name="picky", batch=picky_batch)


def noisy() -> Workload:
    """Prints to stdout: must not reach the parent's stdout (the --json contract)."""
    print("hello from the workload")
    return mlp_workload(name="noisy")


class LMBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(LM_DIM)
        self.fc = nn.Linear(LM_DIM, LM_DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, LM_DIM)
        return x + F.gelu(self.fc(self.norm(x)))


class TinyLM(nn.Module):
    """An embedding, four residual blocks and a head: the profiler can follow gradients into the first block."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(LM_VOCAB, LM_DIM)
        self.blocks = nn.ModuleList(LMBlock() for _ in range(4))
        self.head = nn.Linear(LM_DIM, LM_VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, LM_VOCAB)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def tiny_lm_batch(n: int):
    """``n`` sequences of ``LM_SEQ`` tokens and their next tokens (deterministic per n)."""
    generator = torch.Generator().manual_seed(n)
    tokens = torch.randint(0, LM_VOCAB, (n, LM_SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def tiny_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def tiny_lm() -> Workload:
    """The search tests' workload: a few hundred KiB, trials dominated by process start."""
    return Workload(name="tiny-lm", model=TinyLM, batch=tiny_lm_batch, loss=tiny_lm_loss, tokens_per_sample=LM_SEQ)


class SlowLM(TinyLM):
    """TinyLM whose real forward sleeps :data:`SLOW_STEP_S`: its trials last seconds, not a fraction
    of one, so a test can catch one running (fake tensors, as when profiling, do not sleep)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if not is_fake(tokens):
            time.sleep(SLOW_STEP_S)
        return super().forward(tokens)


def slow_tiny_lm() -> Workload:
    return Workload(name="slow-tiny-lm", model=SlowLM, batch=tiny_lm_batch, loss=tiny_lm_loss, tokens_per_sample=LM_SEQ)


class TiedLM(TinyLM):
    """TinyLM with its head tied to its embedding (the profiler also profiles the untied ends)."""

    def __init__(self) -> None:
        super().__init__()
        self.head.weight = self.embed.weight


def tiny_tied_lm() -> Workload:
    return Workload(name="tiny-tied-lm", model=TiedLM, batch=tiny_lm_batch, loss=tiny_lm_loss, tokens_per_sample=LM_SEQ)


class MaskedBlock(LMBlock):
    """An LMBlock that takes a boolean key-padding mask (B, T) and zeroes the masked positions."""

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.fc(self.norm(x))) * keep.unsqueeze(-1)


class MaskedLM(TinyLM):
    """TinyLM that builds a padding mask from its tokens, reading a value to do it (``if not keep.all()``):
    its forward cannot run on the meta device (``Tensor.item() cannot be called on meta tensors``), as
    transformers' mask code cannot; the layer probe captures its layer's inputs on a real model."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MaskedBlock() for _ in range(4))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        keep = tokens != 0
        if not keep.all():  # a value read: Tensor.item() cannot be called on meta tensors
            keep = keep & (keep.cumsum(-1) > 0)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, keep)
        return self.head(x)


def masked_lm() -> Workload:
    return Workload(name="masked-lm", model=MaskedLM, batch=tiny_lm_batch, loss=tiny_lm_loss, tokens_per_sample=LM_SEQ)


class ExplodingBlock(LMBlock):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("the layer exploded\nits second line")


class ExplodingLM(TinyLM):
    """TinyLM whose layers raise when run (the layer probe's forced failure)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ExplodingBlock() for _ in range(4))


class AutocastRefusingBlock(LMBlock):
    """Fails under CPU autocast only, as oneDNN's LSTM does under bf16 autocast on an AVX2 CPU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled("cpu"):
            raise RuntimeError("could not create a primitive descriptor for this layer")
        return super().forward(x)


class AutocastRefusingLM(TinyLM):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(AutocastRefusingBlock() for _ in range(4))


def autocast_refusing_layer() -> Workload:
    return Workload(name="autocast-refusing-layer", model=AutocastRefusingLM, batch=tiny_lm_batch,
                    loss=tiny_lm_loss, tokens_per_sample=LM_SEQ)


def exploding_layer() -> Workload:
    return Workload(name="exploding-layer", model=ExplodingLM, batch=tiny_lm_batch, loss=tiny_lm_loss,
                    tokens_per_sample=LM_SEQ)
