"""A launcher: find the fastest way to train your model under a memory budget, then train with it.

    python examples/launcher.py

autofit needs your model as a Workload: how to build the model, make a batch, compute the
loss (and, optionally, the optimizer). Its trials run in fresh processes that import this file
by path, so the search is started under ``if __name__ == "__main__":``. The study and its tables
(trials.csv, best.json, summary.md) go to ``results/launcher-example/``; running the script
again resumes the study instead of repeating its trials.
"""

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import autofit

VOCAB, DIM, SEQ = 256, 64, 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, DIM) -> (B, T, DIM)
        return x + F.gelu(self.fc(self.norm(x)))


class TinyLM(nn.Module):
    """Embedding, a list of residual blocks (what checkpointing and device splits act on), a head."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, VOCAB)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (n, SEQ + 1))
    return tokens[:, :-1], tokens[:, 1:]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_workload() -> autofit.Workload:
    return autofit.Workload(name="tiny-lm", model=TinyLM, batch=make_batch, loss=lm_loss,
                            optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3), tokens_per_sample=SEQ)


def main() -> None:
    workload = autofit.load_workload(f"{Path(__file__).resolve()}:make_workload")
    result = autofit.search(
        workload, budget="4MB",
        space={"precision": ["fp32", "amp-bf16"], "micro_batch": [4, 8, 16], "global_batch": 16,
               "checkpoint_every": [0, 2]},
        trials=3, out="results/launcher-example",
        progress=True,  # the default: the lines `autofit search` prints, on stderr; False: silent
    )
    if result.best is None:
        raise SystemExit("nothing fits the budget")
    print(f"best: {result.best.short()}: {result.best_measured['samples_per_s']:.1f} samples/s, "
          f"peak {result.best_measured['peak_bytes'] / 2**20:.2f} MiB of {autofit.format_budget(result.budget_bytes)}")
    print(f"{result.n_real} real trials, {result.n_pruned} of {result.n_configs} configs pruned by the estimate")

    # Train your own model with the best config: precision, checkpointing, micro-batches, accumulation.
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with result.apply(model, optimizer) as run:
        for step in range(3):
            inputs, targets = make_batch(run.plan.global_batch)
            for micro_inputs, micro_targets in run.micro_batches((inputs, targets)):
                with run.autocast():
                    loss = lm_loss(model(micro_inputs), micro_targets)
                run.backward(loss)
            run.step()
            print(f"step {step}: loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
