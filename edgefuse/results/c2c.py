"""The Cache-to-Cache section: c2c.csv, c2c.png and the console table of the ``c2c`` rows
(each receiver alone and with sharers), beside the ``fusers`` registry rows it owns.

Schema of both keys in :mod:`edgefuse.results.recorder`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from rich.table import Table

from edgefuse.results.plotting import colour, new_figure, no_data, save_png
from edgefuse.results.section import DASH, Plot, Section, finite, fmt, rows_csv, with_interval

C2C_CSV_NAME = "c2c.csv"
C2C_PNG_NAME = "c2c.png"
C2C_COLUMNS = ("receiver", "sharers", "mode", "n", "n_mmlu", "mmlu_acc", "mmlu_acc_ci95_low",
               "mmlu_acc_ci95_high", "mmlu_acc_vs_alone", "mmlu_acc_vs_alone_ci95_low",
               "mmlu_acc_vs_alone_ci95_high", "n_dolly", "rougeL", "rougeL_ci95_low",
               "rougeL_ci95_high", "rougeL_vs_alone", "rougeL_vs_alone_ci95_low",
               "rougeL_vs_alone_ci95_high", "latency_ms", "latency_ms_mmlu", "latency_ms_dolly",
               "exchange_ms", "prefill_ms", "fuse_ms", "decode_ms", "bytes_sent", "error")
C2C_MODE_ORDER = ("alone", "t2t", "c2c", "co_c2c", "multi")


def c2c_csv_text(results: Mapping) -> str:
    """CSV of the ``c2c`` rows (columns :data:`C2C_COLUMNS`, sharers joined by ``+``)."""
    rows = ({**row, "sharers": "+".join(row.get("sharers") or [])} for row in results.get("c2c", []))
    return rows_csv(rows, C2C_COLUMNS)


def c2c_label(row: Mapping) -> str:
    """Short label of a c2c row: ``mode`` or ``mode←sharer`` (first word of each sharer)."""
    sharers = [str(s).split("-")[0] for s in row.get("sharers") or []]
    return row["mode"] if not sharers else f"{row['mode']}\u2190{'+'.join(sharers)}"


def _mode_index(mode: str) -> int:
    """Position of ``mode`` in :data:`C2C_MODE_ORDER` (unknown modes last)."""
    return C2C_MODE_ORDER.index(mode) if mode in C2C_MODE_ORDER else 99


def plot_c2c(results: Mapping, path: str | os.PathLike) -> Path:
    """Three panels per receiver row: MMLU accuracy, ROUGE-L and latency (ms, log scale) of
    every evaluated mode, bars in :data:`C2C_MODE_ORDER` order. Rows with an error are
    left out. Returns ``path``."""
    rows = [r for r in results.get("c2c", []) if r.get("error") is None]
    receivers = sorted({r["receiver"] for r in rows})
    fig = new_figure(figsize=(14, 3.2 * max(1, len(receivers))))
    metrics = (("mmlu_acc", "MMLU accuracy"), ("rougeL", "ROUGE-L (Dolly)"), ("latency_ms", "latency per query (ms)"))
    if not receivers:
        no_data(fig.add_subplot(1, 1, 1), "c2c rows")
        return save_png(fig, path)
    for i, rec in enumerate(receivers):
        mine = sorted((r for r in rows if r["receiver"] == rec),
                      key=lambda r: (_mode_index(r["mode"]), r.get("sharers") or []))
        labels = [c2c_label(r) for r in mine]
        colours = [colour(C2C_MODE_ORDER.index(r["mode"]) if r["mode"] in C2C_MODE_ORDER else 0, len(C2C_MODE_ORDER))
                   for r in mine]
        for j, (key, title) in enumerate(metrics):
            ax = fig.add_subplot(len(receivers), 3, 3 * i + j + 1)
            vals = [finite(r.get(key)) or 0.0 for r in mine]
            ax.bar(range(len(vals)), vals, color=colours)
            ax.set_xticks(range(len(vals)), labels, rotation=30, ha="right", fontsize=7)
            if key == "latency_ms" and any(v > 0 for v in vals):
                ax.set_yscale("log")
            ax.set_title(f"{rec}: {title}", fontsize=9)
    return save_png(fig, path)


def c2c_table(results: Mapping) -> Table:
    """Rich table of the ``c2c`` rows: MMLU accuracy and ROUGE-L with their n and 95 %
    interval, the paired difference from the receiver alone (same items, 95 % interval),
    latency (ms) and KB (10**3 bytes) sent per query."""
    table = Table(title="Cache-to-Cache: receivers alone and with sharers (per query; [95 % interval])")
    for name in ("receiver", "mode", "sharers", "MMLU acc (n)", "vs alone", "ROUGE-L (n)", "vs alone",
                 "latency ms", "KB sent"):
        table.add_column(name, justify="left" if name in ("receiver", "mode", "sharers") else "right")
    for r in results.get("c2c", []):
        sent = finite(r.get("bytes_sent"))
        table.add_row(str(r["receiver"]), str(r["mode"]), ", ".join(r.get("sharers") or []) or DASH,
                      with_interval(r, "mmlu_acc", r.get("n_mmlu")), with_interval(r, "mmlu_acc_vs_alone", r.get("mmlu_acc_vs_alone_n"), signed=True),
                      with_interval(r, "rougeL", r.get("n_dolly")), with_interval(r, "rougeL_vs_alone", r.get("rougeL_vs_alone_n"), signed=True),
                      fmt(r.get("latency_ms"), ".0f"),
                      DASH if sent is None else f"{sent / 1e3:.1f}")
    return table



SECTION = Section(
    name="c2c",
    keys=("c2c", "fusers"),
    csv_name=C2C_CSV_NAME,
    csv_text=c2c_csv_text,
    plots=(Plot("c2c_png", C2C_PNG_NAME, plot_c2c),),
    table=c2c_table,
)
