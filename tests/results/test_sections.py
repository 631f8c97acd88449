"""The section list: a section added to SECTIONS gets its CSV and PNG written and its table
printed by the generic recorder; the four sections' shape; no plotting at import."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from rich.table import Table

from edgefuse import results as R
from edgefuse.results import plotting, sections
from edgefuse.results.section import Plot, Section, fmt, rows_csv

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LATENCY_FIELDS = ("device", "ms", "text")


def latency_csv(results):
    return rows_csv(results.get("latency", []), LATENCY_FIELDS)


def plot_latency(results, path):
    fig = plotting.new_figure(figsize=(4, 3))
    ax = fig.add_subplot()
    rows = results.get("latency", [])
    ax.bar(range(len(rows)), [r["ms"] if r["ms"] == r["ms"] else 0.0 for r in rows],
           color=[plotting.colour(i, len(rows)) for i in range(len(rows))])
    return plotting.save_png(fig, path)


def latency_table(results):
    table = Table(title="Latency per device")
    table.add_column("device")
    table.add_column("ms", justify="right")
    for r in results["latency"]:
        table.add_row(str(r["device"]), fmt(r["ms"], ".2f"))
    return table


LATENCY = Section(name="latency", keys=("latency",), csv_name="latency.csv", csv_text=latency_csv,
                  plots=(Plot("latency_png", "latency.png", plot_latency),), table=latency_table)
ROWS = [{"device": 0, "ms": 12.5, "text": "hello"}, {"device": 1, "ms": float("nan"), "text": None}]


@pytest.fixture
def with_latency(monkeypatch):
    """SECTIONS with one more section at the end, as a new phase's module would add it."""
    monkeypatch.setattr(sections, "SECTIONS", (*sections.SECTIONS, LATENCY))


def test_added_section_is_written_and_printed(tmp_path: Path, with_latency):
    rec = R.RunRecorder(tmp_path, {"seed": 0})
    rec.add_round({"round": 1, "clients": [], "groups": []})
    rec.update({"latency": ROWS})
    paths = rec.finish()
    assert paths["latency_csv"] == tmp_path / "latency.csv" and paths["latency_png"] == tmp_path / "latency.png"
    # The CSV is written from the scrubbed results: the free-text cell is a tag, NaN and None empty.
    text = (tmp_path / "latency.csv").read_text()
    assert re.fullmatch(r"device,ms,text\n0,12\.5,<text 5 chars hmac:[0-9a-f]{8}>\n1,,\n", text), text
    png = (tmp_path / "latency.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 1000
    assert R.load_results(tmp_path)["latency"][0]["ms"] == 12.5
    console = Console(record=True, width=200)
    R.print_summary(rec.results, console=console)
    out = console.export_text()
    assert "Latency per device" in out
    rows = [line.split("\u2502")[1:3] for line in out.splitlines() if line.startswith("\u2502")]
    assert [[c.strip() for c in r] for r in rows[-2:]] == [["0", "12.50"], ["1", "\u2014"]]
    # The section's table comes after the rounds table.
    assert out.index("edgefuse run: last round 1") < out.index("Latency per device")


def test_added_section_without_rows_writes_and_prints_nothing(tmp_path: Path, with_latency):
    rec = R.RunRecorder(tmp_path, {"seed": 0})
    rec.add_round({"round": 1})
    rec.update({"latency": []})
    paths = rec.finish()
    assert "latency_csv" not in paths and "latency_png" not in paths
    assert not (tmp_path / "latency.csv").exists() and not (tmp_path / "latency.png").exists()
    console = Console(record=True, width=200)
    R.print_summary(rec.results, console=console)
    assert "Latency" not in console.export_text()


def test_write_outputs_writes_only_the_sections_given(tmp_path: Path):
    results = {"config": {"privacy": {"debug_text": True}}, "rounds": [], "latency": ROWS}
    paths = R.write_outputs(tmp_path, results, sections=[LATENCY])
    assert set(paths) == {"json", "latency_csv", "latency_png"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latency.csv", "latency.png", "results.json"]
    # debug_text keeps the text (the scrubber is the only difference).
    assert (tmp_path / "latency.csv").read_text() == "device,ms,text\n0,12.5,hello\n1,,\n"


def test_a_failing_plot_keeps_the_numbers(tmp_path: Path, caplog):
    def broken(results, path):
        raise RuntimeError("plotting bug")

    section = Section(name="latency", keys=("latency",), csv_name="latency.csv", csv_text=latency_csv,
                      plots=(Plot("latency_png", "latency.png", broken),))
    with caplog.at_level(logging.WARNING, logger="edgefuse.results.recorder"):
        paths = R.write_outputs(tmp_path, {"config": {}, "rounds": [], "latency": ROWS}, sections=[section])
    assert set(paths) == {"json", "latency_csv"}
    assert (tmp_path / "latency.csv").read_text().startswith("device,ms,text\n0,12.5,")
    assert "could not write" in caplog.text and "latency.png" in caplog.text


def test_a_table_of_none_prints_nothing():
    section = Section(name="latency", keys=("latency",), table=lambda results: None)
    console = Console(record=True, width=200)
    R.print_summary({"latency": ROWS, "error": None, "summary": {}}, console=console, sections=[section])
    assert console.export_text() == ""


def test_section_shape_is_checked():
    with pytest.raises(ValueError, match="owns no results keys"):
        Section(name="x", keys=())
    with pytest.raises(ValueError, match="csv_name and csv_text"):
        Section(name="x", keys=("x",), csv_name="x.csv")
    assert Section(name="x", keys=("x",)).csv_key == "x_csv"
    always = Section(name="x", keys=("x",), always=True)
    assert always.present({}) and not Section(name="x", keys=("x",)).present({"x": []})


def test_the_four_sections_own_distinct_keys_and_files():
    assert [s.name for s in R.SECTIONS] == ["training", "c2c", "decoding", "privacy"]
    assert [s.keys for s in R.SECTIONS] == [
        ("rounds",), ("c2c", "fusers"), ("decoding", "decoding_records"),
        ("privacy", "privacy_layers", "privacy_audit")]
    files = [s.csv_name for s in R.SECTIONS] + [p.name for s in R.SECTIONS for p in s.plots]
    assert files == ["results.csv", "c2c.csv", "decoding.csv", "privacy.csv",
                     "eval_loss.png", "bytes.png", "c2c.png", "decoding.png", "privacy.png"]
    path_keys = [s.csv_key for s in R.SECTIONS] + [p.key for s in R.SECTIONS for p in s.plots]
    assert path_keys == ["csv", "c2c_csv", "decoding_csv", "privacy_csv",
                         "eval_png", "bytes_png", "c2c_png", "decoding_png", "privacy_png"]


def test_importing_results_loads_no_plotting_and_no_torch():
    code = ("import sys, edgefuse.results, edgefuse.results.recorder; "
            "print(sorted(m for m in ('matplotlib', 'torch') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]", res.stdout
