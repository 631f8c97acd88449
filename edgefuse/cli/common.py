"""What the command-line entry points share: one-line errors and override quoting."""

from __future__ import annotations


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
