"""What the command-line entry points share: one-line errors (a parser and an exception) and
override quoting."""

from __future__ import annotations

import argparse
import sys


class Parser(argparse.ArgumentParser):
    """``argparse`` that reports a usage error as one line (and exits 2), not usage + error."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


class CLIError(Exception):
    """A failure a command reports as one line on stderr, exiting with ``status``."""

    def __init__(self, message, status: int = 2):
        super().__init__(message)
        self.status = status


def one_line(e: BaseException | str) -> str:
    """An error message on one line (a multi-line message's lines joined by `` | ``)."""
    return " | ".join(line.strip() for line in str(e).splitlines() if line.strip())


def quote_override(value: str) -> str:
    """Quote a value for the Hydra override grammar (``'...'``, backslashes and quotes escaped)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
