"""A mixture-of-experts language model written as users write one: a top-k router and a loop over the
experts that picks each expert's tokens with ``torch.where`` (how many is data, which a fake tensor does
not have). ``moe_lm`` is its workload; ``top1_lm`` routes each token to one expert; ``value_gated_lm``
selects tokens by their activations' values (no router): it cannot be profiled."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from autofit.workloads.base import Workload

VOCAB, DIM, HIDDEN, SEQ, EXPERTS, TOP_K = 100, 48, 96, 16, 4, 2
MOE_LM = f"{Path(__file__).resolve()}:moe_lm"


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.up(x)))


class MoE(nn.Module):
    """Top-k routing; each expert runs on the tokens routed to it, weighted by its routing score."""

    def __init__(self, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, DIM)
        tokens = x.reshape(-1, DIM)
        scores = self.router(tokens).softmax(dim=-1)
        weights, chosen = torch.topk(scores, self.top_k, dim=-1)  # (N, k)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(tokens)
        for i, expert in enumerate(self.experts):
            rows, slots = torch.where(chosen == i)
            if rows.numel() == 0:
                continue
            y = expert(tokens[rows]) * weights[rows, slots].unsqueeze(-1)
            out = out.index_add(0, rows, y.to(out.dtype))
        return out.reshape(x.shape)


class Block(nn.Module):
    def __init__(self, top_k: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.moe = MoE(top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class MoELM(nn.Module):
    def __init__(self, depth: int = 2, top_k: int = TOP_K) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(top_k) for _ in range(depth))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _workload(name: str, top_k: int) -> Workload:
    return Workload(
        name=name,
        model=lambda: MoELM(top_k=top_k),
        batch=lambda n: (torch.randint(0, VOCAB, (n, SEQ)), torch.randint(0, VOCAB, (n, SEQ))),
        loss=lambda out, y: F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1)),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        layers=lambda m: m.blocks,
        tokens_per_sample=SEQ,
    )


def moe_lm() -> Workload:
    return _workload("moe-lm", TOP_K)


def top1_lm() -> Workload:
    return _workload("moe-top1-lm", 1)


class ValueGate(nn.Module):
    """Keeps the tokens whose activation is positive: a size that depends on values, not on a router."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return x + torch.zeros_like(h).index_put((h > 0).nonzero(as_tuple=True), h[h > 0])


def value_gated_lm() -> Workload:
    return dataclasses.replace(_workload("value-gated-lm", TOP_K), model=_ValueGatedLM)


class _ValueGatedLM(MoELM):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ValueGate() for _ in range(2))
