"""What a CUDA card holds beyond the tensors' peak, besides the measured context and workspaces.

The caching allocator reserves more than it allocates (docs/facts.md#cuda-caching-allocator): small
requests come from 2 MiB segments and medium ones from 20 MiB segments, freed blocks stay reserved,
and a checkpointed step frees and re-makes a segment's activations during backward in another
order than its forward made them, so it leaves more freed blocks of the wrong size behind. A trial's
context also ends a little above the device probe's (its own kernels load lazily). The estimate
adds, per device, on top of the tensors' peak ``T`` (bytes, the step's input batch included)::

    fixed_bytes + fragmentation · T + checkpoint_fragmentation · T (checkpointed configs only) + margin_bytes

The constants are fitted on measured H200 steps (``results/benchmarks/gpu/run3-h200-a.csv`` and
``run4-h200-a.csv``) by :mod:`autofit.bench.reserved_fit`, which also checks them on held-out
workloads and writes ``results/benchmarks/gpu/reserved_model.md``
(``python -m autofit.bench.reserved_fit``; docs/facts.md#allocator-fragmentation). The terms are a
least-squares fit of the card's use; ``margin_bytes`` then lifts the fit over the card in at least
95% of the fitted rows. The measured peaks spanned 9-846 MiB of tensors, and only
``checkpoint_every=1``: larger steps and sparser checkpointing are extrapolated.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Regenerate with `python -m autofit.bench.reserved_fit` (tests/bench/test_reserved_fit.py fails
# when these differ from what the committed measurements give).
RESERVED_FIXED_BYTES = 26 * 2**20
FRAGMENTATION = 0.063
CHECKPOINT_FRAGMENTATION = 0.179
RESERVED_MARGIN_BYTES = 25 * 2**20


@dataclass(frozen=True)
class ReservedModel:
    """The card's bytes beyond the tensors' peak that are no context and no workspace (see the module)."""

    fixed_bytes: int
    fragmentation: float
    checkpoint_fragmentation: float
    margin_bytes: int

    def extra_bytes(self, tensor_bytes, checkpointed: bool):
        """Bytes beyond ``tensor_bytes`` (a number or numpy array: one device's tensor peak)."""
        share = self.fragmentation + (self.checkpoint_fragmentation if checkpointed else 0.0)
        return self.fixed_bytes + self.margin_bytes + share * np.asarray(tensor_bytes, dtype=float)


FITTED = ReservedModel(RESERVED_FIXED_BYTES, FRAGMENTATION, CHECKPOINT_FRAGMENTATION, RESERVED_MARGIN_BYTES)
