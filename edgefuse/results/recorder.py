"""The run recorder: results.json, then every section's CSV, plots and console table.

The server of a federated run owns one :class:`RunRecorder`, records each round
(:meth:`~RunRecorder.add_round`) and each phase's output (:meth:`~RunRecorder.update`), and
calls :meth:`RunRecorder.save` after every round, so a crash loses nothing already
measured. The recorder names no phase: :func:`write_outputs` and :func:`print_summary` go
through :data:`edgefuse.results.sections.SECTIONS`, each section writing its own CSV and
PNGs and printing its own table. Every file is written atomically (temp file in the same
folder, fsync, ``os.replace``): a reader sees either the old file or the new one, never half.

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
      "c2c": [{"receiver": str, "sharers": [str], "mode": "alone"|"t2t"|"c2c"|"c2c_zero"|
               "c2c_shuffled"|"co_c2c"|"multi", "n": int, "mmlu_acc": float|None,
               "rougeL": float|None, "nll": float|None, "latency_ms": float|None,
               "bytes_sent": float|None, ...intervals, paired differences, breakdowns}],
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

Each key besides ``config``, ``summary``, ``status`` and ``error`` is owned by one section
(:attr:`Section.keys <edgefuse.results.section.Section.keys>`): ``rounds`` by
:mod:`~edgefuse.results.training`, ``fusers`` and ``c2c`` by :mod:`~edgefuse.results.c2c`,
``decoding*`` by :mod:`~edgefuse.results.decoding`, ``privacy*`` by
:mod:`~edgefuse.results.privacy`.

Private text: results.json and the CSVs are written by :func:`write_json_csv`, which first
passes the results through :func:`redact_results`: unless ``config.privacy.debug_text`` is true, the
value of every :data:`TEXT_FIELDS` key (prompts, answers, references, generated text and
token ids), anywhere outside ``config``, becomes a tag from :func:`scrub_text`. The
in-memory results (plots, console tables) are left as they are.

Units: losses are mean cross-entropy in nats/token, perplexity is ``exp(loss)``,
bytes are bytes (plots and tables show MB = 10**6 bytes), seconds are wall-clock
seconds.
"""

from __future__ import annotations

import copy
import hashlib
import hmac
import json
import logging
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from edgefuse.io import atomic_write_json, atomic_write_text, to_jsonable
from edgefuse.results import sections as _sections
from edgefuse.results.section import Section

log = logging.getLogger(__name__)

JSON_NAME = "results.json"
RUN_STATUSES = ("running", "completed", "failed", "stopped")
FINAL_STATUSES = RUN_STATUSES[1:]


# --------------------------------------------------------------------------- private text

# Keys whose values are free text (or token ids of text) from prompts, answers and
# generations; scrubbed wherever they appear in results outside ``config``.
TEXT_FIELDS = frozenset({
    "text", "texts", "prompt", "prompts", "question", "answer", "answers", "reference",
    "references", "instruction", "context", "response", "hint", "hints", "completion",
    "generation", "tokens", "canary", "original", "redacted", "rephrased",
})
_TAG_KEY = os.urandom(32)  # per process: tags compare within a run, cannot be dictionary-looked-up
_TAG = re.compile(r"<(text \d+ chars|data \d+ items) hmac:[0-9a-f]{8}>")


def scrub_text(value: Any, debug_text: bool = False) -> Any:
    """``value`` itself when ``debug_text``; otherwise a tag that keeps no text.

    A string becomes ``<text N chars hmac:xxxxxxxx>`` (N = its length; 8 hex of an
    HMAC-SHA256 under a random per-process key, so equal texts of one run get equal tags but
    a tag cannot be matched by hashing guesses); a list/tuple/dict (e.g. token ids) becomes
    ``<data N items hmac:xxxxxxxx>`` over its JSON. ``None``, numbers and booleans (an
    MMLU answer index), and a string that is such a tag already, are returned unchanged
    (scrubbing twice changes nothing: a resumed run re-saves the rows it restored).
    """
    if debug_text or value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str) and _TAG.fullmatch(value):  # scrubbed already (a resumed run's rows)
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


# --------------------------------------------------------------------------- outputs


def _present(results: Mapping, sections: Sequence[Section] | None) -> list[Section]:
    """The sections (default :data:`~edgefuse.results.sections.SECTIONS`) with output in ``results``."""
    return [s for s in (_sections.SECTIONS if sections is None else sections) if s.present(results)]


def write_json_csv(out_dir: str | os.PathLike, results: Mapping, debug_text: bool | None = None,
                   sections: Sequence[Section] | None = None) -> dict[str, Path]:
    """Write results.json and the CSV of every section that has rows into ``out_dir``.

    Returns ``{"json": path, <section csv_key>: path, ...}`` (``"csv"`` is results.csv,
    ``"c2c_csv"`` c2c.csv, ...). Free text is scrubbed first (:func:`redact_results`;
    ``debug_text=None`` follows ``config.privacy.debug_text``), so the CSVs see the
    scrubbed results. ``sections`` defaults to
    :data:`~edgefuse.results.sections.SECTIONS`. Errors raise.
    """
    out_dir = Path(out_dir)
    results = redact_results(results, debug_text)
    paths = {"json": atomic_write_json(out_dir / JSON_NAME, results)}
    for s in _present(results, sections):
        if s.csv_name is not None:
            paths[s.csv_key] = atomic_write_text(out_dir / s.csv_name, s.csv_text(results))
    return paths


def write_outputs(out_dir: str | os.PathLike, results: Mapping,
                  sections: Sequence[Section] | None = None) -> dict[str, Path]:
    """Write results.json, then every present section's CSV and PNGs into ``out_dir``.

    Returns the paths by key: those of :func:`write_json_csv`, then each plot's
    :attr:`~edgefuse.results.section.Plot.key` (``"eval_png"``, ``"bytes_png"``,
    ``"c2c_png"``, ...). JSON and CSV errors raise; a failing plot is logged and left out
    of the result, so a plotting bug never costs the measured numbers.
    """
    out_dir = Path(out_dir)
    paths = write_json_csv(out_dir, results, sections=sections)
    for s in _present(results, sections):
        for plot in s.plots:
            try:
                paths[plot.key] = plot.draw(results, out_dir / plot.name)
            except Exception:
                log.warning("could not write %s", out_dir / plot.name, exc_info=True)
    return paths


def print_summary(results: Mapping, console: Console | None = None, out_dir: str | os.PathLike | None = None,
                  sections: Sequence[Section] | None = None) -> None:
    """Print the table of every present section, the run error if any, and the output folder.

    ``out_dir`` defaults to ``results["summary"]["out_dir"]`` (set by :class:`RunRecorder`);
    ``sections`` to :data:`~edgefuse.results.sections.SECTIONS`.
    """
    # Logs and CI are no terminal: rich would fall back to 80 columns and truncate cells.
    console = console or Console(width=None if sys.stdout.isatty() else 140)
    for s in _present(results, sections):
        table = s.table(results) if s.table is not None else None
        if table is not None:
            console.print(table)
    if results.get("error"):
        console.print(Text.assemble(("error: ", "red"), str(results["error"])))
    out_dir = out_dir if out_dir is not None else (results.get("summary") or {}).get("out_dir")
    if out_dir is not None:
        # Text() so brackets in the path are not read as rich markup.
        console.print(Text(f"outputs: {out_dir}"))


# --------------------------------------------------------------------------- recorder


def _plain_config(config: Any) -> dict:
    """A plain-dict deep copy of ``config`` (an OmegaConf DictConfig is resolved)."""
    try:
        from omegaconf import DictConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf ships with hydra
        DictConfig = ()  # noqa: N806
    if DictConfig and isinstance(config, DictConfig):
        return OmegaConf.to_container(config, resolve=True)
    return copy.deepcopy(dict(config or {}))


class RunRecorder:
    """Accumulates one run's results and writes them into ``out_dir``.

    Typical use by the server::

        rec = RunRecorder(out_dir, cfg)
        for r in rounds:
            rec.add_round({...})
            rec.save()            # results.json, the CSVs and plots, status "running"
        rec.update({"decoding": rows, "decoding_records": records})   # a phase's sections
        rec.set_summary({...})
        rec.finish()              # status "completed", writes every output
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
        """Record one round (schema above); a round number seen before is replaced.

        Raises:
            ValueError: ``round_dict`` has no ``round`` key.
        """
        if "round" not in round_dict:
            raise ValueError("round_dict needs a 'round' key")
        rnd = {"seconds": {}, "clients": [], "groups": [], **copy.deepcopy(dict(round_dict))}
        rounds = self.results["rounds"]
        for i, old in enumerate(rounds):
            if old["round"] == rnd["round"]:
                rounds[i] = rnd
                return
        rounds.append(rnd)

    def resume(self, results: Mapping) -> None:
        """Continue a run from the results it saved (a checkpoint's): its rounds, sections
        and summary come back; the config stays this recorder's, the status goes back to
        ``running`` and the error to None.

        Raises:
            ValueError: ``results`` has no ``rounds`` list.
        """
        if not isinstance(results.get("rounds"), list):
            raise ValueError("results to resume from need a 'rounds' list")
        data = copy.deepcopy(dict(results))
        data["config"] = self.results["config"]
        data["summary"] = {**dict(data.get("summary") or {}), "out_dir": str(self.out_dir)}
        data["status"], data["error"] = "running", None
        self.results = data

    def update(self, sections: Mapping[str, Any]) -> None:
        """Set top-level results keys from a phase's output, e.g.
        ``{"decoding": rows, "decoding_records": records, "summary": {...}}``: every key
        replaces that entry (deep-copied, so later changes by the caller change nothing);
        ``summary`` is merged into the summary (:meth:`set_summary`)."""
        for key, value in sections.items():
            if key == "summary":
                self.set_summary(value)
            else:
                self.results[key] = copy.deepcopy(value)

    def set_summary(self, summary: Mapping) -> None:
        """Merge ``summary`` into the free-form summary (later keys win; deep-copied)."""
        self.results["summary"].update(copy.deepcopy(dict(summary)))

    def save(self) -> dict[str, Path]:
        """Write results.json and the CSVs atomically, and the plots once a round exists
        (so an interrupted run still has them); returns the paths written."""
        if self.results["rounds"]:
            return write_outputs(self.out_dir, self.results)
        return write_json_csv(self.out_dir, self.results)

    def finish(self, status: str = "completed", error: str | None = None) -> dict[str, Path]:
        """Set the final status (``completed``, ``failed`` or ``stopped``) and write every
        output.

        Returns the paths from :func:`write_outputs`.

        Raises:
            ValueError: ``status`` is not one of :data:`FINAL_STATUSES`.
        """
        if status not in FINAL_STATUSES:
            raise ValueError(f"finish status must be one of {FINAL_STATUSES}, not {status!r}")
        self.results["status"] = status
        self.results["error"] = None if error is None else str(error)
        return write_outputs(self.out_dir, self.results)
