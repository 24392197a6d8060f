"""Argument types shared by the subcommands."""

from __future__ import annotations

import argparse


def positive(kind):
    """An argparse ``type`` accepting only positive values of ``kind`` (int or float)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected a positive number") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: must be positive")
        return value
    return parse


BUDGET_HELP = ("memory per device: 8GB or 8G (decimal units: 8*10^9 bytes; K, M, T likewise), 7.5GiB, 512MiB "
               "(binary units: powers of 1024); a lowercase b is bytes too")
MODEL_HELP = ("a built-in name (see `autofit models`), hf:SPEC (a Hugging Face config: hf:llama, "
              "'hf:gpt2?n_layer=4', hf:path/to/dir, hf:org/name), path/to/file.py:function or package.module:function")


def add_hf_options(p: argparse.ArgumentParser) -> None:
    """``--seq-len``, ``--task`` and ``--lora``: options of ``--model hf:...``."""
    p.add_argument("--seq-len", type=positive(int), help="hf: models: tokens per sample (default: the config's "
                                                         "maximum positions, else 512)")
    p.add_argument("--task", choices=("causal-lm", "seq-cls", "image-cls"),
                   help="hf: models: the training task (default from the model type)")
    p.add_argument("--lora", metavar="r=N[,alpha=N,dropout=X,target=a+b]",
                   help="hf: models: train a peft LoRA adapter instead of all weights, e.g. --lora r=8")


def model_spec(args: argparse.Namespace, model: str | None = None) -> str:
    """``--model`` with the hf options folded in (``hf:SPEC#seq_len=128``), the form trials reload.

    Raises WorkloadError when an hf option is given for a model that is not ``hf:``."""
    from autofit.core.errors import WorkloadError

    model = model if model is not None else args.model
    options = {"seq_len": getattr(args, "seq_len", None), "task": getattr(args, "task", None),
               "lora": getattr(args, "lora", None)}
    given = {k: v for k, v in options.items() if v is not None}
    if not given:
        return model
    if not model.startswith("hf:"):
        flag = "--" + next(iter(given)).replace("_", "-")
        raise WorkloadError(f"{flag} applies to hf: models only, not {model!r}")
    return model + "".join(f"#{k}={v}" for k, v in given.items())
