"""The ``autofit`` command line: parse, call the library, print. Nothing else prints or exits.

Each subcommand lives in its own module here with ``add_parser(subparsers)`` and
``run(args) -> int``. User errors (:class:`autofit.core.errors.AutofitError`) become one line
on stderr and their exit status (2 for usage, 1 for a run-time failure); any other exception
one line and exit 1. ``--debug`` (anywhere on the line) shows the traceback instead.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import re
import sys
import traceback

from autofit.core.errors import AutofitError

_COMMANDS = ("models", "estimate", "measure", "search", "size", "report", "export", "bench")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit 2), no abbreviated options (``--budg`` is not ``--budget``),
    and an unknown option named before any other complaint, with the close match when there is one."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        # "--budget -1GB" is a (bad) value, not an option: no option of ours starts with a digit.
        self._negative_number_matcher = re.compile(r"^-\.?\d")
        self._parsing: list[str] = []

    def parse_known_args(self, args=None, namespace=None):
        self._parsing = list(sys.argv[1:] if args is None else args)
        namespace, extras = super().parse_known_args(args, namespace)
        unknown = self.unknown_option(extras)
        if unknown is not None:  # a subcommand's own: said here, where its options are known
            self.error(unknown)
        return namespace, extras

    def unknown_option(self, strings: list[str]) -> str | None:
        """``unknown argument --budjet (did you mean --budget?)`` for the first option in ``strings``
        that this parser does not have, else None. What follows ``--`` is positional; for the parser of
        the subcommands, what follows the subcommand is the subcommand's."""
        for text in strings:
            if text == "--":
                return None
            if not text.startswith("-") or text == "-" or self._negative_number_matcher.match(text):
                if self._subparsers is not None:
                    return None
                continue
            name = text.split("=", 1)[0] if text.startswith("--") else text
            if name in self._option_string_actions:
                continue
            known = sorted(o for o, a in self._option_string_actions.items()
                           if o.startswith("--") and a.help is not argparse.SUPPRESS)
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            return f"unknown argument {name}" + (f" (did you mean {close[0]}?)" if close else "")
        return None

    def error(self, message: str) -> None:  # one line, exit 2, as for every user error
        # An unknown option first: "--budjet 8GB" is a typo, not a missing --budget.
        unknown = message if message.startswith("unknown argument ") else self.unknown_option(self._parsing)
        if unknown is not None:
            message = unknown
        else:
            choice = re.match(r"argument .*: invalid choice: '([^']*)' \(choose from (.*)\)$", message)
            if choice:
                options = re.findall(r"'([^']*)'", choice.group(2))
                close = difflib.get_close_matches(choice.group(1), options, n=1, cutoff=0.6)
                if close:
                    message += f"; did you mean {close[0]}?"
        sys.stderr.write(f"autofit: error: {' '.join(message.split())}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="autofit", description="Find the fastest way to train a PyTorch model inside a memory budget.")
    from autofit.core.version import __version__

    parser.add_argument("--version", action="version", version=f"autofit {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in _COMMANDS:
        try:
            module = importlib.import_module(f"autofit.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"autofit.cli.{name}":
                raise
            continue  # subcommand not built yet
        module.add_parser(subparsers)
    for sub in subparsers.choices.values():  # `autofit search ... --debug` works too
        sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def _warnings_to_stderr() -> None:
    """The library's warnings (logger ``autofit``) as ``autofit: warning: ...`` lines."""
    logger = logging.getLogger("autofit")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("autofit: warning: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _warnings_to_stderr()
    try:
        return int(args.run(args) or 0)
    except AutofitError as exc:
        return _fail(args, str(exc), exc.exit_status)
    except KeyboardInterrupt:
        sys.stderr.write("autofit: interrupted\n")
        return 130
    except BrokenPipeError:  # `autofit report ... | head`: the reader left; say nothing more
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as exc:  # a bug or an unforeseen failure: one line, the traceback with --debug
        return _fail(args, f"{type(exc).__name__}: {exc} (rerun with --debug for the traceback)", 1)


def _fail(args: argparse.Namespace, message: str, status: int) -> int:
    if getattr(args, "debug", False):
        traceback.print_exc()
    # one line, whatever the message held (a database driver's errors span several)
    sys.stderr.write("autofit: error: " + " ".join(message.split()) + "\n")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
