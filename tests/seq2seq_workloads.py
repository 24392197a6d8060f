"""An encoder-decoder seq2seq model written as a user would write it in a file, on ``nn.Transformer``
(``tests/seq2seq_workloads.py:nn_transformer``), for tests/estimator/test_seq2seq_estimate.py. The repeated
blocks found by default are the decoder layers; each takes the encoder's output (``memory``) beside
the previous layer's output, so under checkpointing every segment keeps ``memory`` as an input."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autofit import Workload

VOCAB, D, SRC, TGT = 512, 64, 32, 16


class Seq2Seq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.src_emb = nn.Embedding(VOCAB, D)
        self.tgt_emb = nn.Embedding(VOCAB, D)
        self.pos = nn.Parameter(torch.randn(1, SRC, D) * 0.02)
        self.tf = nn.Transformer(d_model=D, nhead=4, num_encoder_layers=2, num_decoder_layers=2,
                                 dim_feedforward=128, dropout=0.0, batch_first=True)
        self.out = nn.Linear(D, VOCAB)

    def forward(self, x):
        src, tgt_in = x
        mask = nn.Transformer.generate_square_subsequent_mask(tgt_in.shape[1])
        h = self.tf(self.src_emb(src) + self.pos, self.tgt_emb(tgt_in) + self.pos[:, :tgt_in.shape[1]],
                    tgt_mask=mask, tgt_is_causal=True)
        return self.out(h)


def batch(n: int):
    src = torch.randint(0, VOCAB, (n, SRC))
    tgt = torch.randint(0, VOCAB, (n, TGT + 1))
    return (src, tgt[:, :-1]), tgt[:, 1:]


def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def nn_transformer() -> Workload:
    return Workload(name="user-nn-transformer", model=Seq2Seq, batch=batch, loss=loss,
                    optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-4), tokens_per_sample=TGT)
