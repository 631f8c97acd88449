"""The rounds section: results.csv (one row per round and client), eval_loss.png,
bytes.png and the per-client console table of the last round.

Reads ``results["rounds"]`` (schema in :mod:`edgefuse.results.recorder`). Units: losses
in nats/token, bytes as bytes (MB = 10**6 bytes in plots and tables), wall-clock seconds.
"""

from __future__ import annotations

import csv
import io
import math
import os
from collections.abc import Mapping
from pathlib import Path

from rich.table import Table
from rich.text import Text

from edgefuse.io import to_jsonable
from edgefuse.results.plotting import colour, integer_ticks, line_handle, new_figure, no_data, save_png
from edgefuse.results.section import DASH, MB, Plot, Section, csv_cell, finite, fmt

CSV_NAME = "results.csv"
EVAL_PNG_NAME = "eval_loss.png"
BYTES_PNG_NAME = "bytes.png"
CSV_COLUMNS = (
    "round",
    "partition_id",
    "model",
    "lora_rank",
    "train_loss",
    "eval_loss",
    "eval_ppl",
    "base_eval_loss",
    "base_eval_ppl",
    "bytes_up",
    "bytes_down",
    "seconds",
    "num_examples",
    "status",
    "reason",
)


def csv_text(results: Mapping) -> str:
    """results.csv content: one row per (round, client), columns :data:`CSV_COLUMNS`."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, restval="", extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for rnd in results.get("rounds", []):
        for c in rnd.get("clients", []):
            row = {k: csv_cell(v) for k, v in to_jsonable(c).items()}
            row["round"] = rnd.get("round")
            w.writerow(row)
    return buf.getvalue()


# --------------------------------------------------------------------------- plots


def _clients(results: Mapping) -> dict[int, dict]:
    """Per partition id (sorted): label, base loss and its (round, client) rows in order."""
    out: dict[int, dict] = {}
    for rnd in results.get("rounds", []):
        for c in rnd.get("clients", []):
            s = out.setdefault(c["partition_id"], {"rows": [], "base": None})
            s["rows"].append((rnd.get("round"), c))
            # Label from the latest round; base loss = latest finite value.
            s["label"] = f"p{c['partition_id']} {c.get('model')} r{c.get('lora_rank')}"
            if finite(c.get("base_eval_loss")) is not None:
                s["base"] = finite(c.get("base_eval_loss"))
    return dict(sorted(out.items()))


def plot_eval_loss(results: Mapping, path: str | os.PathLike) -> Path:
    """PNG of held-out loss (nats/token) per round, one line per client.

    Each client's base-model loss is a dashed horizontal line of the same colour.
    Rounds where a client has no eval loss (failed, rejected) are gaps. Returns ``path``.
    """
    clients = _clients(results)
    fig = new_figure(figsize=(9, 5))
    ax = fig.add_subplot()
    plotted = False
    for i, s in enumerate(clients.values()):
        c_i = colour(i, len(clients))
        xs = [r for r, _ in s["rows"]]
        # NaN breaks the line, so missing rounds show as gaps.
        ys = [finite(c.get("eval_loss")) for _, c in s["rows"]]
        ys = [math.nan if y is None else y for y in ys]
        ax.plot(xs, ys, marker="o", color=c_i, label=s["label"])
        if s["base"] is not None:
            ax.axhline(s["base"], color=c_i, linestyle="--", linewidth=1.2, alpha=0.8)
        plotted = plotted or any(math.isfinite(y) for y in ys) or s["base"] is not None
    if not plotted:
        no_data(ax, "eval losses")
    ax.set_xlabel("round")
    ax.set_ylabel("held-out loss (nats/token)")
    ax.set_title("Held-out loss per client (dashed: base model)")
    integer_ticks(ax.xaxis)
    ax.grid(True, alpha=0.3)
    if clients:
        handles, labels = ax.get_legend_handles_labels()
        handles.append(line_handle(color="grey", linestyle="--"))
        labels.append("base model")
        ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    return save_png(fig, path)


def plot_bytes(results: Mapping, path: str | os.PathLike) -> Path:
    """PNG of bytes uploaded and downloaded per round (MB = 10**6 bytes).

    Two panels (up: client to server, down: server to client), grouped bars per
    client in each round, colours as in :func:`plot_eval_loss`. Returns ``path``.
    """
    clients = _clients(results)
    rounds = [r.get("round") for r in results.get("rounds", [])]
    fig = new_figure(figsize=(9, 6))
    ax_up, ax_down = fig.subplots(2, 1, sharex=True)
    width = 0.8 / max(len(clients), 1)
    for i, s in enumerate(clients.values()):
        c_i = colour(i, len(clients))
        offset = (i - (len(clients) - 1) / 2) * width
        xs = [r + offset for r, _ in s["rows"]]
        for ax, key in ((ax_up, "bytes_up"), (ax_down, "bytes_down")):
            mb = [(c.get(key) or 0) / MB for _, c in s["rows"]]
            ax.bar(xs, mb, width=width, color=c_i, label=s["label"] if ax is ax_up else None)
    for ax, title in ((ax_up, "uploaded (client \u2192 server)"), (ax_down, "downloaded (server \u2192 client)")):
        ax.set_title(title)
        ax.set_ylabel("MB")
        ax.grid(True, axis="y", alpha=0.3)
        if not clients:
            no_data(ax, "rounds")
    if rounds and len(rounds) <= 30:
        ax_down.set_xticks(rounds)
    else:
        integer_ticks(ax_down.xaxis)
    ax_down.set_xlabel("round")
    if clients:
        ax_up.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    return save_png(fig, path)


# --------------------------------------------------------------------------- console


def console_table(results: Mapping) -> Table:
    """Rich table, one row per client of the last round.

    Columns: partition, model, LoRA rank, base and final held-out loss (nats/token),
    their difference (final - base; negative is better), final perplexity, MB
    (10**6 bytes) up and down and client seconds, both summed over all rounds. A
    status column is added when a client of the last round is not ``ok``.
    """
    rounds = results.get("rounds") or []
    last = rounds[-1] if rounds else {"round": None, "clients": []}
    totals: dict[int, list[float]] = {}  # partition id -> [bytes up, bytes down, seconds]
    for rnd in rounds:
        for c in rnd.get("clients", []):
            t = totals.setdefault(c["partition_id"], [0.0, 0.0, 0.0])
            t[0] += finite(c.get("bytes_up")) or 0.0
            t[1] += finite(c.get("bytes_down")) or 0.0
            t[2] += finite(c.get("seconds")) or 0.0
    clients = sorted(last.get("clients", []), key=lambda c: c["partition_id"])
    show_status = any(c.get("status", "ok") != "ok" for c in clients)

    table = Table(
        title=f"edgefuse run: last round {last['round']} ({len(rounds)} rounds), status {results.get('status')}",
        caption="loss in nats/token; \u0394 = final \u2212 base; MB and seconds summed over all rounds",
    )
    for name in ("partition", "model", "rank", "base loss", "final loss", "\u0394 loss", "ppl", "MB up", "MB down", "seconds"):
        table.add_column(name, justify="left" if name == "model" else "right")
    if show_status:
        table.add_column("status")
    for c in clients:
        pid = c["partition_id"]
        base, final = finite(c.get("base_eval_loss")), finite(c.get("eval_loss"))
        if base is None or final is None:
            delta = Text(DASH)
        else:
            d = final - base
            delta = Text(f"{d:+.4f}", style="green" if d < 0 else "red" if d > 0 else "")
        up, down, secs = totals[pid]
        row = [
            str(pid),
            str(c.get("model")),
            str(c.get("lora_rank")),
            fmt(base, ".4f"),
            fmt(final, ".4f"),
            delta,
            fmt(c.get("eval_ppl"), ".2f"),
            f"{up / MB:.2f}",
            f"{down / MB:.2f}",
            f"{secs:.1f}",
        ]
        if show_status:
            status = c.get("status", "ok")
            row.append(status if not c.get("reason") else f"{status}: {c['reason']}")
        table.add_row(*row)
    return table


SECTION = Section(
    name="training",
    keys=("rounds",),
    csv_name=CSV_NAME,
    csv_text=csv_text,
    csv_key="csv",
    plots=(Plot("eval_png", EVAL_PNG_NAME, plot_eval_loss), Plot("bytes_png", BYTES_PNG_NAME, plot_bytes)),
    table=console_table,
    always=True,
)
