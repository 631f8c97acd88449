"""The privacy section: privacy.csv, privacy.png and the console table of the ``privacy``
rows (canary hits and inversion attacks per outbound payload type and protection), beside
the ``privacy_layers`` and ``privacy_audit`` figures it owns.

Schema in :mod:`edgefuse.results.recorder`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from rich.table import Table

from edgefuse.results.plotting import colour, new_figure, no_data, save_png
from edgefuse.results.section import Plot, Section, finite, fmt, rows_csv

PRIVACY_CSV_NAME = "privacy.csv"
PRIVACY_PNG_NAME = "privacy.png"
PRIVACY_FIELDS = ("payload", "protection", "canary_hits", "attacker_token_acc",
                  "attacker_exact_match", "task_acc", "layer", "payloads", "bytes",
                  "attacker_token_acc_n", "attacker_token_acc_ci95_low", "attacker_token_acc_ci95_high",
                  "task_acc_n", "task_acc_ci95_low", "task_acc_ci95_high")


def privacy_csv_text(results: Mapping) -> str:
    """CSV of the ``privacy`` rows (columns :data:`PRIVACY_FIELDS`)."""
    return rows_csv(results.get("privacy", []), PRIVACY_FIELDS)


def _privacy_grid(rows: list[Mapping], key: str) -> tuple[list[str], list[str], list[list[float | None]]]:
    """Payload types, protections (first-seen order) and ``key`` per (payload, protection)."""
    payloads = list(dict.fromkeys(r["payload"] for r in rows))
    modes = list(dict.fromkeys(r["protection"] for r in rows))
    cell = {(r["payload"], r["protection"]): finite(r.get(key)) for r in rows}
    return payloads, modes, [[cell.get((p, m)) for m in modes] for p in payloads]


def plot_privacy(results: Mapping, path: str | os.PathLike) -> Path:
    """Two heat maps over payload type × protection: the attacker's token accuracy and the
    canary hits, plus the task accuracy of each protection. Returns ``path``."""
    rows = list(results.get("privacy", []))
    fig = new_figure(figsize=(13, 3.6))
    if not rows:
        no_data(fig.add_subplot(1, 1, 1), "privacy rows")
        return save_png(fig, path)
    for j, (key, title, cmap, vmax) in enumerate((
            ("attacker_token_acc", "attacker token accuracy (best layer)", "Reds", 1.0),
            ("canary_hits", "canary hits in outbound payloads", "Oranges", None))):
        ax = fig.add_subplot(1, 3, j + 1)
        payloads, modes, grid = _privacy_grid(rows, key)
        data = [[float("nan") if v is None else v for v in line] for line in grid]
        finite_values = [v for line in grid for v in line if v is not None]
        ax.imshow(data, cmap=cmap, vmin=0, vmax=vmax or max(finite_values + [1.0]), aspect="auto")
        for a, line in enumerate(grid):
            for b, v in enumerate(line):
                ax.text(b, a, "n/a" if v is None else (f"{v:.2f}" if key != "canary_hits" else f"{v:.0f}"),
                        ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(modes)), modes, fontsize=8)
        ax.set_yticks(range(len(payloads)), payloads, fontsize=8)
        ax.set_title(title, fontsize=9)
    ax = fig.add_subplot(1, 3, 3)
    task = {r["protection"]: finite(r.get("task_acc")) for r in rows}
    modes = list(task)
    ax.bar(range(len(modes)), [task[m] or 0.0 for m in modes], color=[colour(i, len(modes)) for i in range(len(modes))])
    ax.set_xticks(range(len(modes)), modes, fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_title("task accuracy (MMLU) per protection", fontsize=9)
    fig.suptitle("privacy: what an honest-but-curious receiver recovers", fontsize=10)
    return save_png(fig, path)


def privacy_table(results: Mapping) -> Table:
    """Rich table of the ``privacy`` rows."""
    table = Table(title="Privacy: canary hits and inversion attacks per outbound payload")
    cols = (("payload", "payload", None), ("protection", "protection", None),
            ("canary hits", "canary_hits", ".0f"), ("attacker tok acc", "attacker_token_acc", ".3f"),
            ("exact", "attacker_exact_match", ".2f"), ("layer", "layer", ".0f"),
            ("task acc", "task_acc", ".3f"))
    for name, _, _ in cols:
        table.add_column(name, justify="left" if name in ("payload", "protection") else "right")
    for r in results.get("privacy", []):
        table.add_row(*[str(r[k]) if f is None else fmt(r.get(k), f) for _, k, f in cols])
    return table


SECTION = Section(
    name="privacy",
    keys=("privacy", "privacy_layers", "privacy_audit"),
    csv_name=PRIVACY_CSV_NAME,
    csv_text=privacy_csv_text,
    plots=(Plot("privacy_png", PRIVACY_PNG_NAME, plot_privacy),),
    table=privacy_table,
)
