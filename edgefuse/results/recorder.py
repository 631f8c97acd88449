"""Per-run outputs: results.json, results.csv, two PNG plots and a console summary.

The server of a federated run owns one :class:`RunRecorder` and calls
:meth:`RunRecorder.save` after every round, so a crash loses nothing already
measured. Every file is written atomically (temp file in the same folder, fsync,
``os.replace``): a reader sees either the old file or the new one, never half.

results.json schema (an interface; keep stable)::

    {
      "config": {...resolved config as a plain dict...},
      "rounds": [
        {"round": int,
         "seconds": {"train": float, "evaluate": float, "aggregate": float, "total": float},
         "clients": [{"partition_id": int, "model": str, "lora_rank": int,
                      "train_loss": float|None, "eval_loss": float|None, "eval_ppl": float|None,
                      "base_eval_loss": float|None, "base_eval_ppl": float|None,
                      "bytes_up": int, "bytes_down": int, "seconds": float,
                      "num_examples": int, "status": "ok"|"failed"|"rejected",
                      "reason": str|None}],
         "groups": [{"model": str, "clients": [int], "method": "fedavg"|"flexlora",
                     "truncation_error": float|None, "adapter_dir": str|None}]}
      ],
      "fusers": [{"sharer": str, "receiver": str, "params": int, "bytes": int,
                  "version": str, "train_steps": int, "action": "trained"|"carried_over"|"cached",
                  "round": int, "train_seconds": float, "val_loss": float|None,
                  "alone_val_loss": float|None, "download": str}],
      "c2c": [{"receiver": str, "sharers": [str], "mode": "alone"|"t2t"|"c2c"|"co_c2c"|"multi",
               "n": int, "mmlu_acc": float|None, "rougeL": float|None,
               "latency_ms": float|None, "bytes_sent": float|None, ...breakdowns}],
      "decoding": [{"mode": "edge"|"cloud"|"spec_sync"|"spec_async"|"fusion_static"|
                    "fusion_adaptive", "rtt_ms": float, "devices": int, "tokens_per_s": float,
                    "round_trips_per_token": float, "bytes_down_per_token": float,
                    "bytes_up_per_token": float, "acceptance_rate": float|None,
                    "identical_to_target": bool|None, "agreement_with_target": float|None,
                    "gsm8k_exact_match": float|None, "rouge_l": float|None, ...}],
      "decoding_records": [{"qid", "mode", "device", "tokens", "text", ...per generation}],
      "privacy": [{"payload": "kv"|"draft_tokens"|"logits_topk"|"hidden"|"adapter",
                   "protection": "none"|"redact"|"rephrase"|"both", "canary_hits": int,
                   "attacker_token_acc": float|None, "attacker_exact_match": float|None,
                   "task_acc": float|None, "layer": int|None, "payloads": int, "bytes": int}],
      "privacy_layers": [{"payload", "layer", "protection", "attacker_token_acc",
                          "attacker_exact_match"}],
      "privacy_audit": {payload type: {"payloads", "bytes", "canary_hits", "hit_kinds"}},
      "summary": {...free-form...},
      "status": "running"|"completed"|"failed"|"stopped",
      "error": str|None
    }

Private text: every file is written through :func:`write_json_csv`, which first passes the
results through :func:`redact_results`: unless ``config.privacy.debug_text`` is true, the
value of every :data:`TEXT_FIELDS` key (prompts, answers, references, generated text and
token ids), anywhere outside ``config``, becomes a tag from :func:`scrub_text`. The
in-memory results (console tables) are left as they are.

Units: losses are mean cross-entropy in nats/token, perplexity is ``exp(loss)``,
bytes are bytes (plots and tables show MB = 10**6 bytes), seconds are wall-clock
seconds.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import hashlib
import hmac
import io
import json
import logging
import math
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator
from rich.console import Console
from rich.table import Table
from rich.text import Text

log = logging.getLogger(__name__)

JSON_NAME = "results.json"
CSV_NAME = "results.csv"
EVAL_PNG_NAME = "eval_loss.png"
BYTES_PNG_NAME = "bytes.png"
C2C_PNG_NAME = "c2c.png"
C2C_CSV_NAME = "c2c.csv"
DECODING_PNG_NAME = "decoding.png"
DECODING_CSV_NAME = "decoding.csv"
PRIVACY_PNG_NAME = "privacy.png"
PRIVACY_CSV_NAME = "privacy.csv"
PRIVACY_FIELDS = ("payload", "protection", "canary_hits", "attacker_token_acc",
                  "attacker_exact_match", "task_acc", "layer", "payloads", "bytes")
C2C_COLUMNS = ("receiver", "sharers", "mode", "n", "mmlu_acc", "rougeL", "latency_ms",
               "latency_ms_mmlu", "latency_ms_dolly", "exchange_ms", "prefill_ms", "fuse_ms",
               "decode_ms", "bytes_sent", "error")

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
RUN_STATUSES = ("running", "completed", "failed", "stopped")
MB = 1e6  # bytes per MB in plots and tables (decimal megabyte)


from edgefuse.io import atomic_write_bytes, atomic_write_dir, atomic_write_json, atomic_write_text, to_jsonable  # noqa: E402,F401


# --------------------------------------------------------------------------- private text

# Keys whose values are free text (or token ids of text) from prompts, answers and
# generations; scrubbed wherever they appear in results outside ``config``.
TEXT_FIELDS = frozenset({
    "text", "texts", "prompt", "prompts", "question", "answer", "answers", "reference",
    "references", "instruction", "context", "response", "hint", "hints", "completion",
    "generation", "tokens", "canary", "original", "redacted", "rephrased",
})
_TAG_KEY = os.urandom(32)  # per process: tags compare within a run, cannot be dictionary-looked-up


def scrub_text(value: Any, debug_text: bool = False) -> Any:
    """``value`` itself when ``debug_text``; otherwise a tag that keeps no text.

    A string becomes ``<text N chars hmac:xxxxxxxx>`` (N = its length; 8 hex of an
    HMAC-SHA256 under a random per-process key, so equal texts of one run get equal tags but
    a tag cannot be matched by hashing guesses); a list/tuple/dict (e.g. token ids) becomes
    ``<data N items hmac:xxxxxxxx>`` over its JSON. ``None``, numbers and booleans (an
    MMLU answer index) are returned unchanged.
    """
    if debug_text or value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str):
        kind, size, data = "text", f"{len(value)} chars", value
    else:
        data = json.dumps(to_jsonable(value), sort_keys=True, ensure_ascii=False, default=str)
        n = len(value) if hasattr(value, "__len__") else 1
        kind, size = "data", f"{n} items"
    tag = hmac.new(_TAG_KEY, data.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()[:8]
    return f"<{kind} {size} hmac:{tag}>"


def redact_results(results: Mapping, debug_text: bool | None = None) -> Mapping:
    """``results`` with every :data:`TEXT_FIELDS` value (outside ``config``) scrubbed by
    :func:`scrub_text`; a copy, the input is not changed. ``debug_text=None`` reads
    ``results["config"]["privacy"]["debug_text"]`` (default false). With debug on, the
    input is returned as is."""
    if debug_text is None:
        privacy = (results.get("config") or {}).get("privacy") or {}
        debug_text = bool(privacy.get("debug_text", False)) if isinstance(privacy, Mapping) else False
    if debug_text:
        return results

    def walk(obj: Any) -> Any:
        if isinstance(obj, Mapping):
            return {k: scrub_text(v) if k in TEXT_FIELDS else walk(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [walk(v) for v in obj]
        return obj

    return {k: v if k == "config" else walk(v) for k, v in results.items()}


# --------------------------------------------------------------------------- load


def load_results(path: str | os.PathLike) -> dict:
    """Read a results.json (or the results.json inside a run folder).

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the file is not JSON, or lacks a ``config`` object or ``rounds`` list;
            the message names the file.
    """
    path = Path(path)
    if path.is_dir():
        path = path / JSON_NAME
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not an edgefuse results file (top level is not an object)")
    missing = [k for k in ("config", "rounds") if k not in data]
    if missing:
        raise ValueError(f"{path}: not an edgefuse results file (missing {', '.join(missing)})")
    if not isinstance(data["config"], dict) or not isinstance(data["rounds"], list):
        raise ValueError(f"{path}: not an edgefuse results file (config must be an object, rounds a list)")
    return data


# --------------------------------------------------------------------------- csv


def _csv_cell(v: Any) -> Any:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return ""
    return v


def csv_text(results: Mapping) -> str:
    """results.csv content: one row per (round, client), columns :data:`CSV_COLUMNS`."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, restval="", extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for rnd in results.get("rounds", []):
        for c in rnd.get("clients", []):
            row = {k: _csv_cell(v) for k, v in to_jsonable(c).items()}
            row["round"] = rnd.get("round")
            w.writerow(row)
    return buf.getvalue()


# --------------------------------------------------------------------------- plots


def _finite(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def _clients(results: Mapping) -> dict[int, dict]:
    """Per partition id (sorted): label, base loss and its (round, client) rows in order."""
    out: dict[int, dict] = {}
    for rnd in results.get("rounds", []):
        for c in rnd.get("clients", []):
            s = out.setdefault(c["partition_id"], {"rows": [], "base": None})
            s["rows"].append((rnd.get("round"), c))
            # Label from the latest round; base loss = latest finite value.
            s["label"] = f"p{c['partition_id']} {c.get('model')} r{c.get('lora_rank')}"
            if _finite(c.get("base_eval_loss")) is not None:
                s["base"] = _finite(c.get("base_eval_loss"))
    return dict(sorted(out.items()))


def _colour(i: int, n: int):
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if n <= 10 else "tab20"]
    return cmap.colors[i % len(cmap.colors)]


def _new_figure(**kw) -> Figure:
    # A bare Figure with an Agg canvas: no pyplot, no global backend switch.
    fig = Figure(layout="constrained", **kw)
    FigureCanvasAgg(fig)
    return fig


def _save_png(fig: Figure, path: str | os.PathLike) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    return atomic_write_bytes(path, buf.getvalue())


def _no_data(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what}", transform=ax.transAxes, ha="center", va="center", color="grey")


def plot_eval_loss(results: Mapping, path: str | os.PathLike) -> Path:
    """PNG of held-out loss (nats/token) per round, one line per client.

    Each client's base-model loss is a dashed horizontal line of the same colour.
    Rounds where a client has no eval loss (failed, rejected) are gaps. Returns ``path``.
    """
    clients = _clients(results)
    fig = _new_figure(figsize=(9, 5))
    ax = fig.add_subplot()
    plotted = False
    for i, s in enumerate(clients.values()):
        colour = _colour(i, len(clients))
        xs = [r for r, _ in s["rows"]]
        # NaN breaks the line, so missing rounds show as gaps.
        ys = [_finite(c.get("eval_loss")) for _, c in s["rows"]]
        ys = [math.nan if y is None else y for y in ys]
        ax.plot(xs, ys, marker="o", color=colour, label=s["label"])
        if s["base"] is not None:
            ax.axhline(s["base"], color=colour, linestyle="--", linewidth=1.2, alpha=0.8)
        plotted = plotted or any(math.isfinite(y) for y in ys) or s["base"] is not None
    if not plotted:
        _no_data(ax, "eval losses")
    ax.set_xlabel("round")
    ax.set_ylabel("held-out loss (nats/token)")
    ax.set_title("Held-out loss per client (dashed: base model)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    if clients:
        handles, labels = ax.get_legend_handles_labels()
        handles.append(Line2D([], [], color="grey", linestyle="--"))
        labels.append("base model")
        ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    return _save_png(fig, path)


def plot_bytes(results: Mapping, path: str | os.PathLike) -> Path:
    """PNG of bytes uploaded and downloaded per round (MB = 10**6 bytes).

    Two panels (up: client to server, down: server to client), grouped bars per
    client in each round, colours as in :func:`plot_eval_loss`. Returns ``path``.
    """
    clients = _clients(results)
    rounds = [r.get("round") for r in results.get("rounds", [])]
    fig = _new_figure(figsize=(9, 6))
    ax_up, ax_down = fig.subplots(2, 1, sharex=True)
    width = 0.8 / max(len(clients), 1)
    for i, s in enumerate(clients.values()):
        colour = _colour(i, len(clients))
        offset = (i - (len(clients) - 1) / 2) * width
        xs = [r + offset for r, _ in s["rows"]]
        for ax, key in ((ax_up, "bytes_up"), (ax_down, "bytes_down")):
            mb = [(c.get(key) or 0) / MB for _, c in s["rows"]]
            ax.bar(xs, mb, width=width, color=colour, label=s["label"] if ax is ax_up else None)
    for ax, title in ((ax_up, "uploaded (client \u2192 server)"), (ax_down, "downloaded (server \u2192 client)")):
        ax.set_title(title)
        ax.set_ylabel("MB")
        ax.grid(True, axis="y", alpha=0.3)
        if not clients:
            _no_data(ax, "rounds")
    if rounds and len(rounds) <= 30:
        ax_down.set_xticks(rounds)
    else:
        ax_down.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_down.set_xlabel("round")
    if clients:
        ax_up.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    return _save_png(fig, path)


# --------------------------------------------------------------------------- outputs


def c2c_csv_text(results: Mapping) -> str:
    """CSV of the ``c2c`` rows (sharers joined by ``+``)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=C2C_COLUMNS, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for row in results.get("c2c", []):
        w.writerow({k: ("+".join(row.get(k) or []) if k == "sharers" else _csv_cell(row.get(k)))
                    for k in C2C_COLUMNS})
    return buf.getvalue()


C2C_MODE_ORDER = ("alone", "t2t", "c2c", "co_c2c", "multi")


def c2c_label(row: Mapping) -> str:
    """Short label of a c2c row: ``mode`` or ``mode←sharer`` (first word of each sharer)."""
    sharers = [str(s).split("-")[0] for s in row.get("sharers") or []]
    return row["mode"] if not sharers else f"{row['mode']}\u2190{'+'.join(sharers)}"


def plot_c2c(results: Mapping, path: str | os.PathLike) -> Path:
    """Three panels per receiver row: MMLU accuracy, ROUGE-L and latency (ms, log scale) of
    every evaluated mode, bars in :data:`C2C_MODE_ORDER` order."""
    rows = [r for r in results.get("c2c", []) if r.get("error") is None]
    receivers = sorted({r["receiver"] for r in rows})
    fig = _new_figure(figsize=(14, 3.2 * max(1, len(receivers))))
    metrics = (("mmlu_acc", "MMLU accuracy"), ("rougeL", "ROUGE-L (Dolly)"), ("latency_ms", "latency per query (ms)"))
    if not receivers:
        _no_data(fig.add_subplot(1, 1, 1), "c2c rows")
        return _save_png(fig, path)
    for i, rec in enumerate(receivers):
        mine = sorted((r for r in rows if r["receiver"] == rec),
                      key=lambda r: (C2C_MODE_ORDER.index(r["mode"]) if r["mode"] in C2C_MODE_ORDER else 99,
                                     r.get("sharers") or []))
        labels = [c2c_label(r) for r in mine]
        for j, (key, title) in enumerate(metrics):
            ax = fig.add_subplot(len(receivers), 3, 3 * i + j + 1)
            vals = [_finite(r.get(key)) or 0.0 for r in mine]
            ax.bar(range(len(vals)), vals, color=[_colour(C2C_MODE_ORDER.index(r["mode"]) if r["mode"] in C2C_MODE_ORDER else 0, len(C2C_MODE_ORDER)) for r in mine])
            ax.set_xticks(range(len(vals)), labels, rotation=30, ha="right", fontsize=7)
            if key == "latency_ms" and any(v > 0 for v in vals):
                ax.set_yscale("log")
            ax.set_title(f"{rec}: {title}", fontsize=9)
    return _save_png(fig, path)


def c2c_table(results: Mapping) -> Table:
    """Rich table of the ``c2c`` rows: MMLU accuracy, ROUGE-L, latency (ms) and KB sent per query."""
    table = Table(title="Cache-to-Cache: receivers alone and with sharers (per query)")
    for name in ("receiver", "mode", "sharers", "n", "MMLU acc", "ROUGE-L", "latency ms", "KB sent"):
        table.add_column(name, justify="left" if name in ("receiver", "mode", "sharers") else "right")
    for r in results.get("c2c", []):
        sent = _finite(r.get("bytes_sent"))
        table.add_row(str(r["receiver"]), str(r["mode"]), ", ".join(r.get("sharers") or []) or "\u2014",
                      str(r.get("n")), _fmt(r.get("mmlu_acc"), ".3f"), _fmt(r.get("rougeL"), ".3f"),
                      _fmt(r.get("latency_ms"), ".0f"),
                      "\u2014" if sent is None else f"{sent / 1e3:.1f}")
    return table


def decoding_csv_text(results: Mapping) -> str:
    """CSV of the ``decoding`` rows (columns of :data:`edgefuse.cloud.devices.ROW_FIELDS`)."""
    from edgefuse.cloud.devices import ROW_FIELDS

    return _rows_csv(results.get("decoding", []), ROW_FIELDS)


def _rows_csv(rows, fields) -> str:
    """CSV text of ``rows`` (dicts) with the columns ``fields``."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=fields, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for row in rows:
        w.writerow({k: _csv_cell(row.get(k)) for k in fields})
    return buf.getvalue()


def plot_decoding(results: Mapping, path: str | os.PathLike) -> Path:
    """Four panels over the decoding modes: tokens/s, round trips per token, bytes per
    token each way (log scale), and agreement with the cloud-only output."""
    rows = list(results.get("decoding", []))
    fig = _new_figure(figsize=(14, 3.4))
    if not rows:
        _no_data(fig.add_subplot(1, 1, 1), "decoding rows")
        return _save_png(fig, path)
    labels = [r["mode"] for r in rows]
    x = range(len(rows))
    colours = [_colour(i, len(rows)) for i in x]
    panels = (("tokens_per_s", "tokens/s per device"), ("round_trips_per_token", "round trips per token"),
              (None, "bytes per token (up / down)"), ("agreement_with_target", "agreement with cloud-only"))
    for j, (key, title) in enumerate(panels):
        ax = fig.add_subplot(1, 4, j + 1)
        if key is None:
            up = [_finite(r.get("bytes_up_per_token")) or 0.0 for r in rows]
            down = [_finite(r.get("bytes_down_per_token")) or 0.0 for r in rows]
            ax.bar([i - 0.2 for i in x], up, width=0.4, label="up")
            ax.bar([i + 0.2 for i in x], down, width=0.4, label="down")
            if any(v > 0 for v in up + down):
                ax.set_yscale("log")
            ax.legend(fontsize="small")
        else:
            ax.bar(list(x), [_finite(r.get(key)) or 0.0 for r in rows], color=colours)
        ax.set_xticks(list(x), labels, rotation=30, ha="right", fontsize=7)
        ax.set_title(title, fontsize=9)
    rtt = rows[0].get("rtt_ms")
    fig.suptitle(f"cloud decoding: {rows[0].get('devices')} sessions, emulated RTT {rtt} ms", fontsize=10)
    return _save_png(fig, path)


def decoding_table(results: Mapping) -> Table:
    """Rich table of the ``decoding`` rows."""
    table = Table(title="Decoding with the cloud LLM (per generated token)")
    cols = (("mode", "mode", None), ("tok/s", "tokens_per_s", ".2f"), ("ms/tok", "ms_per_token", ".0f"),
            ("RT/tok", "round_trips_per_token", ".2f"), ("B up", "bytes_up_per_token", ".0f"),
            ("B down", "bytes_down_per_token", ".0f"), ("accept", "acceptance_rate", ".2f"),
            ("agree", "agreement_with_target", ".2f"), ("GSM8K EM", "gsm8k_exact_match", ".2f"),
            ("ROUGE-L", "rouge_l", ".3f"), ("fallbacks", "fallbacks", ".0f"))
    for name, _, _ in cols:
        table.add_column(name, justify="left" if name == "mode" else "right")
    for r in results.get("decoding", []):
        table.add_row(*[str(r[k]) if f is None else _fmt(r.get(k), f) for _, k, f in cols])
    return table


def privacy_csv_text(results: Mapping) -> str:
    """CSV of the ``privacy`` rows (columns :data:`PRIVACY_FIELDS`)."""
    return _rows_csv(results.get("privacy", []), PRIVACY_FIELDS)


def _privacy_grid(rows: list[Mapping], key: str) -> tuple[list[str], list[str], list[list[float | None]]]:
    payloads = list(dict.fromkeys(r["payload"] for r in rows))
    modes = list(dict.fromkeys(r["protection"] for r in rows))
    cell = {(r["payload"], r["protection"]): _finite(r.get(key)) for r in rows}
    return payloads, modes, [[cell.get((p, m)) for m in modes] for p in payloads]


def plot_privacy(results: Mapping, path: str | os.PathLike) -> Path:
    """Two heat maps over payload type × protection: the attacker's token accuracy and the
    canary hits, plus the task accuracy of each protection."""
    rows = list(results.get("privacy", []))
    fig = _new_figure(figsize=(13, 3.6))
    if not rows:
        _no_data(fig.add_subplot(1, 1, 1), "privacy rows")
        return _save_png(fig, path)
    for j, (key, title, cmap, vmax) in enumerate((
            ("attacker_token_acc", "attacker token accuracy (best layer)", "Reds", 1.0),
            ("canary_hits", "canary hits in outbound payloads", "Oranges", None))):
        ax = fig.add_subplot(1, 3, j + 1)
        payloads, modes, grid = _privacy_grid(rows, key)
        data = [[float("nan") if v is None else v for v in line] for line in grid]
        finite = [v for line in grid for v in line if v is not None]
        ax.imshow(data, cmap=cmap, vmin=0, vmax=vmax or max(finite + [1.0]), aspect="auto")
        for a, line in enumerate(grid):
            for b, v in enumerate(line):
                ax.text(b, a, "n/a" if v is None else (f"{v:.2f}" if key != "canary_hits" else f"{v:.0f}"),
                        ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(modes)), modes, fontsize=8)
        ax.set_yticks(range(len(payloads)), payloads, fontsize=8)
        ax.set_title(title, fontsize=9)
    ax = fig.add_subplot(1, 3, 3)
    task = {r["protection"]: _finite(r.get("task_acc")) for r in rows}
    modes = list(task)
    ax.bar(range(len(modes)), [task[m] or 0.0 for m in modes], color=[_colour(i, len(modes)) for i in range(len(modes))])
    ax.set_xticks(range(len(modes)), modes, fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_title("task accuracy (MMLU) per protection", fontsize=9)
    fig.suptitle("privacy: what an honest-but-curious receiver recovers", fontsize=10)
    return _save_png(fig, path)


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
        table.add_row(*[str(r[k]) if f is None else _fmt(r.get(k), f) for _, k, f in cols])
    return table


def write_json_csv(out_dir: str | os.PathLike, results: Mapping,
                   debug_text: bool | None = None) -> dict[str, Path]:
    """Write results.json and results.csv (and the c2c / decoding CSVs) into ``out_dir``;
    returns ``{"json", "csv", ...}`` paths. Free text is scrubbed first
    (:func:`redact_results`; ``debug_text=None`` follows ``config.privacy.debug_text``)."""
    out_dir = Path(out_dir)
    results = redact_results(results, debug_text)
    paths = {
        "json": atomic_write_json(out_dir / JSON_NAME, results),
        "csv": atomic_write_text(out_dir / CSV_NAME, csv_text(results)),
    }
    if results.get("c2c"):
        paths["c2c_csv"] = atomic_write_text(out_dir / C2C_CSV_NAME, c2c_csv_text(results))
    if results.get("decoding"):
        paths["decoding_csv"] = atomic_write_text(out_dir / DECODING_CSV_NAME, decoding_csv_text(results))
    if results.get("privacy"):
        paths["privacy_csv"] = atomic_write_text(out_dir / PRIVACY_CSV_NAME, privacy_csv_text(results))
    return paths


def write_outputs(out_dir: str | os.PathLike, results: Mapping) -> dict[str, Path]:
    """Write results.json, results.csv, eval_loss.png and bytes.png into ``out_dir``.

    Returns ``{"json", "csv", "eval_png", "bytes_png"}`` paths. JSON and CSV errors
    raise; a failing plot is logged and left out of the result, so a plotting bug never
    costs the measured numbers.
    """
    out_dir = Path(out_dir)
    paths = write_json_csv(out_dir, results)
    plots = [("eval_png", EVAL_PNG_NAME, plot_eval_loss), ("bytes_png", BYTES_PNG_NAME, plot_bytes)]
    if results.get("c2c"):
        plots.append(("c2c_png", C2C_PNG_NAME, plot_c2c))
    if results.get("decoding"):
        plots.append(("decoding_png", DECODING_PNG_NAME, plot_decoding))
    if results.get("privacy"):
        plots.append(("privacy_png", PRIVACY_PNG_NAME, plot_privacy))
    for key, name, fn in plots:
        try:
            paths[key] = fn(results, out_dir / name)
        except Exception:
            log.warning("could not write %s", out_dir / name, exc_info=True)
    return paths


def _plain_config(config: Any) -> dict:
    """A plain-dict deep copy of ``config`` (an OmegaConf DictConfig is resolved)."""
    try:
        from omegaconf import DictConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf ships with hydra
        DictConfig = ()  # noqa: N806
    if DictConfig and isinstance(config, DictConfig):
        return OmegaConf.to_container(config, resolve=True)
    return copy.deepcopy(dict(config or {}))


FINAL_STATUSES = RUN_STATUSES[1:]


class RunRecorder:
    """Accumulates one run's results and writes them into ``out_dir``.

    Typical use by the server::

        rec = RunRecorder(out_dir, cfg)
        for r in rounds:
            rec.add_round({...})
            rec.save()            # results.json, results.csv and plots, status "running"
        rec.set_summary({...})
        rec.finish()              # status "completed", writes json, csv and plots
    """

    def __init__(self, out_dir: str | os.PathLike, config: Any):
        self.out_dir = Path(out_dir)
        self.results: dict = {
            "config": _plain_config(config),
            "rounds": [],
            "summary": {"out_dir": str(self.out_dir)},
            "status": "running",
            "error": None,
        }

    def add_round(self, round_dict: Mapping) -> None:
        """Record one round (schema above); a round number seen before is replaced."""
        if "round" not in round_dict:
            raise ValueError("round_dict needs a 'round' key")
        rnd = {"seconds": {}, "clients": [], "groups": [], **copy.deepcopy(dict(round_dict))}
        rounds = self.results["rounds"]
        for i, old in enumerate(rounds):
            if old["round"] == rnd["round"]:
                rounds[i] = rnd
                return
        rounds.append(rnd)

    def update(self, sections: Mapping[str, Any]) -> None:
        """Set top-level results sections from a phase's output, e.g.
        ``{"decoding": rows, "decoding_records": records, "summary": {...}}``: every key
        replaces that section (deep-copied); ``summary`` is merged into the summary."""
        for key, value in sections.items():
            if key == "summary":
                self.set_summary(value)
            else:
                self.results[key] = copy.deepcopy(value)

    def set_fusers(self, rows: list[Mapping]) -> None:
        """Record the fuser registry rows of the latest fuser update (schema above)."""
        self.results["fusers"] = copy.deepcopy(list(rows))

    def set_c2c(self, rows: list[Mapping]) -> None:
        """Record the Cache-to-Cache evaluation rows (schema above)."""
        self.results["c2c"] = copy.deepcopy(list(rows))

    def set_decoding(self, phase: Mapping) -> None:
        """Record the decoding phase: ``phase["rows"]`` (schema above), its per-generation
        ``records`` and the ``service`` facts (into the summary as ``cloud_service``)."""
        self.results["decoding"] = copy.deepcopy(list(phase.get("rows", [])))
        self.results["decoding_records"] = copy.deepcopy(list(phase.get("records", [])))
        if phase.get("service"):
            self.results["summary"]["cloud_service"] = copy.deepcopy(dict(phase["service"]))

    def set_privacy(self, phase: Mapping) -> None:
        """Record the privacy phase: ``phase["rows"]`` (the ``privacy`` schema above), the
        per-layer attack figures ``layers`` and the run's outbound ``audit`` totals."""
        self.results["privacy"] = copy.deepcopy(list(phase.get("rows", [])))
        self.results["privacy_layers"] = copy.deepcopy(list(phase.get("layers", [])))
        self.results["privacy_audit"] = copy.deepcopy(dict(phase.get("audit", {})))
        if phase.get("summary"):
            self.results["summary"]["privacy"] = copy.deepcopy(dict(phase["summary"]))

    def set_summary(self, summary: Mapping) -> None:
        """Merge ``summary`` into the free-form summary (later keys win)."""
        self.results["summary"].update(copy.deepcopy(dict(summary)))

    def save(self) -> dict[str, Path]:
        """Write results.json and results.csv atomically, and the plots once a round exists
        (so an interrupted run still has them); returns the paths written."""
        if self.results["rounds"]:
            return write_outputs(self.out_dir, self.results)
        return write_json_csv(self.out_dir, self.results)

    def finish(self, status: str = "completed", error: str | None = None) -> dict[str, Path]:
        """Set the final status (``completed``, ``failed`` or ``stopped``) and write every
        output.

        Returns the paths from :func:`write_outputs`.
        """
        if status not in FINAL_STATUSES:
            raise ValueError(f"finish status must be one of {FINAL_STATUSES}, not {status!r}")
        self.results["status"] = status
        self.results["error"] = None if error is None else str(error)
        return write_outputs(self.out_dir, self.results)


# --------------------------------------------------------------------------- console


def _fmt(x: Any, spec: str) -> str:
    x = _finite(x)
    return "\u2014" if x is None else format(x, spec)


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
            t[0] += _finite(c.get("bytes_up")) or 0.0
            t[1] += _finite(c.get("bytes_down")) or 0.0
            t[2] += _finite(c.get("seconds")) or 0.0
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
        base, final = _finite(c.get("base_eval_loss")), _finite(c.get("eval_loss"))
        if base is None or final is None:
            delta = Text("\u2014")
        else:
            d = final - base
            delta = Text(f"{d:+.4f}", style="green" if d < 0 else "red" if d > 0 else "")
        up, down, secs = totals[pid]
        row = [
            str(pid),
            str(c.get("model")),
            str(c.get("lora_rank")),
            _fmt(base, ".4f"),
            _fmt(final, ".4f"),
            delta,
            _fmt(c.get("eval_ppl"), ".2f"),
            f"{up / MB:.2f}",
            f"{down / MB:.2f}",
            f"{secs:.1f}",
        ]
        if show_status:
            status = c.get("status", "ok")
            row.append(status if not c.get("reason") else f"{status}: {c['reason']}")
        table.add_row(*row)
    return table


def print_summary(results: Mapping, console: Console | None = None, out_dir: str | os.PathLike | None = None) -> None:
    """Print :func:`console_table`, the run error if any, and the output folder.

    ``out_dir`` defaults to ``results["summary"]["out_dir"]`` (set by :class:`RunRecorder`).
    """
    # Logs and CI are no terminal: rich would fall back to 80 columns and truncate cells.
    console = console or Console(width=None if sys.stdout.isatty() else 140)
    console.print(console_table(results))
    if results.get("c2c"):
        console.print(c2c_table(results))
    if results.get("decoding"):
        console.print(decoding_table(results))
    if results.get("privacy"):
        console.print(privacy_table(results))
    if results.get("error"):
        console.print(Text.assemble(("error: ", "red"), str(results["error"])))
    out_dir = out_dir if out_dir is not None else (results.get("summary") or {}).get("out_dir")
    if out_dir is not None:
        # Text() so brackets in the path are not read as rich markup.
        console.print(Text(f"outputs: {out_dir}"))
