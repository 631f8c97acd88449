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
               "mmlu_acc_vs_alone_ci95_high", "mmlu_above_chance", "mmlu_resolvable_difference",
               "n_dolly", "rougeL", "rougeL_ci95_low",
               "rougeL_ci95_high", "rougeL_vs_alone", "rougeL_vs_alone_ci95_low",
               "rougeL_vs_alone_ci95_high", "n_gsm8k", "n_nll", "nll", "nll_ci95_low", "nll_ci95_high",
               "nll_vs_alone", "nll_vs_alone_ci95_low", "nll_vs_alone_ci95_high",
               "nll_vs_zero", "nll_vs_zero_ci95_low", "nll_vs_zero_ci95_high",
               "nll_vs_shuffled", "nll_vs_shuffled_ci95_low", "nll_vs_shuffled_ci95_high",
               "latency_ms", "latency_ms_mmlu", "latency_ms_dolly",
               "exchange_ms", "prefill_ms", "fuse_ms", "decode_ms", "bytes_sent", "note", "error")
C2C_MODE_ORDER = ("alone", "t2t", "c2c", "c2c_zero", "c2c_shuffled", "co_c2c", "multi")


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
    """Four panels per receiver row: MMLU accuracy, ROUGE-L, response NLL (nats per
    reference token) and latency (ms, log scale) of every evaluated mode, bars in
    :data:`C2C_MODE_ORDER` order, the 95 % interval as an error bar where the row has one.
    Rows with an error are left out. Returns ``path``."""
    rows = [r for r in results.get("c2c", []) if r.get("error") is None]
    receivers = sorted({r["receiver"] for r in rows})
    fig = new_figure(figsize=(18, 3.2 * max(1, len(receivers))))
    metrics = (("mmlu_acc", "MMLU accuracy"), ("rougeL", "ROUGE-L (Dolly)"),
               ("nll", "response NLL (nats/token)"), ("latency_ms", "latency per query (ms)"))
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
            ax = fig.add_subplot(len(receivers), len(metrics), len(metrics) * i + j + 1)
            vals = [finite(r.get(key)) or 0.0 for r in mine]
            lows = [finite(r.get(f"{key}_ci95_low")) for r in mine]
            highs = [finite(r.get(f"{key}_ci95_high")) for r in mine]
            err = [[v - lo if lo is not None else 0.0 for v, lo in zip(vals, lows)],
                   [hi - v if hi is not None else 0.0 for v, hi in zip(vals, highs)]]
            ax.bar(range(len(vals)), vals, color=colours,
                   yerr=err if key != "latency_ms" else None, capsize=2)
            ax.set_xticks(range(len(vals)), labels, rotation=30, ha="right", fontsize=7)
            if key == "latency_ms" and any(v > 0 for v in vals):
                ax.set_yscale("log")
            ax.set_title(f"{rec}: {title}", fontsize=9)
    return save_png(fig, path)


def c2c_table(results: Mapping) -> Table:
    """Rich table of the ``c2c`` rows: MMLU accuracy, ROUGE-L and the response NLL with
    their n and 95 % interval, the paired difference from the receiver alone (same items,
    95 % interval), c2c's NLL minus each control's, latency (ms) and KB (10**3 bytes) sent
    per query; each row's ``note`` (MMLU at chance, or an n that cannot resolve a 3-point
    difference) in the caption."""
    rows = results.get("c2c", [])
    table = Table(title="Cache-to-Cache: receivers alone and with sharers (per query; [95 % interval])")
    for name in ("receiver", "mode", "sharers", "MMLU acc (n)", "vs alone", "ROUGE-L (n)", "vs alone",
                 "NLL (n)", "vs alone", "c2c − zero / − shuffled", "latency ms", "KB sent"):
        table.add_column(name, justify="left" if name in ("receiver", "mode", "sharers") else "right")
    for r in rows:
        sent = finite(r.get("bytes_sent"))
        controls = [with_interval(r, f"nll_vs_{c}", signed=True) for c in ("zero", "shuffled")]
        table.add_row(str(r["receiver"]), str(r["mode"]), ", ".join(r.get("sharers") or []) or DASH,
                      with_interval(r, "mmlu_acc", r.get("n_mmlu")), with_interval(r, "mmlu_acc_vs_alone", r.get("mmlu_acc_vs_alone_n"), signed=True),
                      with_interval(r, "rougeL", r.get("n_dolly")), with_interval(r, "rougeL_vs_alone", r.get("rougeL_vs_alone_n"), signed=True),
                      with_interval(r, "nll", r.get("n_nll")), with_interval(r, "nll_vs_alone", r.get("nll_vs_alone_n"), signed=True),
                      DASH if controls == [DASH, DASH] else " / ".join(controls),
                      fmt(r.get("latency_ms"), ".0f"),
                      DASH if sent is None else f"{sent / 1e3:.1f}")
    notes = list(dict.fromkeys(part for r in rows if r.get("note") for part in str(r["note"]).split("; ")))
    if notes:
        table.caption = "\n".join(notes)
    return table



SECTION = Section(
    name="c2c",
    keys=("c2c", "fusers"),
    csv_name=C2C_CSV_NAME,
    csv_text=c2c_csv_text,
    plots=(Plot("c2c_png", C2C_PNG_NAME, plot_c2c),),
    table=c2c_table,
)
