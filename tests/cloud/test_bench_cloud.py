"""``bench/bench_cloud.py --quick`` end to end on the three tiny models (three tokenizers)
against a tiny-qwen2 cloud in its own process: the cloud alone runs once, every device model
gets its rows with its tokenizer path, the speculative outputs equal the cloud's, the
per-prompt ratios are the records' own, and the device sweep runs each device as a process."""

from __future__ import annotations

import importlib.util
import json
import math

from tests.conftest import ROOT

MODELS = ["tiny-llama", "tiny-gemma3", "tiny-qwen2"]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_cloud_under_test", ROOT / "bench" / "bench_cloud.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_quick_run_every_device_model_and_a_process_sweep(mirror, tmp_path):
    out = tmp_path / "cloud.json"
    assert _bench().main(["--quick", "--edge-models", *MODELS, "--target-model", "tiny-qwen2",
                          "--scale-model", "tiny-gemma3", "--drafter", "full_head", "--mirror", str(mirror),
                          "--no-pin", "--cloud-repeat", "--paired-cloud", "--out", str(out)]) == 0  # pinning would bind pytest to one core
    res = json.loads(out.read_text())
    assert res["pinned"] is None
    main = [r for r in res["modes"] if r.get("sweep") is None]
    assert [r["mode"] for r in main if r["mode"] == "cloud"] == ["cloud"]  # once per RTT
    by = {(r["device_model"], r["mode"]): r for r in main if r["mode"] != "cloud"}
    assert sorted(by) == sorted((m, mode) for m in MODELS for mode in ("spec_sync", "spec_async", "fusion_static"))
    for (model, mode), r in by.items():
        assert r["tokenizer"] == ("same" if model == "tiny-qwen2" else "cross")
        assert r["fallbacks"] == 0 and r["new_tokens"] > 0
        if mode != "fusion_static":
            assert r["identical_to_target"] is True
    # the per-prompt ratio of one prompt is its records' tokens/s ratio
    recs = res["records"]
    cloud = next(x for x in recs if x["mode"] == "cloud" and x.get("sweep") is None)
    for p in res["per_prompt"]:  # against the cloud's run next to it (the first model: the first run)
        mine = next(x for x in recs if x["mode"] == p["mode"] and x.get("device_model") == p["device_model"]
                    and x.get("sweep") is None)
        ref = next((x for x in recs if x["mode"] == "cloud" and x.get("sweep") == "paired"
                    and x.get("device_model") == p["device_model"]), cloud)
        assert (ref is cloud) == (p["device_model"] == MODELS[0])
        assert ref["tokens"] == cloud["tokens"]
        assert p["n"] == 1 and math.isclose(p["geomean"], mine["tokens_per_s"] / ref["tokens_per_s"])
    # the control: the cloud alone again; same greedy tokens, its ratio the noise floor
    again = next(x for x in recs if x["mode"] == "cloud" and x.get("sweep") == "repeat")
    assert again["tokens"] == cloud["tokens"]
    (floor,) = res["noise_floor"]
    assert floor["n"] == 1 and math.isclose(floor["worst"], again["tokens_per_s"] / cloud["tokens_per_s"])
    # the sweep: 1 and 2 device processes, each mode, every device's records kept
    sweep = {(r["mode"], r["devices"]): r for r in res["modes"] if r.get("sweep") == "devices"}
    assert sorted(sweep) == [("cloud", 1), ("cloud", 2), ("spec_async", 1), ("spec_async", 2)]
    assert sweep[("spec_async", 2)]["prompts"] == 2 and sweep[("spec_async", 2)]["aggregate_tokens_per_s"] > 0
    assert {x["device"] for x in recs if x.get("sweep") == "devices" and x["devices"] == 2} == {0, 1}
    assert res["targets"]["spec_identical_to_target"]["met"] is True
    assert (tmp_path / "cloud.png").is_file()
