"""Device split of Hugging Face decoders: one ``PipelineStage`` module per stage, built by hand.

``torch.distributed.pipelining.pipeline()`` cannot capture a ``transformers`` causal LM as one
graph (a ``ModelOutput`` return, data-dependent mask code), so the stages are cut manually from
the model's own modules. Two decoder layouts are recognised by the modules the model's base
(``model.model``, ``model.transformer``, ``model.gpt_neox``…) has, not by its name:

- rotary decoders: a token embedding (``embed_tokens``, ``embed_in`` or ``word_embeddings``), an
  optional dropout after it (``embed_dropout``, ``emb_dropout``), the layers (``layers`` or ``h``),
  ``rotary_emb`` and a final norm (``norm``, ``final_layernorm``, ``final_layer_norm`` or ``ln_f``):
  Llama, Mistral, Qwen2/3, Gemma (its embedding scales itself), Phi, GPT-NeoX…;
- learned-position decoders (GPT-2): ``<base>.wte``, ``<base>.wpe``, ``<base>.drop``, ``<base>.h``,
  ``<base>.ln_f``;

and ``lm_head``. Embeddings go on the first stage, the final norm and the head on the last (the loss runs there
too, as the schedule's ``loss_fn``); every stage makes its own position ids and rotary tables
(no parameters, a few KB) rather than receiving them. Attention gets no mask and causal SDPA, as
the unsplit model does for unpadded batches. Before a model is cut, the stages are run in
sequence in one process and must reproduce the unsplit model's logits; a model whose forward
does more than these modules (e.g. a soft-capped head) is refused with that reason.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
from torch import nn

from autofit.core.errors import WorkloadError


class _Skip(nn.Module):
    """Stands in for a layer another stage runs: hands its input on."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


# What each part of a rotary decoder's base is called, in the families' spellings.
_EMBEDDINGS = ("embed_tokens", "embed_in", "word_embeddings")
_EMBEDDING_DROPOUTS = ("embed_dropout", "emb_dropout")
_LAYER_LISTS = ("layers", "h")
_FINAL_NORMS = ("norm", "final_layernorm", "final_layer_norm", "ln_f")


@dataclass(frozen=True)
class _Layout:
    """Where a decoder keeps each part: the names of its base's modules (None where it has none)."""

    kind: str  # "rotary" or "learned"
    base: nn.Module
    prefix: str  # the base's attribute on the model: "model", "transformer", "gpt_neox"…
    embeddings: tuple[str, ...]  # the first stage's modules: the token (and position) embeddings
    dropout: str | None
    layers: str
    norm: str


def _first(base: nn.Module, names: tuple[str, ...]) -> str | None:
    return next((n for n in names if isinstance(getattr(base, n, None), nn.Module)), None)


def _layout(model: nn.Module) -> _Layout | None:
    prefix = next((p for p in (getattr(model, "base_model_prefix", None), "model", "transformer")
                   if p and isinstance(getattr(model, p, None), nn.Module)), None)
    if prefix is None or getattr(model, "lm_head", None) is None:
        return None
    base = getattr(model, prefix)
    if all(hasattr(base, a) for a in ("wte", "wpe", "drop", "h", "ln_f")):
        return _Layout("learned", base, prefix, ("wte", "wpe"), "drop", "h", "ln_f")
    embed, layers, norm = (_first(base, names) for names in (_EMBEDDINGS, _LAYER_LISTS, _FINAL_NORMS))
    if embed and layers and norm and hasattr(base, "rotary_emb"):
        return _Layout("rotary", base, prefix, (embed,), _first(base, _EMBEDDING_DROPOUTS), layers, norm)
    return None


def _run(model: nn.Module, layout: _Layout, x: torch.Tensor, lo: int, hi: int,
         first: bool, last: bool) -> torch.Tensor:
    base, hidden = layout.base, x
    if first:
        hidden = getattr(base, layout.embeddings[0])(x)
    positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    layers = getattr(base, layout.layers)[lo:hi]
    if layout.kind == "rotary":
        if first and layout.dropout:
            hidden = getattr(base, layout.dropout)(hidden)
        rotary = base.rotary_emb(hidden, position_ids=positions)
        for layer in layers:
            hidden = layer(hidden, attention_mask=None, position_embeddings=rotary, position_ids=positions,
                           use_cache=False)
    else:
        if first:
            hidden = base.drop(hidden + base.wpe(positions))
        for layer in layers:
            hidden = layer(hidden, attention_mask=None, use_cache=False, position_ids=positions)
    if not last:
        return hidden
    return model.lm_head(getattr(base, layout.norm)(hidden))


def refusal(model: nn.Module) -> str | None:
    """Why ``model`` cannot be cut into stages, from its structure alone (None when it can be
    tried): checked when profiling, so a search prunes its splits before any trial."""
    name = type(model).__name__
    if _layout(model) is None:
        return (f"{name} cannot be split into pipeline stages: autofit cuts decoders with a token embedding, "
                "layers, rotary_emb and a final norm (Llama-style) or wte, wpe, h and ln_f (GPT-2-style), "
                "and lm_head")
    attention = getattr(model.config, "_attn_implementation", "sdpa")
    if attention != "sdpa":
        return (f"{name} cannot be split: its stages pass no attention mask, which only SDPA attention turns "
                f"into causal attention (this model uses {attention!r})")
    return None


def check_splittable(model: nn.Module, example: torch.Tensor) -> _Layout:
    """The layout of ``model``, after checking the hand-cut stages reproduce its logits on
    ``example``. Raises WorkloadError naming why it cannot be split."""
    reason = refusal(model)
    if reason:
        raise WorkloadError(reason)
    layout = _layout(model)
    name = type(model).__name__
    training = model.training
    model.eval()  # no dropout draws: the two forwards must see the same computation
    try:
        with torch.no_grad():
            expected = model(example).logits
            n = len(getattr(layout.base, layout.layers))
            staged = _run(model, layout, example, 0, n, True, True)
    except TypeError as exc:  # a layer that needs more than hidden states and rotary tables (Falcon's ALiBi)
        raise WorkloadError(f"{name} cannot be split: its layers take more than the stages hand them "
                            f"({' '.join(str(exc).split())})") from None
    finally:
        model.train(training)
    if not torch.allclose(expected.float(), staged.float(), rtol=1e-3, atol=1e-3):
        raise WorkloadError(f"{name} cannot be split: stages cut from its embedding, layers, norm and head do not "
                            "reproduce its logits (its forward does more than these modules)")
    return layout


def cut_stage(model: nn.Module, bounds: list[tuple[int, int]], rank: int, example: torch.Tensor):
    """Turn ``model`` in place into stage ``rank`` of ``bounds``; returns ``(model, replicated)``.

    The stage keeps the model's module names (``model.layers.3``), so checkpointing and the
    optimizer act on it as on the unsplit model. Layers of other stages become pass-throughs,
    the embeddings stay only on the first stage, the norm and head only on the last.
    ``replicated``: ``[{rank: parameter name}]`` for a tied embedding and head on two stages.
    """
    layout = check_splittable(model, example)
    base = layout.base
    lo, hi = bounds[rank]
    first, last = rank == 0, rank == len(bounds) - 1
    tied = model.lm_head.weight is getattr(base, layout.embeddings[0]).weight
    layers = getattr(base, layout.layers)
    for i in range(len(layers)):
        if not lo <= i < hi:
            layers[i] = _Skip()
    if not first:
        for attr in layout.embeddings:
            setattr(base, attr, None)
    if not last:
        setattr(base, layout.norm, None)
        model.lm_head = None
    model.forward = types.MethodType(lambda self, x: _run(self, layout, x, lo, hi, first, last), model)
    replicated = []
    if tied and len(bounds) > 1:
        replicated.append({0: f"{layout.prefix}.{layout.embeddings[0]}.weight", len(bounds) - 1: "lm_head.weight"})
    return model, replicated


cut_stage.refusal = refusal  # the Workload.split protocol: a structural check run when profiling
