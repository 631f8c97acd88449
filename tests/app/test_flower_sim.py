"""End to end through `edgefuse run` -> `flwr run` -> a local SuperLink and Ray clients."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, mirror_path

pytestmark = pytest.mark.integration


def run_edgefuse(tmp_path: Path, *overrides: str) -> dict:
    env = dict(os.environ)
    if mirror_path():
        env["EDGEFUSE_DATA_MIRROR"] = str(mirror_path())
    cmd = [sys.executable, "-m", "edgefuse.cli", "run", f"outputs.root={tmp_path}", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    runs = sorted(p for p in tmp_path.iterdir() if (p / "results.json").exists())
    assert proc.returncode == 0 and runs, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((runs[-1] / "results.json").read_text())


@pytest.fixture(autouse=True)
def _need_mirror():
    if mirror_path() is None:
        pytest.skip("no data mirror: set EDGEFUSE_DATA_MIRROR or place ../shared/data")


def test_tiny_federation_survives_a_crashing_client(tmp_path):
    broken = tmp_path / "not-a-model"
    broken.mkdir()
    res = run_edgefuse(tmp_path / "out", "experiment=tiny", f"federation.clients.3.model={broken}")
    assert res["status"] == "completed"
    last = res["rounds"][-1]
    rows = {c["partition_id"]: c for c in last["clients"]}
    assert rows[3]["status"] == "failed" and "no config.json" in rows[3]["reason"]
    for pid in (0, 1, 2):
        assert rows[pid]["status"] == "ok"
        assert rows[pid]["eval_loss"] < rows[pid]["base_eval_loss"]
        assert rows[pid]["bytes_up"] > 0 and rows[pid]["bytes_down"] > 0
    groups = {g["model"]: g for g in last["groups"]}
    assert groups["tiny-llama"]["clients"] == [0, 1] and groups["tiny-llama"]["method"] == "flexlora"
    assert groups["tiny-qwen2"]["method"] == "fedavg"
    assert Path(groups["tiny-llama"]["adapter_dir"], "adapter_model.safetensors").is_file()
    out = Path(res["summary"]["out_dir"])
    for name in ("results.csv", "eval_loss.png", "bytes.png"):
        assert (out / name).stat().st_size > 0
    with open(out / "results.csv", newline="") as f:
        csv_rows = list(csv.DictReader(f))
    assert len(csv_rows) == 4 * len(res["rounds"])
    assert {r["status"] for r in csv_rows if r["partition_id"] == "3"} == {"failed"}
    # C2C goes on without the broken model: one fuser each way between the two that trained.
    assert sorted((f["sharer"], f["receiver"]) for f in res["fusers"]) == [
        ("tiny-llama", "tiny-qwen2"), ("tiny-qwen2", "tiny-llama")]
    assert {r["mode"] for r in res["c2c"]} == {"alone", "t2t", "c2c", "co_c2c"}  # no 2nd sharer
    assert all(r.get("error") is None and r["n"] > 0 for r in res["c2c"])


def test_tiny_c2c_trains_hosts_and_applies_fusers_for_every_pair(tmp_path):
    """Three architectures: six fusers trained on the server, installed by the receivers
    (version-checked), and every mode evaluated over E2E-sealed relayed payloads."""
    res = run_edgefuse(tmp_path, "experiment=tiny", "federation.num_rounds=1")
    assert res["status"] == "completed"
    models = ["tiny-llama", "tiny-qwen2", "tiny-gemma3"]
    pairs = sorted((f["sharer"], f["receiver"]) for f in res["fusers"])
    assert pairs == sorted((s, r) for s in models for r in models if s != r)
    out = Path(res["summary"]["out_dir"])
    for f in res["fusers"]:
        assert f["action"] == "trained" and f["download"] == "installed"
        assert f["bytes"] == 4 * f["params"] > 0 and f["train_steps"] == 2
        card = json.loads((out / "fusers" / f"{f['sharer']}__to__{f['receiver']}" / f["version"]
                           / "card.json").read_text())
        assert card["version_id"] == f["version"] and card["params"] == f["params"]
    rows = res["c2c"]
    assert all(r.get("error") is None for r in rows), [r.get("error") for r in rows]
    n = rows[0]["n"]
    assert n == 3 + 8 + 1 and all(r["n"] == n for r in rows)  # 3 MMLU, 1 Dolly row per category, 1 GSM8K
    by = {(r["receiver"], r["mode"], tuple(r["sharers"])): r for r in rows}
    assert len(by) == len(rows) == 3 * (1 + 3 * 2 + 1)  # alone, 2 x (t2t, c2c, co_c2c), multi
    for m in models:
        assert by[(m, "alone", ())]["bytes_sent"] == 0
        multi = [r for r in rows if r["receiver"] == m and r["mode"] == "multi"][0]
        assert sorted(multi["sharers"]) == sorted(x for x in models if x != m)
        for s in multi["sharers"]:
            c2c, co = by[(m, "c2c", (s,))], by[(m, "co_c2c", (s,))]
            assert co["bytes_sent"] > c2c["bytes_sent"] > by[(m, "t2t", (s,))]["bytes_sent"] > 0
        assert multi["bytes_sent"] == pytest.approx(
            sum(by[(m, "c2c", (s,))]["bytes_sent"] for s in multi["sharers"]))
    for name in ("c2c.csv", "c2c.png"):
        assert (out / name).stat().st_size > 0
    _check_decoding(res, out)
    _check_privacy(res, out)


def test_tiny_c2c_with_controls_through_flwr_run(tmp_path):
    """c2c.eval.controls through the whole job: the server trains the zero- and
    shuffled-sharer fusers with the real one's budget, the receiver installs all three, and
    the rows carry the controls and c2c's paired NLL differences from them."""
    res = run_edgefuse(tmp_path, "experiment=tiny", "federation.num_rounds=1", "cloud=disabled",
                       "privacy=disabled", 'c2c.pairs=["tiny-qwen2->tiny-llama"]', "c2c.eval.controls=true",
                       "c2c.eval.modes=[alone,c2c]", "c2c.eval.gsm8k_n=2")
    assert res["status"] == "completed"
    fusers = {f["control"]: f for f in res["fusers"]}
    assert sorted(fusers) == ["none", "shuffled", "zero"]
    assert len({f["version"] for f in fusers.values()}) == 3
    assert {f["action"] for f in fusers.values()} == {"trained"}
    assert len({f["train_steps"] for f in fusers.values()}) == 1
    mine = [r for r in res["c2c"] if r["receiver"] == "tiny-llama"]
    rows = {r["mode"]: r for r in mine}
    assert sorted(r["mode"] for r in mine) == ["alone", "c2c", "c2c_shuffled", "c2c_zero"]  # each once
    assert all(r.get("error") is None for r in rows.values()), [r.get("error") for r in rows.values()]
    c2c = rows["c2c"]
    for key in ("nll", "nll_vs_alone", "nll_vs_zero", "nll_vs_shuffled"):
        assert c2c.get(key) is not None, (key, sorted(c2c))
    assert c2c["n_nll"] == rows["alone"]["n_nll"] == c2c["nll_vs_alone_n"] > 0  # the same items
    assert c2c["nll_vs_alone"] == pytest.approx(c2c["nll"] - rows["alone"]["nll"], abs=1e-9)
    assert c2c["nll_vs_zero"] == pytest.approx(c2c["nll"] - rows["c2c_zero"]["nll"], abs=1e-9)
    assert c2c["nll_vs_shuffled"] == pytest.approx(c2c["nll"] - rows["c2c_shuffled"]["nll"], abs=1e-9)


MODES = ["edge", "cloud", "spec_sync", "spec_async", "fusion_static", "fusion_adaptive", "split", "split_spec"]
DEVICE_MODELS = {"tiny-llama": "cross", "tiny-qwen2": "same", "tiny-gemma3": "cross"}  # their tokenizers


def _check_decoding(res: dict, out: Path) -> None:
    """The same run's cloud phase: the tiny target served by its own process, one client of
    every model (tiny-llama and tiny-gemma3 of other tokenizers than the cloud's tiny-qwen2)
    decoding 2 GSM8K + 8 Dolly prompts in every mode with two concurrent sessions each."""
    rows = {(r["device_model"], r["mode"]): r for r in res["decoding"]}
    assert sorted(rows) == sorted((d, m) for d in DEVICE_MODELS for m in MODES)
    for (dm, m), r in rows.items():
        assert r["devices"] == 2 and r["prompts"] == 10 and r["fallbacks"] == 0, (dm, m)
        assert r["tokenizer"] == ("own" if m == "edge" else DEVICE_MODELS[dm]), (dm, m, r["tokenizer"])
    for dm in DEVICE_MODELS:
        assert rows[(dm, "cloud")]["round_trips_per_token"] == 1.0 and rows[(dm, "cloud")]["acceptance_rate"] is None
        for m in ("spec_sync", "spec_async"):  # greedy speculative decoding is lossless, whatever the tokenizer
            r = rows[(dm, m)]
            assert r["identical_to_target"] is True and r["agreement_with_target"] == 1.0, (dm, m)
            # a random tiny draft of another tokenizer never pays: the γ = 0 fallback may draft nothing
            assert r["round_trips_per_token"] <= 1.0 and (r["acceptance_rate"] is None or 0 <= r["acceptance_rate"] <= 1)
        for m in ("cloud", "spec_sync", "spec_async", "fusion_static", "fusion_adaptive"):
            assert 0 < rows[(dm, m)]["bytes_down_per_token"] < 1000 and rows[(dm, m)]["bytes_up_per_token"] > 0
        assert rows[(dm, "edge")]["bytes_up_per_token"] == 0 and rows[(dm, "edge")]["round_trips_per_token"] == 0
        assert rows[(dm, "edge")]["agreement_n"] == 10  # compared on the cloud's ids of the texts
        # split inference (experiment=tiny: k = 1, m = 0, a split head at column 32 under the
        # english mask; results.json keeps no token ids, the mask is tested in tests/cloud): a
        # MID and a HEAD per round, on the cloud's ids for every device
        for m in ("split", "split_spec"):
            assert rows[(dm, m)]["split"] == "k1 m0 int8 + head 32 english", rows[(dm, m)]
            assert rows[(dm, m)]["bytes_up_per_token"] > 0 and rows[(dm, m)]["bytes_down_per_token"] > 0
        assert rows[(dm, "split")]["round_trips_per_token"] >= 2.0  # MID + HEAD per token
    recs = res["decoding_records"]
    assert len(recs) == 10 * len(MODES) * len(DEVICE_MODELS)
    for dm in DEVICE_MODELS:
        for m in MODES:  # both sessions of each device decoded in every mode...
            assert {r["device"] for r in recs if r["mode"] == m and r["device_model"] == dm} == {0, 1}
    svc = res["summary"]["cloud_service"]
    assert svc["max_batch_size"] >= 2 and svc["frames_rejected"] == 0 and svc["failed"] == {}  # ...at the same time
    assert {d: v["tokenizer"] for d, v in svc["devices"].items()} == DEVICE_MODELS
    # the tiny-qwen2 client's `device: {profile: edge, quant: int8}`: it decoded on ONNX Runtime,
    # the export holding its adapter of the last round
    rt = svc["devices"]["tiny-qwen2"]["device_runtime"]
    assert rt["profile"] == "edge" and rt["runtime"] == "onnxruntime-int8" and rt["adapter"] != "base"
    assert svc["devices"]["tiny-llama"]["device_runtime"]["runtime"] == "torch-cpu"
    for name in ("decoding.csv", "decoding.png", "cloud_service.log"):
        assert (out / name).stat().st_size > 0


def _check_privacy(res: dict, out: Path) -> None:
    """The same run's privacy phase (on by default, protection ``both``): the probe's rows for
    every payload x protection, no canary found once prompts are redacted, and the run's live
    outbound audit (cloud frames, C2C relays, Flower replies) free of canaries."""
    modes = ["none", "redact", "rephrase", "both"]
    payloads = ["kv", "hidden", "logits_topk", "draft_tokens", "adapter"]
    assert res["config"]["privacy"]["probe"]["modes"] == modes
    rows = {(r["payload"], r["protection"]): r for r in res["privacy"]}
    assert len(rows) == len(res["privacy"]) == len(payloads) * len(modes)
    assert set(rows) == {(p, m) for p in payloads for m in modes}
    for (p, m), r in rows.items():
        if m in ("redact", "both"):
            assert r["canary_hits"] == 0, (p, m)
        assert r["payloads"] > 0 and r["bytes"] > 0
    # unprotected, the cloud reads the canaries in the prompt ids: the scan must see them
    assert rows[("draft_tokens", "none")]["canary_hits"] > 0
    assert rows[("draft_tokens", "none")]["attacker_token_acc"] == 1.0
    audit = res["privacy_audit"]
    assert audit["draft_tokens"]["payloads"] > 0 and audit["adapter"]["payloads"] > 0
    assert sum(v["canary_hits"] for v in audit.values()) == 0, audit
    summary = res["summary"]["privacy"]
    assert summary["canary_hits_with_redaction"] == 0 and summary["live_canary_hits"] == 0
    for name in ("privacy.csv", "privacy.png"):
        assert (out / name).stat().st_size > 0


def test_multirun_sweep_gives_one_folder_per_job(tmp_path):
    env = dict(os.environ, EDGEFUSE_DATA_MIRROR=str(mirror_path()))
    cmd = [sys.executable, "-m", "edgefuse.cli", "run", "--multirun", f"outputs.root={tmp_path}",
           "experiment=tiny", "federation.num_rounds=1", "c2c=disabled", "cloud=disabled", "training.lr=1e-3,3e-2"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    jobs = sorted(tmp_path.glob("multirun/*/*/results.json"))
    assert len(jobs) == 2
    lrs = sorted(json.loads(j.read_text())["config"]["training"]["lr"] for j in jobs)
    assert lrs == [1e-3, 3e-2]
    assert all(json.loads(j.read_text())["status"] == "completed" for j in jobs)


def test_smoke_federation_with_real_smollm2(tmp_path):
    from peft import PeftModel

    from edgefuse.models import load_model

    res = run_edgefuse(tmp_path, "experiment=smoke")
    assert res["status"] == "completed"
    assert res["config"]["federation"]["clients"][0]["model"] == "smollm2-135m"
    last = res["rounds"][-1]
    for row in last["clients"]:
        assert row["status"] == "ok"
        assert row["eval_loss"] < row["base_eval_loss"], row  # held-out loss fell
    group = last["groups"][0]
    assert group["method"] == "flexlora"  # ranks 4 and 8 in one group
    model, tok = load_model("smollm2-135m")
    ids = tok("Give me three tips for staying focused.", return_tensors="pt").input_ids
    with torch.no_grad():
        base_logits = model(ids).logits
        tuned = PeftModel.from_pretrained(model, group["adapter_dir"])
        assert tuned.peft_config["default"].r == group["global_rank"] == 8
        tuned_logits = tuned(ids).logits
    assert not torch.allclose(base_logits, tuned_logits, atol=1e-4)


def test_deployment_mode_with_real_supernode_processes(tmp_path):
    """A SuperLink and one SuperNode process per client on loopback sockets."""
    env = dict(os.environ, EDGEFUSE_OUTPUTS=str(tmp_path), EDGEFUSE_DATA_MIRROR=str(mirror_path()),
               BIN=str(Path(sys.executable).parent), PORT="19391")
    # C2C off: in deployment every message starts a fresh ClientApp process (model reload), and
    # the tiny C2C job's ~150 evaluation messages are covered by the simulation tests. The
    # cloud phase stays on: one message, then the SuperNode's ClientApp opens its own links.
    proc = subprocess.run(["bash", "scripts/deploy_local.sh", "tiny", "federation.num_rounds=1",
                           "c2c=disabled"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run,) = list(tmp_path.glob("deploy-*-tiny"))
    res = json.loads((run / "results.json").read_text())
    assert res["status"] == "completed"
    rows = res["rounds"][0]["clients"]
    assert [r["partition_id"] for r in rows] == [0, 1, 2, 3]
    assert all(r["status"] == "ok" and r["eval_loss"] < r["base_eval_loss"] for r in rows)
    # the cloud phase ran through the SuperNode's ClientApp: a row for every configured mode,
    # tokens generated in each, agreement with the target recorded, lossless speculation
    modes = res["config"]["cloud"]["modes"]
    assert modes == MODES
    dec = {(r["device_model"], r["mode"]): r for r in res["decoding"]}
    assert sorted(dec) == sorted((d, m) for d in DEVICE_MODELS for m in modes)  # every client model
    for (dm, m), r in dec.items():
        assert r["new_tokens"] > 0 and r["prompts"] == 10 and r["fallbacks"] == 0, (dm, m, r)
        assert 0 <= r["agreement_with_target"] <= 1, (dm, m, r)
    for dm in DEVICE_MODELS:
        assert dec[(dm, "cloud")]["agreement_with_target"] == 1.0 and dec[(dm, "cloud")]["round_trips_per_token"] == 1.0
        for m in ("spec_sync", "spec_async"):
            assert dec[(dm, m)]["identical_to_target"] is True and dec[(dm, m)]["agreement_with_target"] == 1.0
        assert dec[(dm, "edge")]["bytes_up_per_token"] == 0 and dec[(dm, "edge")]["round_trips_per_token"] == 0
    recs = res["decoding_records"]
    assert len(recs) == 10 * len(modes) * len(DEVICE_MODELS) and {r["mode"] for r in recs} == set(modes)
    assert res["summary"]["cloud_service"]["frames_rejected"] == 0
    assert (run / "decoding.csv").stat().st_size > 0 and (run / "cloud_service.log").stat().st_size > 0
