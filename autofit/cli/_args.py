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
