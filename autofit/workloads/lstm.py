"""``lstm-lm``: a byte-level LSTM language model.

Each layer is a single-layer ``nn.LSTM`` in ``self.blocks`` so checkpointing and device split
can act per layer; a block returns ``(output, (h_n, c_n))`` and the model keeps ``output``.
Trained with Adam (not AdamW).

Device note: on the CPU ``nn.LSTM`` runs oneDNN's ``mkldnn_rnn_layer`` (bf16 under autocast),
which saves a uint8 workspace for backward about as large as the layer's activations; cuDNN
keeps its own reserve space on CUDA. Measure this model's activation memory per device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autofit.workloads.base import Workload

VOCAB_SIZE = 256  # bytes
SEQ_LEN = 64
HIDDEN = 256
N_LAYER = 4


class LSTMLanguageModel(nn.Module):
    """Token ids (B, T) → logits (B, T, V)."""

    def __init__(self, vocab_size: int = VOCAB_SIZE, hidden: int = HIDDEN, n_layer: int = N_LAYER):
        super().__init__()
        # filled here, not by nn.Embedding, so that a meta-device build (param counting) skips
        # normal_, which on meta is a slow Python decomposition
        self.embed = nn.Embedding(vocab_size, hidden, _weight=torch.empty(vocab_size, hidden))
        if not self.embed.weight.is_meta:
            nn.init.normal_(self.embed.weight)
        self.blocks = nn.ModuleList([nn.LSTM(hidden, hidden, batch_first=True) for _ in range(n_layer)])
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)  # (B, T, H)
        for block in self.blocks:
            x, _ = block(x)  # (B, T, H); the final (h, c) state is not used
        return self.head(x)  # (B, T, V)


def _batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(VOCAB_SIZE, (n, SEQ_LEN)), torch.randint(VOCAB_SIZE, (n, SEQ_LEN))


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def lstm_workload() -> Workload:
    """The ``lstm-lm`` Workload: random byte sequences, next-token cross-entropy, Adam."""
    return Workload(
        name="lstm-lm", model=LSTMLanguageModel, batch=_batch, loss=_lm_loss, optimizer=_adam,
        layers=lambda model: model.blocks, tokens_per_sample=SEQ_LEN,
        description=f"byte-level LSTM LM: {N_LAYER} single-layer LSTMs, hidden {HIDDEN}, seq {SEQ_LEN}, Adam",
        meta={"kind": "rnn", "vocab_size": VOCAB_SIZE, "seq_len": SEQ_LEN, "hidden": HIDDEN, "n_layer": N_LAYER},
    )
