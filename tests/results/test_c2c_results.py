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


# ---------------------------------------------------------------- NLL, controls, power


def gsm(qid, reference):
    return Query(qid=qid, kind="gsm8k", instruction="2 + 2?", context="", choices=None, answer=None,
                 reference=reference, category="gsm8k")


def nll_row(mode, nlls, sharers=("s",), mmlu_preds=()):
    """A scored row: Dolly d0, d1 and GSM8K g0 with the given NLLs (None: not scored), and
    MMLU items m<i> whose answer is 0, predicted as given."""
    queries = [dolly("d0", "x"), dolly("d1", "y"), gsm("g0", "4")] + [mmlu(f"m{i}", 0) for i in range(len(mmlu_preds))]
    results = [dict(result(q, text="x", latency=1.0, sent=0), nll=v) for q, v in zip(("d0", "d1", "g0"), nlls)]
    results += [result(f"m{i}", pred=p, latency=1.0, sent=0) for i, p in enumerate(mmlu_preds)]
    return _score("r", [] if mode == "alone" else list(sharers), mode, queries, results)


def test_paired_difference_on_a_hand_made_list():
    from edgefuse.eval.stats import paired_difference

    d = paired_difference([1.0, 2.0, 3.0, 4.0], [0.0, 2.0, 5.0, 4.0])
    assert d.value == pytest.approx((1 + 0 - 2 + 0) / 4) and d.n == 4
    assert -2.0 <= d.low <= d.value <= d.high <= 1.0  # within the extreme per-item differences
    same = paired_difference([0.5, 0.7], [0.5, 0.7])
    assert (same.value, same.low, same.high) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="same items"):
        paired_difference([1.0], [1.0, 2.0])


def test_nll_rows_hand_computed_paired_with_alone_and_each_control():
    alone = nll_row("alone", [2.0, 3.0, 1.0])
    c2c = nll_row("c2c", [1.5, 3.5, 0.5])
    zero = nll_row("c2c_zero", [2.0, 3.0, None])  # g0 not scored: pairs on d0, d1 only
    shuf = nll_row("c2c_shuffled", [1.0, 4.0, 1.0])
    other = nll_row("c2c_zero", [9.0, 9.0, 9.0], sharers=("t",))  # another sharer's control
    assert (alone["n_nll"], alone["n_dolly"], alone["n_gsm8k"]) == (3, 2, 1)
    assert alone["nll"] == pytest.approx(2.0) and alone["nll_ci95_low"] <= 2.0 <= alone["nll_ci95_high"]
    assert zero["n_nll"] == 2 and zero["nll"] == pytest.approx(2.5)
    rows = _paired_with_alone([alone, c2c, zero, shuf, other])
    by = {(r["mode"], tuple(r["sharers"])): r for r in rows}
    c = by[("c2c", ("s",))]
    assert c["nll_vs_alone"] == pytest.approx((-0.5 + 0.5 - 0.5) / 3) and c["nll_vs_alone_n"] == 3
    assert c["nll_vs_zero"] == pytest.approx((-0.5 + 0.5) / 2) and c["nll_vs_zero_n"] == 2
    assert c["nll_vs_shuffled"] == pytest.approx((0.5 - 0.5 - 0.5) / 3) and c["nll_vs_shuffled_n"] == 3
    assert c["nll_vs_shuffled_ci95_low"] <= c["nll_vs_shuffled"] <= c["nll_vs_shuffled_ci95_high"]
    assert by[("c2c_zero", ("s",))]["nll_vs_alone"] == pytest.approx(0.0)
    assert "nll_vs_zero" not in by[("c2c_zero", ("s",))] and "nll_vs_zero" not in by[("alone", ())]
    assert all("_items" not in r for r in rows)


def test_mmlu_power_fields_and_notes():
    # receiver alone 8/8 right: Wilson low 0.676 > 0.25, above chance; c2c gets 6/8
    rows = _paired_with_alone([nll_row("alone", [1, 1, 1], mmlu_preds=[0] * 8),
                               nll_row("c2c", [1, 1, 1], mmlu_preds=[0] * 6 + [1] * 2)])
    alone, c2c = rows
    assert alone["mmlu_above_chance"] is True and c2c["mmlu_above_chance"] is True
    assert alone["mmlu_resolvable_difference"] is None and "note" not in alone
    half = (c2c["mmlu_acc_vs_alone_ci95_high"] - c2c["mmlu_acc_vs_alone_ci95_low"]) / 2
    assert c2c["mmlu_resolvable_difference"] == pytest.approx(half) and half > 0.03
    assert c2c["note"] == (f"r c2c: n=8 MMLU items cannot resolve a 3-point difference (paired 95 % "
                           f"interval ±{half:.3f}), that needs n >= 129")
    # 2/8 alone: Wilson low 0.071 <= 0.25, at chance, said on every row of that receiver
    low = _paired_with_alone([nll_row("alone", [1, 1, 1], mmlu_preds=[0] * 2 + [1] * 6),
                              nll_row("c2c", [1, 1, 1], mmlu_preds=[0] * 2 + [1] * 6)])
    assert [r["mmlu_above_chance"] for r in low] == [False, False]
    assert low[0]["note"] == "r alone is not above chance on MMLU (Wilson low end <= 0.25)"
    assert low[1]["note"].startswith("r alone is not above chance on MMLU (Wilson low end <= 0.25); r c2c: n=8")
    assert low[1]["mmlu_resolvable_difference"] == 0.0  # identical answers: a zero-width interval...
    assert "cannot resolve" in low[1]["note"]  # ...still says n=8 cannot resolve 3 points
    # n = 200, 140 right alone, one item different: half-width below 0.03 and n >= 129: no note
    big = _paired_with_alone([nll_row("alone", [1, 1, 1], mmlu_preds=[0] * 140 + [1] * 60),
                              nll_row("c2c", [1, 1, 1], mmlu_preds=[0] * 141 + [1] * 59)])
    assert big[1]["mmlu_resolvable_difference"] <= 0.03 and "note" not in big[1] and "note" not in big[0]
    assert big[0]["mmlu_above_chance"] is True


def test_csv_table_and_plot_carry_the_controls_nll_and_notes(tmp_path):
    rows = _paired_with_alone([nll_row("alone", [2.0, 3.0, 1.0], mmlu_preds=[0, 1]),
                               nll_row("c2c", [1.5, 3.5, 0.5], mmlu_preds=[0, 0]),
                               nll_row("c2c_zero", [2.0, 3.0, 1.0], mmlu_preds=[0, 1]),
                               nll_row("c2c_shuffled", [1.0, 4.0, 1.0], mmlu_preds=[1, 1])])
    rec = R.RunRecorder(tmp_path / "run", {"seed": 0})
    rec.add_round({"round": 1})
    rec.update({"c2c": rows})
    rec.save()
    with (tmp_path / "run" / "c2c.csv").open(newline="") as f:
        table = list(csv.DictReader(f))
    assert [r["mode"] for r in table] == ["alone", "c2c", "c2c_zero", "c2c_shuffled"]
    for key in ("nll", "nll_ci95_low", "nll_vs_alone", "nll_vs_zero", "nll_vs_shuffled_ci95_high",
                "mmlu_above_chance", "mmlu_resolvable_difference", "note", "n_gsm8k", "n_nll"):
        assert key in c2c_section.C2C_COLUMNS and key in table[0]
    assert float(table[1]["nll_vs_zero"]) == pytest.approx(-1 / 6) and table[0]["nll_vs_zero"] == ""
    assert float(table[1]["nll"]) == pytest.approx(11 / 6) and table[1]["n_nll"] == "3"
    assert "cannot resolve a 3-point difference" in table[1]["note"]
    from rich.console import Console

    console = Console(width=400, record=True)
    console.print(c2c_section.c2c_table({"c2c": rows}))
    text = console.export_text()
    assert "c2c_shuffled" in text and "-0.167 [" in text  # c2c minus zero, with its interval
    assert "r alone is not above chance on MMLU" in text  # the notes, once each, in the caption
    assert text.count("r alone is not above chance on MMLU") == 1
    assert (tmp_path / "run" / "c2c.png").read_bytes().startswith(PNG_MAGIC)
    assert c2c_section.C2C_MODE_ORDER.index("c2c_zero") == c2c_section.C2C_MODE_ORDER.index("c2c") + 1
