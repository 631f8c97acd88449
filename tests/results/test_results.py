"""Tests for edgefuse.results: the recorder (JSON, status, loading) and the training section
(results.csv, eval_loss.png, bytes.png, the per-client console table); atomic writes."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
from rich.console import Console

from edgefuse import results as R
from edgefuse.io import atomic_write_json, atomic_write_text, to_jsonable
from edgefuse.results import training

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MODELS = {0: ("smollm2-135m", 8), 1: ("smollm2-135m", 8), 2: ("qwen2.5-0.5b", 16)}


def _client(pid: int, rnd: int, **kw) -> dict:
    model, rank = MODELS[pid]
    base = 3.0 + pid  # base model loss, nats/token
    loss = base - 0.25 * rnd
    c = {
        "partition_id": pid,
        "model": model,
        "lora_rank": rank,
        "train_loss": loss + 0.1,
        "eval_loss": loss,
        "eval_ppl": math.exp(loss),
        "base_eval_loss": base,
        "base_eval_ppl": math.exp(base),
        "bytes_up": 1_500_000 * (pid + 1),
        "bytes_down": 2_000_000,
        "seconds": 10.0 + pid,
        "num_examples": 100 + pid,
        "status": "ok",
        "reason": None,
    }
    c.update(kw)
    return c


def _round(rnd: int, overrides: dict[int, dict] | None = None) -> dict:
    """One round; ``overrides`` maps partition id to client fields to replace."""
    overrides = overrides or {}
    return {
        "round": rnd,
        "seconds": {"train": 30.0, "evaluate": 5.0, "aggregate": 1.0, "total": 36.0},
        "clients": [_client(pid, rnd, **overrides.get(pid, {})) for pid in MODELS],
        "groups": [
            {"model": "smollm2-135m", "clients": [0, 1], "method": "fedavg", "truncation_error": None, "adapter_dir": None},
            {"model": "qwen2.5-0.5b", "clients": [2], "method": "flexlora", "truncation_error": 0.01, "adapter_dir": "a/q"},
        ],
    }


CONFIG = {"seed": 0, "federation": {"num_rounds": 2}, "training": {"lr": 1e-4}}


@pytest.fixture
def recorder(tmp_path: Path) -> R.RunRecorder:
    rec = R.RunRecorder(tmp_path / "run", CONFIG)
    rec.add_round(_round(1))
    # Round 2: client 1 failed (no eval), client 2 has a NaN train loss.
    rec.add_round(_round(2, {1: {"eval_loss": None, "eval_ppl": None, "status": "failed", "reason": "OOM"},
                               2: {"train_loss": float("nan")}}))
    rec.set_summary({"wall_seconds": 72.0, "peak_rss_bytes": 123, "inf": float("inf")})
    return rec


def test_json_round_trips_with_schema(recorder: R.RunRecorder):
    paths = recorder.save()
    data = R.load_results(paths["json"])
    assert set(data) == {"config", "rounds", "summary", "status", "error"}
    assert data["config"] == CONFIG
    assert data["status"] == "running" and data["error"] is None
    assert [r["round"] for r in data["rounds"]] == [1, 2]
    rnd = data["rounds"][0]
    assert set(rnd) == {"round", "seconds", "clients", "groups"}
    assert set(rnd["seconds"]) == {"train", "evaluate", "aggregate", "total"}
    assert set(rnd["clients"][0]) == set(training.CSV_COLUMNS) - {"round"}
    assert set(rnd["groups"][0]) == {"model", "clients", "method", "truncation_error", "adapter_dir"}
    assert data["rounds"] == to_jsonable(recorder.results["rounds"])


def test_nan_and_inf_become_null(recorder: R.RunRecorder):
    path = recorder.save()["json"]
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    data = json.loads(text)
    assert data["rounds"][1]["clients"][2]["train_loss"] is None
    assert data["summary"]["inf"] is None
    # A loader that rejects non-standard constants still parses the file.
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))


def test_csv_rows_header_and_values(recorder: R.RunRecorder):
    path = recorder.save()["csv"]
    with path.open(newline="") as f:
        rows = list(csv.reader(f))
    assert tuple(rows[0]) == training.CSV_COLUMNS
    assert len(rows) - 1 == 2 * 3  # rounds x clients
    by_key = {(r[0], r[1]): dict(zip(training.CSV_COLUMNS, r)) for r in rows[1:]}
    # Round 2, partition 2: eval loss = base 5.0 - 0.25*2 = 4.5; NaN train loss is empty.
    row = by_key[("2", "2")]
    assert row["model"] == "qwen2.5-0.5b" and row["lora_rank"] == "16"
    assert float(row["eval_loss"]) == 4.5
    assert row["train_loss"] == ""
    assert row["bytes_up"] == "4500000"
    failed = by_key[("2", "1")]
    assert failed["status"] == "failed" and failed["reason"] == "OOM" and failed["eval_loss"] == ""


def test_finish_writes_all_outputs_and_pngs(recorder: R.RunRecorder):
    paths = recorder.finish()
    assert set(paths) == {"json", "csv", "eval_png", "bytes_png"}
    for key in ("eval_png", "bytes_png"):
        data = paths[key].read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000
    assert R.load_results(recorder.out_dir)["status"] == "completed"
    # Only the four outputs, no temp files left behind.
    assert sorted(p.name for p in recorder.out_dir.iterdir()) == sorted(
        [R.JSON_NAME, training.CSV_NAME, training.EVAL_PNG_NAME, training.BYTES_PNG_NAME]
    )


def test_plots_handle_empty_results(tmp_path: Path):
    empty = {"config": {}, "rounds": [], "summary": {}, "status": "running", "error": None}
    for fn in (training.plot_eval_loss, training.plot_bytes):
        p = fn(empty, tmp_path / f"{fn.__name__}.png")
        assert p.read_bytes().startswith(PNG_MAGIC)


def test_finish_rejects_unknown_status(recorder: R.RunRecorder):
    with pytest.raises(ValueError):
        recorder.finish("done")


def test_atomic_write_keeps_old_file_on_serialisation_error(tmp_path: Path):
    path = tmp_path / "results.json"
    atomic_write_json(path, {"config": {}, "rounds": []})
    before = path.read_bytes()
    with pytest.raises(TypeError):
        atomic_write_json(path, {"config": {}, "rounds": [object()]})
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_atomic_write_text_cleans_up_on_write_error(tmp_path: Path):
    path = tmp_path / "x.txt"
    atomic_write_text(path, "old")
    with pytest.raises(UnicodeEncodeError):
        atomic_write_text(path, "\udcff", encoding="utf-8")  # lone surrogate
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["x.txt"]


def test_add_round_replaces_same_round(tmp_path: Path):
    rec = R.RunRecorder(tmp_path, CONFIG)
    rec.add_round(_round(1))
    rec.add_round(_round(1, {0: {"eval_loss": 1.0}}))
    assert len(rec.results["rounds"]) == 1
    assert rec.results["rounds"][0]["clients"][0]["eval_loss"] == 1.0


def test_console_table_rows_and_delta(recorder: R.RunRecorder):
    table = training.console_table(recorder.results)
    assert table.row_count == 3
    console = Console(record=True, width=200)
    R.print_summary(recorder.results, console=console)
    text = console.export_text()
    # Body rows start with the box edge; key them by the partition cell.
    lines = {line.split("\u2502")[1].strip(): line for line in text.splitlines() if line.startswith("\u2502")}
    assert set(lines) == {"0", "1", "2"}
    # Partition 0 after round 2: base 3.0, final 2.5, delta -0.5.
    assert "-0.5000" in lines["0"] and "3.0000" in lines["0"] and "2.5000" in lines["0"]
    # MB totals over both rounds: up 1.5 MB x 2, down 2 MB x 2.
    assert "3.00" in lines["0"] and "4.00" in lines["0"]
    assert "failed: OOM" in lines["1"]
    assert f"outputs: {recorder.out_dir}" in text


def test_print_summary_shows_error(recorder: R.RunRecorder):
    recorder.finish("failed", error="client [2] crashed")
    console = Console(record=True, width=200)
    R.print_summary(R.load_results(recorder.out_dir), console=console)
    text = console.export_text()
    assert "status failed" in text and "error: client [2] crashed" in text


def test_load_results_rejects_bad_files(tmp_path: Path):
    bad_json = tmp_path / "broken.json"
    bad_json.write_text("{not json")
    with pytest.raises(ValueError, match="broken.json"):
        R.load_results(bad_json)
    no_rounds = tmp_path / "norounds.json"
    no_rounds.write_text(json.dumps({"config": {}}))
    with pytest.raises(ValueError, match=r"norounds\.json.*rounds"):
        R.load_results(no_rounds)
    a_list = tmp_path / "list.json"
    a_list.write_text("[]")
    with pytest.raises(ValueError, match="list.json"):
        R.load_results(a_list)


def test_sample_plots_draw_the_rows(recorder: R.RunRecorder, tmp_path: Path, monkeypatch):
    """Both training plots, written under tmp_path: valid PNGs, and the figures hold the
    fixture's numbers (read from the axes before saving)."""
    figures = {}
    save = training.save_png

    def keep(fig, path):
        figures[Path(path).name] = fig
        return save(fig, path)
    monkeypatch.setattr(training, "save_png", keep)
    eval_png = training.plot_eval_loss(recorder.results, tmp_path / "eval.png")
    bytes_png = training.plot_bytes(recorder.results, tmp_path / "bytes.png")
    for p in (eval_png, bytes_png):
        blob = p.read_bytes()
        assert p.parent == tmp_path and blob.startswith(PNG_MAGIC) and len(blob) > 1000
        assert blob[12:16] == b"IHDR" and blob[-8:-4] == b"IEND"
    (ax,) = figures["eval.png"].axes
    curves = [(list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines
              if line.get_marker() == "o"]
    # eval loss = base (3 + partition) - 0.25 x round; partition 1 has none in round 2 (a gap)
    assert [xs for xs, _ in curves] == [[1, 2]] * 3
    ys = [y for _, y in curves]
    assert ys[0] == [2.75, 2.5] and ys[2] == [4.75, 4.5]
    assert ys[1][0] == 3.75 and math.isnan(ys[1][1])
    bases = sorted(line.get_ydata()[0] for line in ax.lines if line.get_linestyle() == "--")
    assert bases == [3.0, 4.0, 5.0]
    up, down = figures["bytes.png"].axes
    # uploaded MB per bar: 1.5 x (partition + 1), both rounds; downloaded: 2 MB each
    assert sorted(round(b.get_height(), 6) for b in up.patches) == [1.5, 1.5, 3.0, 3.0, 4.5, 4.5]
    assert [round(b.get_height(), 6) for b in down.patches] == [2.0] * 6
