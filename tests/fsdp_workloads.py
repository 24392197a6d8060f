"""A tiny decoder for the FSDP tests, loaded in each rank process by ``tests/fsdp_workloads.py:tiny_decoder``.

No dropout, so the sharded run can match the unsharded one exactly; an untied head (a tied
weight shared by the root and nothing else is fine for FSDP too, but untied keeps names simple).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autofit.workloads.base import Workload

VOCAB, WIDTH, HEADS, N_LAYERS, SEQ = 64, 16, 2, 3, 8


class Block(nn.Module):
    def __init__(self) -> None:
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


class TinyDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(N_LAYERS))
        self.ln_f, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)

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


def tiny_decoder() -> Workload:
    # SGD: a parameter update is linear in the gradient, so comparing updates compares gradients.
    return Workload(name="tiny-decoder", model=TinyDecoder, batch=_batch, loss=_lm_loss,
                    optimizer=lambda params: torch.optim.SGD(params, lr=0.1), layers=lambda m: m.blocks,
                    tokens_per_sample=SEQ)


class OddMLP(nn.Module):
    """Linear layers whose outputs (dim 0 of their weights) are odd: FSDP pads them to a multiple of N."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(6, 7), nn.Linear(7, 5), nn.Linear(5, 7)])
        self.head = nn.Linear(7, 5)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def odd_mlp() -> Workload:
    # Adam: its state follows each (padded) parameter shard.
    return Workload(name="odd-mlp", model=OddMLP, batch=lambda n: (torch.randn(n, 6), torch.randn(n, 5)),
                    loss=F.mse_loss, optimizer=lambda params: torch.optim.Adam(params, lr=0.01),
                    layers=lambda m: m.layers)


def small_resnet() -> Workload:
    """convnet-bn's ResNet cut to three blocks (8, 16 then 64 channels):
    with checkpoint_every=2 the second unit (the last block) has about 10x the weights of the first."""
    from autofit.workloads.convnet import ResNetCifar

    def batch(n: int):
        return torch.randn(n, 3, 32, 32), torch.randint(10, (n,))

    return Workload(name="small-resnet", model=lambda: ResNetCifar(widths=(8, 16, 64), blocks_per_stage=1), batch=batch,
                    loss=F.cross_entropy, optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
                    layers=lambda m: m.blocks)
