"""Device split of Hugging Face decoders: one ``PipelineStage`` module per stage, built by hand.

``torch.distributed.pipelining.pipeline()`` cannot capture a ``transformers`` causal LM as one
graph (a ``ModelOutput`` return, data-dependent mask code), so the stages are cut manually from
the model's own modules. Two decoder layouts are recognised by the modules the model has (not
by its name):

- rotary decoders (Llama, Mistral, Qwen2/3…): ``<base>.embed_tokens``, ``<base>.layers``,
  ``<base>.rotary_emb``, ``<base>.norm``, ``lm_head``;
- learned-position decoders (GPT-2): ``<base>.wte``, ``<base>.wpe``, ``<base>.drop``, ``<base>.h``,
  ``<base>.ln_f``, ``lm_head``.

Embeddings go on the first stage, the final norm and the head on the last (the loss runs there
too, as the schedule's ``loss_fn``); every stage makes its own position ids and rotary tables
(no parameters, a few KB) rather than receiving them. Attention gets no mask and causal SDPA, as
the unsplit model does for unpadded batches. Before a model is cut, the stages are run in
sequence in one process and must reproduce the unsplit model's logits; a model whose forward
does more than these modules (e.g. Gemma's scaled embeddings) is refused with that reason.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from autofit.core.errors import WorkloadError


class _Skip(nn.Module):
    """Stands in for a layer another stage runs: hands its input on."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def _layout(model: nn.Module):
    base = getattr(model, "model", None) or getattr(model, "transformer", None)
    head = getattr(model, "lm_head", None)
    if base is None or head is None:
        return None, None
    if all(hasattr(base, a) for a in ("embed_tokens", "layers", "rotary_emb", "norm")):
        return "rotary", base
    if all(hasattr(base, a) for a in ("wte", "wpe", "drop", "h", "ln_f")):
        return "learned", base
    return None, None


def _layers(kind: str, base: nn.Module) -> nn.ModuleList:
    return base.layers if kind == "rotary" else base.h


def _run(model: nn.Module, kind: str, base: nn.Module, x: torch.Tensor, lo: int, hi: int,
         first: bool, last: bool) -> torch.Tensor:
    hidden = x
    if first:
        hidden = base.embed_tokens(x) if kind == "rotary" else base.wte(x)
    positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    if kind == "rotary":
        rotary = base.rotary_emb(hidden, position_ids=positions)
        for layer in _layers(kind, base)[lo:hi]:
            hidden = layer(hidden, attention_mask=None, position_embeddings=rotary, position_ids=positions,
                           use_cache=False)
    else:
        if first:
            hidden = base.drop(hidden + base.wpe(positions))
        for layer in _layers(kind, base)[lo:hi]:
            hidden = layer(hidden, attention_mask=None, use_cache=False, position_ids=positions)
    if not last:
        return hidden
    hidden = base.norm(hidden) if kind == "rotary" else base.ln_f(hidden)
    return model.lm_head(hidden)


def refusal(model: nn.Module) -> str | None:
    """Why ``model`` cannot be cut into stages, from its structure alone (None when it can be
    tried): checked when profiling, so a search prunes its splits before any trial."""
    kind, _ = _layout(model)
    name = type(model).__name__
    if kind is None:
        return (f"{name} cannot be split into pipeline stages: autofit cuts decoders with embed_tokens, layers, "
                "rotary_emb and norm (Llama-style) or wte, wpe, h and ln_f (GPT-2-style), and lm_head")
    attention = getattr(model.config, "_attn_implementation", "sdpa")
    if attention != "sdpa":
        return (f"{name} cannot be split: its stages pass no attention mask, which only SDPA attention turns "
                f"into causal attention (this model uses {attention!r})")
    return None


def check_splittable(model: nn.Module, example: torch.Tensor) -> tuple[str, nn.Module]:
    """The layout of ``model``, after checking the hand-cut stages reproduce its logits on
    ``example``. Raises WorkloadError naming why it cannot be split."""
    reason = refusal(model)
    if reason:
        raise WorkloadError(reason)
    kind, base = _layout(model)
    name = type(model).__name__
    training = model.training
    model.eval()  # no dropout draws: the two forwards must see the same computation
    with torch.no_grad():
        expected = model(example).logits
        n = len(_layers(kind, base))
        staged = _run(model, kind, base, example, 0, n, True, True)
    model.train(training)
    if not torch.allclose(expected.float(), staged.float(), rtol=1e-3, atol=1e-3):
        raise WorkloadError(f"{name} cannot be split: stages cut from its embedding, layers, norm and head do not "
                            "reproduce its logits (its forward does more than these modules)")
    return kind, base


def cut_stage(model: nn.Module, bounds: list[tuple[int, int]], rank: int, example: torch.Tensor):
    """Turn ``model`` in place into stage ``rank`` of ``bounds``; returns ``(model, replicated)``.

    The stage keeps the model's module names (``model.layers.3``), so checkpointing and the
    optimizer act on it as on the unsplit model. Layers of other stages become pass-throughs,
    the embeddings stay only on the first stage, the norm and head only on the last.
    ``replicated``: ``[{rank: parameter name}]`` for a tied embedding and head on two stages.
    """
    kind, base = check_splittable(model, example)
    lo, hi = bounds[rank]
    first, last = rank == 0, rank == len(bounds) - 1
    embed = base.embed_tokens if kind == "rotary" else base.wte
    tied = model.lm_head.weight is embed.weight
    layers = _layers(kind, base)
    for i in range(len(layers)):
        if not lo <= i < hi:
            layers[i] = _Skip()
    prefix = "model" if getattr(model, "model", None) is base else "transformer"
    embed_names = ["embed_tokens"] if kind == "rotary" else ["wte", "wpe"]
    if not first:
        for attr in embed_names:
            setattr(base, attr, None)
    if not last:
        setattr(base, "norm" if kind == "rotary" else "ln_f", None)
        model.lm_head = None
    model.forward = types.MethodType(
        lambda self, x: _run(self, kind, base, x, lo, hi, first, last), model)
    replicated = []
    if tied and len(bounds) > 1:
        replicated.append({0: f"{prefix}.{embed_names[0]}.weight", len(bounds) - 1: "lm_head.weight"})
    return model, replicated


cut_stage.refusal = refusal  # the Workload.split protocol: a structural check run when profiling
