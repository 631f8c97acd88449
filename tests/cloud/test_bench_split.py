"""``bench/bench_split.py --quick`` end to end (a 10-layer random tiny Qwen2 as target and
draft, the real service in its own process, one prompt of 8 tokens): every planned point
becomes a row, the pipelined ``split_spec`` is compared with its synchronous loop and the
streamed prefill with one MID on the same prompt, and the ratios are the rows' own."""

from __future__ import annotations

import importlib.util
import json

from tests.conftest import ROOT


def _bench():
    spec = importlib.util.spec_from_file_location("bench_split_under_test", ROOT / "bench" / "bench_split.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_quick_run_rows_ratios_and_controls(mirror, tmp_path):
    bench = _bench()
    out = tmp_path / "split.json"
    assert bench.main(["--quick", "--kms", "2", "2", "--rtts", "40", "--mirror", str(mirror),
                       "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["complete"] and not res["errors"] and not res["skipped"]
    rows = {(r["mode"], r["variant"]): r for r in res["rows"]}
    assert sorted(rows) == sorted([
        ("cloud", "main"), ("split", "main"), ("split_spec", "main"), ("spec_async", "main"),
        ("split_spec", "sync"), ("split", "act_float16"), ("split", f"stream{bench.STREAM_BLOCK}"),
        ("split", "head_english_whole"), ("split", "head_english_top64"), ("split", "head_corpus_whole")])
    for r in rows.values():
        assert r["new_tokens"] > 0 and r["fallbacks"] == 0
    # the ratios are the rows' tokens/s, pipelined against the synchronous loop included
    ratio = res["ratios"]["40ms k2 m2"]
    tps = {k: r["tokens_per_s"] for k, r in rows.items()}
    assert ratio["split_spec_over_split"] == tps[("split_spec", "main")] / tps[("split", "main")]
    assert ratio["pipelined_over_sync"] == tps[("split_spec", "main")] / tps[("split_spec", "sync")]
    # prompt by prompt (n = 1 here): the geometric mean is the one prompt's own ratio
    ps = res["paired_speedups"]["40ms k2 m2"]
    rec = {(r["mode"], r["variant"]): r for r in res["records"]}
    assert ps["n"] == 1 and abs(ps["split_spec_over_split_geomean"] - rec[("split_spec", "main")]["tokens_per_s"]
                                / rec[("split", "main")]["tokens_per_s"]) < 1e-9
    # both loops verify the same blocks through the same split: the same tokens
    toks = {(r["mode"], r["variant"]): r["tokens"] for r in res["records"]}
    assert toks[("split_spec", "main")] == toks[("split_spec", "sync")]
    # one MID against blocks of 32 rows, paired on the same prompt
    st = res["stream_prefill"]
    assert st["n"] == 1 and st["stream_block"] == bench.STREAM_BLOCK
    assert st["streamed_minus_one_mid_s"] == st["streamed_s"][0] - st["one_mid_s"][0]
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_rows_quick_times_every_row_count_and_refuses_a_bad_cut(tmp_path, capsys):
    """``bench/bench_rows.py --quick``: a time per row count for the whole model, its body
    and the split's middle, each ratio its own time over the first; a cut the model cannot take is
    one line and exit 2."""
    spec = importlib.util.spec_from_file_location("bench_rows_under_test", ROOT / "bench" / "bench_rows.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "rows.json"
    assert bench.main(["--quick", "--rows", "1", "3", "4", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    for key in ("model", "body", "middle"):
        ms = res[f"{key}_ms"]
        assert sorted(ms, key=int) == ["1", "3", "4"] and all(v > 0 for v in ms.values())
        assert res[f"{key}_ratio_to_first"] == {n: v / ms["1"] for n, v in ms.items()}
    # the calibrated padding: each count to the cheapest measured count at or above it
    ms = res["model_ms"]
    for n in range(1, 5):
        above = [m for m in (1, 3, 4) if m >= n]
        assert res["padding"][str(n)] in above
        assert ms[str(res["padding"][str(n)])] <= 1.05 * min(ms[str(m)] for m in above)
    assert res["padded_model_ms"] == {n: ms[str(res["padding"][n])] for n in ms}
    capsys.readouterr()
    assert bench.main(["--quick", "--split", "2", "2", "--out", str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("bench_rows: --split:"), err
    assert not (tmp_path / "bad.json").exists()
