"""The ``autofit`` command line: parse, call the library, print. Nothing else prints or exits.

Each subcommand lives in its own module here with ``add_parser(subparsers)`` and
``run(args) -> int``. User errors (:class:`autofit.core.errors.AutofitError`) become one line
on stderr and their exit status (2 for usage, 1 for a run-time failure); any other exception
one line and exit 1. ``--debug`` (anywhere on the line) shows the traceback instead, and the
library's DEBUG lines (``autofit: debug: ...``): a probe child's traceback, how a config is applied.

Stopping: Ctrl-C (SIGINT) interrupts a command -- a search marks its running trials interrupted,
writes its tables and exits 130 (rerun it to resume) -- and so does ``kill PID`` (SIGTERM), which
exits 143. A process started with SIGINT ignored (a background job of a non-interactive shell:
``cmd &`` in a script) cannot see Ctrl-C; a long command says so on start, with the kill to use.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import logging
import os
import re
import signal
import sys
import threading
import traceback

from autofit.core.errors import AutofitError
from autofit.runtime.timing import cpus_available

_COMMANDS = ("models", "estimate", "measure", "search", "size", "report", "export", "bench")
# The commands that run trials, which on the CPU fork from the trials' fork server (``estimate`` only forks
# profiling workers when its cache is cold, and a warm one would have started the server for nothing).
_FORKING_COMMANDS = ("measure", "search", "size")


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


_LONG_COMMANDS = ("search", "measure", "size", "bench")  # the commands one may want to stop


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill PID``): stops a command as Ctrl-C does (running trials marked interrupted, tables written)."""


def _terminate(signum, frame) -> None:
    if os.getpid() != _terminate.pid:  # a forked child inherited the handler: it dies of SIGTERM, as before
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    raise Terminated


@contextlib.contextmanager
def _stop_signals(command: str):
    """SIGTERM interrupts the command as Ctrl-C does, while it runs (the handler as it was restored
    after: ``main`` also runs inside other programs); a long command started with SIGINT ignored says
    on start that Ctrl-C cannot stop it, and what can."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers belong to the main thread
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if command in _LONG_COMMANDS and signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        how = (f"kill {os.getpid()} (SIGTERM), which interrupts it as Ctrl-C would" if previous != signal.SIG_IGN else
               f"kill -KILL {os.getpid()} (SIGTERM is ignored too; the same command again resumes it)")
        sys.stderr.write(f"autofit: warning: Ctrl-C is ignored in this process (SIGINT ignored: started in the "
                         f"background by a script?); stop it with {how}\n")
        sys.stderr.flush()
    if previous != signal.SIG_DFL:  # ignored, or someone's handler: theirs
        yield
        return
    _terminate.pid = os.getpid()
    signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def start_fork_server_early(argv: list[str]) -> bool:
    """Start the trials' fork server now, before this process imports torch, for a command that forks from
    it on the CPU: its imports (torch, torch._dynamo: about two seconds here) then run on another core
    beside this process's own instead of after them, and a warm search's first trial starts a second or
    more sooner. Left to the command (which starts it once the device is known) where the device may be
    a GPU (``--device cuda``, or a GPU driver's device files present), and on one CPU, where nothing
    would overlap. Returns whether it started one."""
    from autofit.runtime import forkserver

    words = [w for w in argv if not w.startswith("-")]
    if not words or words[0] not in _FORKING_COMMANDS or not forkserver.enabled():
        return False
    if {"-h", "--help", "--version"} & set(argv) or cpus_available() < 2:
        return False
    device = _option_value(argv, "--device")
    if device is None and any(os.path.exists(p) for p in _GPU_DEVICE_FILES):
        return False
    if device is not None and device != "cpu":
        return False
    forkserver.start_server_soon()
    return True


# NVIDIA's and AMD's (ROCm: torch.cuda too) driver device files: where they exist a search may run on a GPU.
_GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/kfd")


def _option_value(argv: list[str], option: str) -> str | None:
    """The value given to ``option`` in ``argv`` (``--opt VALUE`` or ``--opt=VALUE``; the last one), or None."""
    value = None
    for i, word in enumerate(argv):
        if word == option and i + 1 < len(argv):
            value = argv[i + 1]
        elif word.startswith(option + "="):
            value = word[len(option) + 1:]
    return value


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # this process was started for the command (in-process callers start nothing early)
        start_fork_server_early(sys.argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    _warnings_to_stderr(getattr(args, "debug", False))
    try:
        with _stop_signals(args.command):
            return int(args.run(args) or 0)
    except AutofitError as exc:
        return _fail(args, str(exc), exc.exit_status)
    except Terminated:
        sys.stderr.write("autofit: terminated (SIGTERM)\n")
        return 128 + signal.SIGTERM
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
