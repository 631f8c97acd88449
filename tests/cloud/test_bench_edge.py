"""``bench/bench_edge.py --quick`` end to end on the tiny Llama (no service): each cell in its
own process; the fp32 ONNX export agrees with PyTorch exactly (greedy, teacher-forced, NLL),
the speed-ups and agreements are the cells' own numbers, and every memory cell reports its
steps in order."""

from __future__ import annotations

import importlib.util
import json
import math

from tests.conftest import ROOT


def _bench():
    spec = importlib.util.spec_from_file_location("bench_edge_under_test", ROOT / "bench" / "bench_edge.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_quick_run_rows_parity_and_memory(mirror, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEFUSE_DATA_MIRROR", str(mirror))
    monkeypatch.setenv("EDGEFUSE_CACHE", str(tmp_path / "cache"))  # exports go here, not the user's cache
    bench = _bench()
    out = tmp_path / "edge.json"
    assert bench.main(["--quick", "--models", "tiny-llama", "--quants", "fp32", "int8",
                       "--parts", "runtime", "parity", "memory", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert not [k for k, v in res["cells"].items() if "error" in v], res["cells"]
    rows = {(r["runtime"], r["quant"]): r for r in res["runtime"]}
    assert sorted(rows) == [("onnx", "fp32"), ("onnx", "int8"), ("torch", "fp32")]
    fp32 = rows[("onnx", "fp32")]
    assert fp32["greedy_identical"] == 1.0 and fp32["next_token_agreement"] == 1.0
    assert math.isclose(fp32["perplexity_ratio"], 1.0, rel_tol=1e-4)
    assert res["fp32_parity"]["tiny-llama"]["max_abs_logit_diff"] < 1e-4
    # the speed-up is the geometric mean of the per-prompt ratios of the two cells' own rates
    on = res["cells"]["decode/tiny-llama/onnx/int8"]["speed"]["1"]
    ref = res["cells"]["decode/tiny-llama/torch/fp32"]["speed"]["1"]
    logs = [math.log(a["tokens_per_s"] / b["tokens_per_s"]) for a, b in zip(on, ref)]
    assert math.isclose(rows[("onnx", "int8")]["speedup_1t"], math.exp(sum(logs) / len(logs)), rel_tol=1e-9)
    assert rows[("onnx", "int8")]["export_s"] > 0
    mem = res["memory"]
    assert set(mem) == {"tiny-llama/train/torch", "tiny-llama/train/torch-checkpointing",
                        "tiny-llama/decode/torch-fp32", "tiny-llama/decode/onnx-int8",
                        "tiny-llama/decode/onnx-int4", "tiny-llama/decode/onnx-int8-lean"}
    for cell in mem.values():  # cumulative peaks, in the order the steps ran
        steps = list(cell["steps"].values())
        assert steps == sorted(steps) and cell["peak_rss_mb"] == steps[-1]
    # the lean runtime imports no PyTorch: far below a process that does
    assert mem["tiny-llama/decode/onnx-int8-lean"]["steps"]["imports"] < 100 < mem["tiny-llama/decode/onnx-int8"]["steps"]["imports"]
    assert (tmp_path / "edge.png").stat().st_size > 0
