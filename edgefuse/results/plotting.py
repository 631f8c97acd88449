"""Matplotlib helpers for the section plots: a bare Agg figure, PNG saving, colours,
integer ticks, legend handles and a no-data note.

The only module of :mod:`edgefuse.results` that imports matplotlib, and only inside its
functions: importing the results package (the CLI, the ServerApp) does not load it.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgefuse.io import atomic_write_bytes

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.axis import Axis
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

DPI = 120  # PNG resolution, dots per inch


def new_figure(**kw: Any) -> Figure:
    """A bare constrained-layout :class:`~matplotlib.figure.Figure` on an Agg canvas (no
    pyplot, no global backend switch); ``kw`` go to ``Figure`` (e.g. ``figsize`` in inches)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(layout="constrained", **kw)
    FigureCanvasAgg(fig)
    return fig


def save_png(fig: Figure, path: str | os.PathLike) -> Path:
    """Render ``fig`` as a PNG (:data:`DPI`) and write it to ``path`` atomically; returns the path."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return atomic_write_bytes(path, buf.getvalue())


def colour(i: int, n: int) -> tuple[float, float, float]:
    """The ``i``-th of ``n`` distinct colours (RGB in [0, 1]): tab10 up to 10, else tab20, cycling."""
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if n <= 10 else "tab20"]
    return cmap.colors[i % len(cmap.colors)]


def no_data(ax: Axes, what: str) -> None:
    """Write a grey "no ``what``" in the middle of an empty panel."""
    ax.text(0.5, 0.5, f"no {what}", transform=ax.transAxes, ha="center", va="center", color="grey")


def integer_ticks(axis: Axis) -> None:
    """Put the major ticks of ``axis`` (e.g. ``ax.xaxis``) on integers only (rounds)."""
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def line_handle(**kw: Any) -> Line2D:
    """A legend handle drawn as a line (``kw``: colour, line style, ...) that is on no axes."""
    from matplotlib.lines import Line2D

    return Line2D([], [], **kw)
