"""C2C results: per-query scoring (edgefuse.app.phases.c2c._score) and the c2c / fusers outputs of
edgefuse.results.c2c section through RunRecorder (c2c.csv, c2c.png, results.json)."""

from __future__ import annotations

import csv
import json
from types import SimpleNamespace

import pytest

from edgefuse import results as R
from edgefuse.results import c2c as c2c_section
from edgefuse.eval.queries import Query, rouge_l
from edgefuse.app.phases.c2c import _paired_with_alone, _score, load_queries, representatives
from edgefuse.app.strategy import NodeInfo
from tests.conftest import mirror_path

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def mmlu(qid, answer):
    return Query(qid=qid, kind="mmlu", instruction="Q?\nA. a\nB. b\nC. c\nD. d", context="",
                 choices=["a", "b", "c", "d"], answer=answer, reference=None, category="demo")


def dolly(qid, reference):
    return Query(qid=qid, kind="dolly", instruction="Say it.", context="", choices=None, answer=None,
                 reference=reference, category="open_qa")


def result(qid, *, pred=None, text=None, latency, sent, exchange=1.0, prefill=2.0, fuse=0.5, decode=3.0):
    return {"qid": qid, "pred": pred, "text": text, "latency_ms": latency, "bytes_sent": sent,
            "exchange_ms": exchange, "prefill_ms": prefill, "fuse_ms": fuse, "decode_ms": decode}


def test_rouge_l_hand_values():
    assert rouge_l("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(1.0)
    # LCS 1 token: precision 1/1, recall 1/3 -> F = 2 * 1/3 / (4/3) = 0.5
    assert rouge_l("cat", "the cat sat") == pytest.approx(0.5)
    # LCS "the cat" (2): P = 2/3, R = 2/4 -> F = 2 * (1/3) / (7/6) = 4/7
    assert rouge_l("the cat runs", "the big cat sleeps") == pytest.approx(4 / 7)
    assert rouge_l("", "anything") == 0.0


def test_score_hand_computed():
    queries = [mmlu("m0", 0), mmlu("m1", 2), mmlu("m2", 3), dolly("d0", "the cat sat"),
               dolly("d1", "the cat sat on the mat"), dolly("d2", "a reference")]
    # results arrive in another order than the queries; one Dolly answer is missing (None)
    results = [
        result("d1", text="the cat sat on the mat", latency=40.0, sent=400, exchange=4.0),
        result("m0", pred=0, latency=10.0, sent=100),
        result("m1", pred=1, latency=20.0, sent=200),
        result("d0", text="cat", latency=30.0, sent=300),
        result("m2", pred=3, latency=30.0, sent=300),
        result("d2", text=None, latency=50.0, sent=500, fuse=2.0),
    ]
    row = _score("tiny-llama", ["tiny-qwen2"], "c2c", queries, results)
    assert row["receiver"] == "tiny-llama" and row["sharers"] == ["tiny-qwen2"] and row["mode"] == "c2c"
    assert (row["n"], row["n_mmlu"], row["n_dolly"]) == (6, 3, 3)
    assert row["mmlu_acc"] == pytest.approx(2 / 3)  # m0 and m2 right, m1 wrong
    assert row["rougeL"] == pytest.approx((0.5 + 1.0 + 0.0) / 3)
    assert row["latency_ms"] == pytest.approx(180.0 / 6)
    assert row["latency_ms_mmlu"] == pytest.approx(20.0)
    assert row["latency_ms_dolly"] == pytest.approx(40.0)
    assert row["bytes_sent"] == pytest.approx(1800 / 6)
    assert row["exchange_ms"] == pytest.approx((4.0 + 5 * 1.0) / 6)
    assert row["prefill_ms"] == pytest.approx(2.0) and row["decode_ms"] == pytest.approx(3.0)
    assert row["fuse_ms"] == pytest.approx((5 * 0.5 + 2.0) / 6)


def test_score_intervals_and_paired_difference_with_alone():
    """Wilson interval of the MMLU share, and the paired difference from ``alone`` on the same
    items: c2c gets m1 right where alone got it wrong, both get m0, neither m2 (diff 1/3)."""
    queries = [mmlu("m0", 0), mmlu("m1", 1), mmlu("m2", 2), dolly("d0", "the cat sat")]
    alone = _score("r", [], "alone", queries, [
        result("m0", pred=0, latency=1.0, sent=0), result("m1", pred=0, latency=1.0, sent=0),
        result("m2", pred=0, latency=1.0, sent=0), result("d0", text="cat", latency=1.0, sent=0)])
    c2c = _score("r", ["s"], "c2c", queries, [
        result("m0", pred=0, latency=1.0, sent=0), result("m1", pred=1, latency=1.0, sent=0),
        result("m2", pred=3, latency=1.0, sent=0), result("d0", text="the cat sat", latency=1.0, sent=0)])
    # Wilson 95 % for 1/3: (p + z^2/2n +- z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n), z = 1.95996
    z, n, ph = 1.959964, 3, 1 / 3
    centre, half = ph + z * z / (2 * n), z * (ph * (1 - ph) / n + z * z / (4 * n * n)) ** 0.5
    assert alone["mmlu_acc_ci95_low"] == pytest.approx((centre - half) / (1 + z * z / n), abs=1e-4)
    assert alone["mmlu_acc_ci95_high"] == pytest.approx((centre + half) / (1 + z * z / n), abs=1e-4)
    rows = _paired_with_alone([alone, c2c])
    assert "_items" not in rows[0] and "_items" not in rows[1]
    assert "mmlu_acc_vs_alone" not in rows[0]  # alone is the reference
    assert rows[1]["mmlu_acc_vs_alone"] == pytest.approx(1 / 3) and rows[1]["mmlu_acc_vs_alone_n"] == 3
    assert rows[1]["mmlu_acc_vs_alone_ci95_low"] <= 1 / 3 <= rows[1]["mmlu_acc_vs_alone_ci95_high"]
    assert rows[1]["rougeL_vs_alone"] == pytest.approx(1.0 - 0.5) and rows[1]["rougeL_vs_alone_n"] == 1


def test_score_without_one_kind_gives_none():
    queries = [mmlu("m0", 1)]
    row = _score("r", [], "alone", queries, [result("m0", pred=1, latency=5.0, sent=0)])
    assert row["mmlu_acc"] == 1.0 and row["rougeL"] is None and row["latency_ms_dolly"] is None
    assert row["n_dolly"] == 0 and row["bytes_sent"] == 0.0 and row["sharers"] == []


def c2c_rows():
    return [
        {"receiver": "tiny-llama", "sharers": [], "mode": "alone", "n": 4, "mmlu_acc": 0.5,
         "rougeL": 0.25, "latency_ms": 12.5, "bytes_sent": 0.0, "error": None},
        {"receiver": "tiny-llama", "sharers": ["tiny-qwen2", "tiny-gemma3"], "mode": "multi", "n": 4,
         "mmlu_acc": 0.75, "rougeL": 0.3, "latency_ms": 80.0, "bytes_sent": 5120.0, "error": None},
        {"receiver": "tiny-qwen2", "sharers": ["tiny-llama"], "mode": "c2c", "n": 0, "mmlu_acc": None,
         "rougeL": None, "latency_ms": None, "bytes_sent": None, "error": "partition 2 did not answer"},
    ]


FUSER_ROWS = [
    {"sharer": "tiny-qwen2", "receiver": "tiny-llama", "params": 3308, "bytes": 13232,
     "version": "fff84b3e300740d2", "train_steps": 2, "action": "trained", "round": 2,
     "train_seconds": 1.5, "val_loss": 5.97, "alone_val_loss": 5.98, "download": "installed"},
]


def test_recorder_writes_c2c_csv_png_and_json(tmp_path):
    rec = R.RunRecorder(tmp_path / "run", {"seed": 0})
    rec.add_round({"round": 1})
    rec.update({"fusers": FUSER_ROWS, "c2c": c2c_rows()})
    paths = rec.save()
    out = tmp_path / "run"
    assert paths["c2c_csv"] == out / c2c_section.C2C_CSV_NAME and paths["c2c_png"] == out / c2c_section.C2C_PNG_NAME

    with (out / "c2c.csv").open(newline="") as f:
        rows = list(csv.reader(f))
    assert tuple(rows[0]) == c2c_section.C2C_COLUMNS
    assert len(rows) == 4
    by = [dict(zip(c2c_section.C2C_COLUMNS, r)) for r in rows[1:]]
    assert by[0]["sharers"] == "" and by[0]["mode"] == "alone" and float(by[0]["mmlu_acc"]) == 0.5
    assert by[1]["sharers"] == "tiny-qwen2+tiny-gemma3" and by[1]["mode"] == "multi"
    assert float(by[1]["latency_ms"]) == 80.0 and float(by[1]["bytes_sent"]) == 5120.0
    assert by[1]["error"] == "" and by[1]["exchange_ms"] == ""  # absent key: empty cell
    assert by[2]["mmlu_acc"] == "" and by[2]["error"] == "partition 2 did not answer"

    png = (out / "c2c.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 1000

    data = json.loads((out / R.JSON_NAME).read_text())
    assert data["c2c"] == c2c_rows()
    assert data["fusers"] == FUSER_ROWS
    # the recorder keeps copies: changing the caller's rows later changes nothing
    rows_in = c2c_rows()
    rec.update({"c2c": rows_in})
    rows_in[0]["mode"] = "changed"
    assert rec.results["c2c"][0]["mode"] == "alone"


def test_recorder_without_c2c_writes_no_c2c_files(tmp_path):
    rec = R.RunRecorder(tmp_path, {"seed": 0})
    rec.add_round({"round": 1})
    rec.update({"fusers": FUSER_ROWS})  # fuser rows alone: the section has no c2c rows to write
    paths = rec.finish()
    assert "c2c_csv" not in paths and "c2c_png" not in paths
    assert not (tmp_path / c2c_section.C2C_CSV_NAME).exists() and not (tmp_path / c2c_section.C2C_PNG_NAME).exists()
    assert "c2c" not in json.loads((tmp_path / R.JSON_NAME).read_text())


def test_representatives_lowest_partition_with_a_group():
    nodes = {11: NodeInfo(11, 3, "tiny-llama", 4), 12: NodeInfo(12, 1, "tiny-llama", 8),
             13: NodeInfo(13, 2, "tiny-qwen2", 4), 14: NodeInfo(14, 0, "tiny-gemma3", 4)}
    strategy = SimpleNamespace(nodes=nodes, groups={"tiny-llama": object(), "tiny-qwen2": object()})
    reps = representatives(strategy)
    assert {m: n.node_id for m, n in reps.items()} == {"tiny-llama": 12, "tiny-qwen2": 13}


def test_load_queries_tiny_config():
    from edgefuse.config import compose

    mirror = mirror_path()
    if mirror is None or not (mirror / "mmlu").is_dir():
        pytest.skip("no data mirror with mmlu/")
    cfg = compose("tiny", [f"data.mirror={mirror}"])
    qs = load_queries(cfg)
    mm = [q for q in qs if q.kind == "mmlu"]
    dd = [q for q in qs if q.kind == "dolly"]
    assert len(mm) == int(cfg.c2c.eval.mmlu_n) == 3
    assert len(dd) == 8 * int(cfg.c2c.eval.dolly_per_category)  # one per Dolly category
    assert len({q.category for q in dd}) == 8 and all(q.reference for q in dd)
    assert all(q.qid.startswith("mmlu/test/") for q in mm) and all(q.qid.startswith("dolly/") for q in dd)
    assert [q.qid for q in load_queries(cfg)] == [q.qid for q in qs]  # seeded
