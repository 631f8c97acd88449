"""The cloud decoding section: decoding.csv, decoding.png and the console table of the
``decoding`` rows (one per device model and mode), beside the per-generation
``decoding_records`` it owns.

The CSV's columns are :data:`edgefuse.cloud.devices.ROW_FIELDS`, the fields the decoding
evaluation fills; schema in :mod:`edgefuse.results.recorder`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from rich.table import Table

from edgefuse.results.plotting import colour, new_figure, no_data, save_png
from edgefuse.results.section import Plot, Section, finite, fmt, rows_csv, with_interval

DECODING_CSV_NAME = "decoding.csv"
DECODING_PNG_NAME = "decoding.png"


def decoding_csv_text(results: Mapping) -> str:
    """CSV of the ``decoding`` rows (columns of :data:`edgefuse.cloud.devices.ROW_FIELDS`)."""
    # Here, not at the top: the cloud package loads torch, which a results reader does not need.
    from edgefuse.cloud.devices import ROW_FIELDS

    return rows_csv(results.get("decoding", []), ROW_FIELDS)


def plot_decoding(results: Mapping, path: str | os.PathLike) -> Path:
    """Four panels over the decoding modes: tokens/s, round trips per token, bytes per
    token each way (log scale), and agreement with the cloud-only output. Returns ``path``."""
    rows = list(results.get("decoding", []))
    fig = new_figure(figsize=(14, 3.4))
    if not rows:
        no_data(fig.add_subplot(1, 1, 1), "decoding rows")
        return save_png(fig, path)
    models = {r.get("device_model") for r in rows}
    labels = [f"{r.get('device_model')} {r['mode']}" if len(models) > 1 else r["mode"] for r in rows]
    x = range(len(rows))
    colours = [colour(i, len(rows)) for i in x]
    panels = (("tokens_per_s", "tokens/s per device"), ("round_trips_per_token", "round trips per token"),
              (None, "bytes per token (up / down)"), ("agreement_with_target", "agreement with cloud-only"))
    for j, (key, title) in enumerate(panels):
        ax = fig.add_subplot(1, 4, j + 1)
        if key is None:
            up = [finite(r.get("bytes_up_per_token")) or 0.0 for r in rows]
            down = [finite(r.get("bytes_down_per_token")) or 0.0 for r in rows]
            ax.bar([i - 0.2 for i in x], up, width=0.4, label="up")
            ax.bar([i + 0.2 for i in x], down, width=0.4, label="down")
            if any(v > 0 for v in up + down):
                ax.set_yscale("log")
            ax.legend(fontsize="small")
        else:
            ax.bar(list(x), [finite(r.get(key)) or 0.0 for r in rows], color=colours)
        ax.set_xticks(list(x), labels, rotation=30, ha="right", fontsize=7)
        ax.set_title(title, fontsize=9)
    rtt = rows[0].get("rtt_ms")
    fig.suptitle(f"cloud decoding: {rows[0].get('devices')} sessions, emulated RTT {rtt} ms", fontsize=10)
    return save_png(fig, path)


def decoding_table(results: Mapping) -> Table:
    """Rich table of the ``decoding`` rows (per generated token: rate, round trips, bytes
    each way, acceptance; agreement with the cloud-only output and task scores with their n
    and 95 % interval)."""
    table = Table(title="Decoding with the cloud LLM (per generated token; [95 % interval] (n))")
    cols = (("device", "device_model", None), ("tokenizer", "tokenizer", None), ("mode", "mode", None),
            ("tok/s", "tokens_per_s", ".2f"), ("ms/tok", "ms_per_token", ".0f"),
            ("RT/tok", "round_trips_per_token", ".2f"), ("B up", "bytes_up_per_token", ".0f"),
            ("B down", "bytes_down_per_token", ".0f"), ("accept", "acceptance_rate", ".2f"),
            ("fallbacks", "fallbacks", ".0f"))
    scored = (("agree", "agreement_with_target", "agreement"), ("GSM8K EM", "gsm8k_exact_match", "gsm8k"),
              ("ROUGE-L", "rouge_l", "rouge_l"))
    for name in [c[0] for c in cols] + [s[0] for s in scored]:
        table.add_column(name, justify="left" if name in ("device", "tokenizer", "mode") else "right")
    for r in results.get("decoding", []):
        cells = [str(r.get(k)) if f is None else fmt(r.get(k), f) for _, k, f in cols]
        cells += [with_interval(r, key, r.get(f"{base}_n"), interval=base, spec=".2f")
                  for _, key, base in scored]
        table.add_row(*cells)
    return table



SECTION = Section(
    name="decoding",
    keys=("decoding", "decoding_records"),
    csv_name=DECODING_CSV_NAME,
    csv_text=decoding_csv_text,
    plots=(Plot("decoding_png", DECODING_PNG_NAME, plot_decoding),),
    table=decoding_table,
)
