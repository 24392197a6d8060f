"""The ``autofit`` command line: parse, call the library, print. Nothing else prints or exits.

Each subcommand lives in its own module here with ``add_parser(subparsers)`` and
``run(args) -> int``. User errors (:class:`autofit.errors.AutofitError`) become one line
on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from autofit.errors import AutofitError

_COMMANDS = ("models", "estimate", "measure", "search", "size", "report", "export", "bench")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, as for every user error
        sys.stderr.write(f"autofit: error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="autofit", description="Find the fastest way to train a PyTorch model inside a memory budget.")
    from autofit import __version__

    parser.add_argument("--version", action="version", version=f"autofit {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in _COMMANDS:
        try:
            module = importlib.import_module(f"autofit.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"autofit.cli.{name}":
                raise
            continue  # subcommand not built yet
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except AutofitError as exc:
        sys.stderr.write(f"autofit: error: {exc}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("autofit: interrupted\n")
        return 130
    except BrokenPipeError:  # `autofit report ... | head`: the reader left; say nothing more
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
