"""What every command's console shares: lines on stderr that stay whole when ranks share one
terminal, gRPC's info lines kept off it, a reader of stdout that goes away (``| head``)
ending the command quietly, usage errors in one line, and the options' checks as argparse
types."""

from __future__ import annotations

import argparse
import os
import select
import sys
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

from staging.exitcodes import Exit

__all__ = [
    "Parser",
    "grpc_errors_only",
    "option_type",
    "path_arg",
    "reader_gone",
    "whole",
    "whole_lines",
]

T = TypeVar("T")


def whole_lines() -> None:
    """Write each line of this process's stderr in one ``write``. Under ``python -u`` or
    ``PYTHONUNBUFFERED`` (common in batch scripts) ``print`` writes a line's text and its
    newline apart, and the errors of ranks sharing a terminal run together on one line. A
    stderr replaced (a test capturing it) is left as it is."""
    if sys.stderr is sys.__stderr__ and hasattr(sys.stderr, "reconfigure"):
        sys.stderr.reconfigure(write_through=False, line_buffering=True)


def grpc_errors_only() -> None:
    """gRPC's C core writes info lines on stderr (``I1129 ... Handshake failed``, at every
    retry of a refused TLS handshake); the commands say why a call failed themselves. Only
    errors, unless the user set ``GRPC_VERBOSITY``; before gRPC is imported."""
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


def reader_gone() -> bool:
    """Whether stdout is a pipe nobody reads any more (``| head`` has what it wanted): then
    stdout is pointed at ``/dev/null``, so that the interpreter's flush at exit does not fail
    again. ``False`` (a ``BrokenPipeError`` from elsewhere, a socket): a real failure."""
    try:
        fd = sys.stdout.fileno()
        poll = select.poll()
        poll.register(fd, select.POLLOUT)
        gone = any(events & select.POLLERR for _, events in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # no descriptor (replaced, closed)
        return False
    if gone:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
    return gone


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` (its subcommands' too) whose usage error is one line on stderr,
    naming the command and the argument at fault, and exit 2: argparse printed its usage
    block above the error, and an unknown option of a command as the top command's."""

    commands: Any = None  # the subparsers action, once added

    def add_subparsers(self, **kwargs: Any) -> Any:
        self.commands = super().add_subparsers(**kwargs)
        return self.commands

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:
        known, extra = self.parse_known_args(args, namespace)
        if extra:
            self._command_of(known).error(f"unrecognized arguments: {' '.join(extra)}")
        return known

    def _command_of(self, known: argparse.Namespace) -> argparse.ArgumentParser:
        """The subcommand's parser ``known`` was parsed by, else this one."""
        if self.commands is None:
            return self
        return self.commands.choices.get(getattr(known, self.commands.dest, None), self)

    def error(self, message: str) -> NoReturn:
        self.exit(Exit.BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def option_type(parse: Callable[[str, str], T], option: str) -> Callable[[str], T]:
    """``parse(text, option)``, whose ``ValueError`` starts by naming ``option``, as the
    argparse type of ``option``: the error without the name, which argparse puts first
    (``argument --nodes: must be a whole number >= 1, got 'x'``)."""

    def typed(text: str) -> T:
        try:
            return parse(text, option)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{option} ")) from None

    return typed


def path_arg(text: str) -> str:
    """The argparse type of a path: never empty (``""``, an unset variable, is the working
    directory: ``--confine ""`` started in ``/`` confined nothing)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path")
    return text


def whole(text: str) -> int:
    """The argparse type of a count: a whole number >= 1 (an explicit ``--streams 0`` is not
    "the default", it is an error)."""
    if not text.strip().isdecimal() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return int(text)
