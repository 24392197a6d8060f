"""The ``autofit`` command line: parse, call the library, print. Nothing else prints or exits.

Each subcommand lives in its own module here with ``add_parser(subparsers)`` and
``run(args) -> int``. User errors (:class:`autofit.core.errors.AutofitError`) become one line
on stderr and their exit status (2 for usage, 1 for a run-time failure); any other exception
one line and exit 1. ``--debug`` (anywhere on the line) shows the traceback instead, and the
library's DEBUG lines (``autofit: debug: ...``): a probe child's traceback, how a config is applied.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import re
import sys
import traceback

from autofit.core.errors import AutofitError

_COMMANDS = ("models", "estimate", "measure", "search", "size", "report", "export", "bench")


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # "--budget -1GB" is a (bad) value, not an option: no option of ours starts with a digit.
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str) -> None:  # one line, exit 2, as for every user error
        sys.stderr.write(f"autofit: error: {message}\n")
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


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:  # "autofit: warning: ...", "autofit: debug: ..."
        return f"autofit: {record.levelname.lower()}: {record.getMessage()}"


def _warnings_to_stderr(debug: bool = False) -> None:
    """The library's warnings (logger ``autofit``) as ``autofit: warning: ...`` lines; with ``debug``,
    its DEBUG lines too (``autofit: debug: ...``)."""
    logger = logging.getLogger("autofit")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_Formatter())
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.DEBUG if debug else logging.NOTSET)  # NOTSET: the root's level (WARNING)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _warnings_to_stderr(getattr(args, "debug", False))
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
