"""A GRU language model written as a user would write it in a file (``tests/rnn_workloads.py:gru_lm``),
for tests/estimator/test_rnn_estimate.py. Each ``nn.GRU`` sits in its own block so checkpointing has segments;
trained with Adagrad. Under autocast a GRU saves a bf16 copy of its input, not the input itself: the
shape the estimate once under-counted by one layer input per sample with checkpointing."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autofit import Workload

VOCAB, HIDDEN, SEQ, DEPTH = 256, 64, 64, 3


class GRUBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.gru = nn.GRU(hidden, hidden, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x)
        return out


class GRULanguageModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(GRUBlock(HIDDEN) for _ in range(DEPTH))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batch(n: int):
    return torch.randint(VOCAB, (n, SEQ)), torch.randint(VOCAB, (n, SEQ))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def gru_lm() -> Workload:
    return Workload(name="user-gru-lm", model=GRULanguageModel, batch=batch, loss=lm_loss,
                    optimizer=lambda params: torch.optim.Adagrad(params, lr=1e-2),
                    layers=lambda model: model.blocks, description="GRU LM, Adagrad")
