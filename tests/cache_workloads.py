"""Models that keep tensors beyond a layer or a step, written as users write them in a workload file
(``tests/cache_workloads.py:llama_lm``), for tests/estimator/test_kept_tensors.py:

- ``llama_lm`` and ``gpt2_lm``: tiny transformers models built from a local config with its defaults,
  so ``use_cache=True``: their forward returns a key/value cache (``past_key_values``) of every layer;
- ``hooked_mlp``: a plain PyTorch stack whose forward hooks stash each block's output on the model,
  where it stays until the next step's forward replaces it;
- ``running_mlp``: a plain PyTorch stack whose blocks keep a running buffer they replace in forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autofit import Workload

VOCAB, SEQ, DEPTH = 96, 16, 3


def lm_batch(n: int):
    ids = torch.randint(VOCAB, (n, SEQ))
    return ids, ids


def lm_loss(out, labels: torch.Tensor) -> torch.Tensor:
    logits = out.logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def _llama():
    import transformers

    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=DEPTH,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ))


def _gpt2():
    import transformers

    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=DEPTH, n_head=2, n_positions=SEQ, bos_token_id=0, eos_token_id=0))


def llama_lm() -> Workload:
    return Workload(name="user-llama-cache", model=_llama, batch=lm_batch, loss=lm_loss,
                    optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
                    layers=lambda model: model.model.layers)


def gpt2_lm() -> Workload:
    return Workload(name="user-gpt2-cache", model=_gpt2, batch=lm_batch, loss=lm_loss,
                    optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
                    layers=lambda model: model.transformer.h)


WIDTH, FEATURES, CLASSES = 64, 32, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class HookedMLP(nn.Module):
    """Each block's forward hook keeps the block's output (detached, e.g. for a later look at activations)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.out = nn.Linear(WIDTH, CLASSES)
        self.seen: dict[int, torch.Tensor] = {}
        for i, block in enumerate(self.blocks):
            block.register_forward_hook(lambda module, args, output, i=i: self.seen.__setitem__(i, output.detach() * 1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class RunningBlock(Block):
    """A block that keeps a copy of its last input in a buffer, replaced in each forward."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("last_x", torch.zeros(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last_x = x.detach().clone()
        return super().forward(x)


class RunningMLP(HookedMLP):
    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.inp = nn.Linear(FEATURES, WIDTH)
        self.blocks = nn.ModuleList(RunningBlock() for _ in range(DEPTH))
        self.out = nn.Linear(WIDTH, CLASSES)


def mlp_batch(n: int):
    return torch.randn(n, SEQ, FEATURES), torch.randint(CLASSES, (n, SEQ))


def mlp_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def hooked_mlp() -> Workload:
    return Workload(name="user-hooked-mlp", model=HookedMLP, batch=mlp_batch, loss=mlp_loss,
                    optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3), layers=lambda model: model.blocks)


def running_mlp() -> Workload:
    return Workload(name="user-running-mlp", model=RunningMLP, batch=mlp_batch, loss=mlp_loss,
                    optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3), layers=lambda model: model.blocks)
