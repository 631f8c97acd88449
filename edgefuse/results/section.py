"""The shape of a results section, and the cell helpers every section shares.

A :class:`Section` is what one phase contributes to the run folder: the top-level
results.json keys it owns, a CSV, PNG plots and a console table. The recorder
(:mod:`edgefuse.results.recorder`) writes and prints every section of
:data:`edgefuse.results.sections.SECTIONS` without knowing which phases exist.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.table import Table

MB = 1e6  # bytes per MB in plots and tables (decimal megabyte)
DASH = "\u2014"  # a table cell without a value


@dataclass(frozen=True)
class Plot:
    """One PNG of a section.

    Attributes:
        key: its key in the paths :func:`~edgefuse.results.recorder.write_outputs` returns
            (e.g. ``"c2c_png"``).
        name: its file name in the run folder (e.g. ``"c2c.png"``).
        draw: ``draw(results, path) -> path``: writes the PNG atomically and returns ``path``.
    """

    key: str
    name: str
    draw: Callable[[Mapping, Path], Path]


@dataclass(frozen=True)
class Section:
    """One phase's part of the outputs: its results keys, CSV, plots and console table.

    Attributes:
        name: short name (``"c2c"``); the CSV's path key defaults to ``f"{name}_csv"``.
        keys: the top-level results keys the section owns; the first holds its rows, and
            the section has output only when that value is non-empty (unless ``always``).
        csv_name: the CSV's file name in the run folder, or ``None`` for no CSV.
        csv_text: ``csv_text(results) -> str``, the CSV's content (given the scrubbed
            results, see :func:`~edgefuse.results.recorder.redact_results`).
        plots: the section's PNGs, each drawn from the in-memory results.
        table: ``table(results) -> rich Table | None``, printed by
            :func:`~edgefuse.results.recorder.print_summary` (``None``: nothing to print).
        always: write and print the section even when its rows are empty (the rounds).
        csv_key: the CSV's key in the returned paths (default ``f"{name}_csv"``).

    Raises:
        ValueError: no ``keys``, or only one of ``csv_name`` / ``csv_text`` given.
    """

    name: str
    keys: tuple[str, ...]
    csv_name: str | None = None
    csv_text: Callable[[Mapping], str] | None = None
    plots: tuple[Plot, ...] = ()
    table: Callable[[Mapping], Table | None] | None = None
    always: bool = False
    csv_key: str = ""

    def __post_init__(self) -> None:
        if not self.keys:
            raise ValueError(f"section {self.name!r} owns no results keys")
        if (self.csv_name is None) != (self.csv_text is None):
            raise ValueError(f"section {self.name!r}: give both csv_name and csv_text, or neither")
        if not self.csv_key:
            object.__setattr__(self, "csv_key", f"{self.name}_csv")

    def present(self, results: Mapping) -> bool:
        """Whether ``results`` has this section's rows (always true for an ``always`` section)."""
        return self.always or bool(results.get(self.keys[0]))


# --------------------------------------------------------------------------- cells


def finite(x: Any) -> float | None:
    """``x`` as a float when it is a finite number, else ``None`` (NaN, inf, None, text)."""
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def fmt(x: Any, spec: str) -> str:
    """A table cell: ``format(x, spec)`` for a finite number, else an em dash."""
    x = finite(x)
    return DASH if x is None else format(x, spec)


def csv_cell(v: Any) -> Any:
    """A CSV cell: ``None`` and non-finite floats become empty, anything else is kept."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return ""
    return v


def rows_csv(rows: Iterable[Mapping], fields: Sequence[str]) -> str:
    """CSV text of ``rows`` (dicts) with the columns ``fields``: a header line, then one
    line per row; absent keys, ``None`` and non-finite floats are empty cells, other keys
    are left out."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(fields), extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for row in rows:
        w.writerow({k: csv_cell(row.get(k)) for k in fields})
    return buf.getvalue()


def with_interval(row: Mapping, key: str, n=None, *, interval: str | None = None, signed: bool = False,
                  spec: str = ".3f") -> str:
    """A table cell ``0.250 [0.142, 0.403] (40)``: ``row[key]`` with its ``key_ci95_low`` /
    ``key_ci95_high`` interval (``interval``: another prefix for them) and ``n`` when given
    (``signed``: a difference, shown with its sign); a dash when the value is missing or not
    finite."""
    v = finite(row.get(key))
    if v is None:
        return DASH
    spec = ("+" + spec) if signed else spec
    base = interval or key
    lo, hi = finite(row.get(f"{base}_ci95_low")), finite(row.get(f"{base}_ci95_high"))
    text = format(v, spec) + ("" if lo is None or hi is None else f" [{lo:{spec}}, {hi:{spec}}]")
    return text + ("" if n is None else f" ({n})")
