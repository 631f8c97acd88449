"""Privacy at the split: the probe attacks exactly what the cloud of a split session receives.

The attacker's features are the decoded bytes of the activation codec applied to the rows the
device's own front produced (``DeviceSplit.front``), and with a split head the tail columns of
the final hidden state as HEAD carries them; a split point outside the model is refused; the
probe's existing rows do not change when the split rows are added.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from edgefuse.attacks import inversion as I
from edgefuse.attacks.probe import PAYLOADS, SPLIT_PAYLOADS, _observe, run_probe, split_probe
from edgefuse.cloud import split as S
from edgefuse.privacy.canaries import load_canary_prompts

TEXT = "The quick brown fox jumps over the lazy dog near the river bank"


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny models on one torch thread (see conftest)."""


@pytest.fixture(scope="module")
def gemma():
    """The tiny random Gemma 3 (6 layers: split points 1..5 with m = 0, hidden size 64)."""
    from edgefuse.models import load_model

    return load_model("tiny-gemma3")


@pytest.fixture(scope="module")
def qwen():
    """The tiny random Qwen2 (2 layers: only k = 1, m = 0 fits)."""
    from edgefuse.models import load_model

    return load_model("tiny-qwen2")


def split_cfg(ks, m=0, act="int8", head_split=None):
    return OmegaConf.create({"ks": list(ks), "m": m, "act": act, "head_split": head_split})


@pytest.fixture
def recorded_fronts(monkeypatch):
    """Every ``DeviceSplit.front`` call's output, in call order (the real front still runs)."""
    calls = []
    real = S.DeviceSplit.front

    def front(self, ids):
        out = real(self, ids)
        calls.append((self.spec.k, list(np.asarray(ids).reshape(-1)), out.clone()))
        return out

    monkeypatch.setattr(S.DeviceSplit, "front", front)
    return calls


@pytest.mark.parametrize("act", ["int8", "float16"])
def test_the_attacker_sees_the_decoded_bytes_of_the_devices_front(gemma, recorded_fronts, act):
    model, tok = gemma
    probe = split_probe(model, split_cfg([1, 2, 4], act=act))
    ids, payloads, feats = _observe(model, tok, TEXT, [0], 4, 64, probe)
    T, D = len(ids), int(model.config.hidden_size)
    # one front per split point, over the prompt's own ids: the rows attacked are the rows sent
    assert [(k, got) for k, got, _ in recorded_fronts] == [(k, ids) for k in (1, 2, 4)]
    sent = b""
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    for k, _, rows in recorded_fronts:
        buf = S.encode_acts(rows, act)
        assert len(buf) == S.acts_nbytes(T, D, act)
        seen = S.decode_acts(buf, T, D, act)
        assert torch.equal(feats[("split_acts", k)], seen)
        sent += buf
        # the front's rows are the model's own hidden state after layer k (the probe's
        # ``hidden`` payload at layer k - 1), and what the cloud holds is within the codec's bound
        assert torch.allclose(rows.float(), ref[k][0].float(), atol=1e-5)
        if act == "int8":
            scales = np.frombuffer(buf, dtype="<f2", count=T).astype(np.float32)
            err = (seen - rows.float()).abs()
            assert bool((err <= torch.from_numpy(scales)[:, None] / 2 + 1e-7).all())
            assert float(err.max()) > 0  # the attacker really sees quantized rows, not the floats
    assert payloads["split_acts"] == sent  # the audited bytes are the MID payloads, k by k
    assert "split_head" not in payloads and not any(key[0] == "split_head" for key in feats)


def test_the_head_payload_is_the_final_hidden_tail_as_head_carries_it(gemma):
    model, tok = gemma
    s = 24
    probe = split_probe(model, split_cfg([2, 3], m=1, head_split=s))
    ids = tok.encode(TEXT, add_special_tokens=False)
    pay, feats = I.split_features(probe.parts, ids, "int8", s)
    assert sorted(pay["split_head"]) == [2]  # the HEAD of the smallest split point only
    T, D = len(ids), int(model.config.hidden_size)
    # the same session by hand: front → MID → middle → MIDOUT → back → head_part → HEAD
    parts = probe.parts[2]
    dev = S.DeviceSplit(parts, S.SplitSpec(2, 1, s, "int8"))
    mid_in = S.decode_acts(S.encode_acts(dev.front(ids), "int8"), T, D, "int8")
    (mid,), _ = S.middle_forward(parts.middle, [None], [0], [mid_in])
    back_in = S.decode_acts(S.encode_acts(mid.float(), "int8"), T, D, "int8")
    _, tail = dev.head_part(dev.back(back_in))
    buf = S.encode_acts(tail.float(), "int8")
    assert pay["split_head"][2] == buf and len(buf) == S.acts_nbytes(T, D - s, "int8")
    assert torch.equal(feats["split_head"][2], S.decode_acts(buf, T, D - s, "int8"))
    # ... and it is the unsplit model's final (normed) hidden state, columns [s:], up to int8
    with torch.no_grad():
        final = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    err = (feats["split_head"][2] - final[:, s:].float()).abs().max().item()
    assert err < 0.05 * final.abs().max().item(), err


def test_a_split_point_outside_the_model_is_refused(qwen, gemma):
    model, _ = qwen  # 2 layers: the cloud needs one, so only k = 1 with m = 0
    assert split_probe(model, split_cfg([1])).ks == [1]
    assert split_probe(model, split_cfg([])) is None and split_probe(model, None) is None
    with pytest.raises(ValueError, match=r"k=2 does not fit the probed model \(2 layers"):
        split_probe(model, split_cfg([1, 2]))
    with pytest.raises(ValueError, match="k=1 does not fit"):
        split_probe(model, split_cfg([1], m=1))
    with pytest.raises(ValueError, match="k=0"):
        split_probe(model, split_cfg([0]))
    with pytest.raises(ValueError, match=r"head_split=64 outside 1\.\.63"):
        split_probe(model, split_cfg([1], head_split=64))  # = D: nothing left for the cloud
    with pytest.raises(ValueError, match="head_split"):
        split_probe(model, split_cfg([1], head_split=0))
    with pytest.raises(ValueError, match="act"):
        split_probe(model, split_cfg([1], act="int4"))
    g, _ = gemma
    with pytest.raises(ValueError, match=r"k=6 does not fit the probed model \(6 layers"):
        split_probe(g, split_cfg([1, 6]))


def test_run_probe_refuses_a_bad_split_point_before_any_work(qwen, mirror):
    model, tok = qwen
    called = []
    priv = OmegaConf.create({"probe": {"modes": ["none"], "attack_layers": [0], "topk": 4, "canaries": 2,
                                       "attack_train_prompts": 2, "ridge": 1.0, "task_n": 0,
                                       "split": {"ks": [3], "m": 0, "act": "int8", "head_split": None}}})
    with pytest.raises(ValueError, match="k=3 does not fit"):
        run_probe(model, tok, priv, mirror, None, 0, protector=lambda t, m: called.append(m) or (t, 0))
    assert called == []


def test_split_config_is_checked_at_compose_time():
    from edgefuse.app.phases import compose
    from edgefuse.config import ConfigError

    base = compose("tiny")
    assert list(base.privacy.probe.split.ks) == []  # off by default: the main job's rows as before
    for bad, key in (("privacy.probe.split.ks=[0]", "ks"), ("privacy.probe.split.ks=2", "ks"),
                     ("privacy.probe.split.ks=[a]", "ks"), ("privacy.probe.split.m=-1", "split.m"),
                     ("privacy.probe.split.act=int4", "split.act"),
                     ("privacy.probe.split.head_split=0", "head_split")):
        with pytest.raises(ConfigError, match=key):
            compose("tiny", bad)
    ok = compose("tiny", "privacy.probe.split.ks=[1,2] privacy.probe.split.head_split=32")
    assert list(ok.privacy.probe.split.ks) == [1, 2] and ok.privacy.probe.split.head_split == 32


def _redactor_of(prompts):
    """A protector that replaces each canary value by a placeholder (``redact``), or keeps
    the text (``none``): the probe's modes without loading the NER models."""
    values = sorted({c for p in prompts for c in p.canaries}, key=len, reverse=True)

    def protector(texts, mode):
        if mode == "none":
            return list(texts), 0
        out = []
        for t in texts:
            for v in values:
                t = t.replace(v, "<PRIVATE>")
            out.append(t)
        return out, 0
    return protector


def test_run_probe_split_rows_per_k_and_protection(gemma, mirror):
    from edgefuse.config import compose

    model, tok = gemma
    # KV attacked at the last layer: Gemma's sliding-window layers keep only their window
    over = (f"data.mirror={mirror} privacy.probe.modes=[none,redact] privacy.probe.canaries=8 "
            "privacy.probe.attack_train_prompts=48 privacy.probe.task_n=0 privacy.probe.attack_layers=[-1]")
    cfg = compose("tiny", over)
    split = compose("tiny", over + " privacy.probe.split.ks=[1,2,4] privacy.probe.split.m=0 "
                                   "privacy.probe.split.head_split=32")
    prompts = load_canary_prompts(mirror, 8, int(cfg.seed))
    plain = run_probe(model, tok, cfg.privacy, mirror, cfg.data, int(cfg.seed), protector=_redactor_of(prompts))
    res = run_probe(model, tok, split.privacy, mirror, split.data, int(split.seed),
                    protector=_redactor_of(prompts))
    modes = ["none", "redact"]
    base = [p for p in PAYLOADS if p != "adapter"]
    assert [(r["payload"], r["protection"]) for r in res.rows] == \
        [(p, m) for m in modes for p in (*base, *SPLIT_PAYLOADS)]
    # the existing rows and per-layer figures are exactly those of the probe without the split
    assert [r for r in res.rows if r["payload"] in PAYLOADS] == plain.rows
    assert [x for x in res.layers if x["payload"] in PAYLOADS] == plain.layers
    rows = {(r["payload"], r["protection"]): r for r in res.rows}
    entries = {(x["payload"], x["k"], x["protection"]): x for x in res.layers if x["payload"] in SPLIT_PAYLOADS}
    assert sorted(entries) == sorted([("split_acts", k, m) for k in (1, 2, 4) for m in modes]
                                     + [("split_head", 1, m) for m in modes])
    n, D = len(prompts), int(model.config.hidden_size)
    for x in entries.values():
        assert x["attacker_token_acc_n"] == x["attacker_exact_match_n"] == n
        for key in ("attacker_token_acc", "attacker_exact_match"):
            assert x[f"{key}_ci95_low"] <= x[key] <= x[f"{key}_ci95_high"]
        assert x["act"] == "int8" and x["m"] == 0
        assert x["layer"] == (x["k"] - 1 if x["payload"] == "split_acts" else -1)
        assert x["head_split"] == (32 if x["payload"] == "split_head" else None)
    ids = [tok.encode(p.text, add_special_tokens=False)[:64] for p in prompts]
    T = sum(len(i) for i in ids)
    assert rows[("split_acts", "none")]["bytes"] == 3 * S.acts_nbytes(T, D, "int8")
    assert rows[("split_head", "none")]["bytes"] == S.acts_nbytes(T, D - 32, "int8")
    for payload in SPLIT_PAYLOADS:
        for m in modes:
            r = rows[(payload, m)]
            assert r["payloads"] == n and r["act"] == "int8"
            best = max((x for x in entries.values() if x["payload"] == payload and x["protection"] == m),
                       key=lambda x: x["attacker_token_acc"])
            assert (r["k"], r["attacker_token_acc"]) == (best["k"], best["attacker_token_acc"])
            assert r["layer"] == (best["k"] - 1 if payload == "split_acts" else None)
        assert rows[(payload, "redact")]["canary_hits"] == 0  # activations carry no canary bytes
    # measured (seed 0, 48 public prompts, random weights): k = 1 / 2 / 4 give 0.50 / 0.43 / 0.35
    # unprotected, 0.42 / 0.37 / 0.30 redacted (the canaries are what redaction takes out);
    # the HEAD tail 0.25
    acc = {k: entries[("split_acts", k, "none")]["attacker_token_acc"] for k in (1, 2, 4)}
    red = {k: entries[("split_acts", k, "redact")]["attacker_token_acc"] for k in (1, 2, 4)}
    assert acc[1] >= 0.4 and acc[1] > acc[2] > acc[4], acc  # deeper splits leak less
    assert all(red[k] <= acc[k] - 0.04 for k in acc), (acc, red)
    assert 0.1 <= entries[("split_head", 1, "none")]["attacker_token_acc"] < acc[1]


def test_the_bench_writes_per_k_rows_and_refuses_a_split_the_target_cannot_take(mirror, tmp_path, capsys):
    import importlib.util
    import json

    from tests.conftest import ROOT

    spec = importlib.util.spec_from_file_location("bench_split_privacy_under_test",
                                                  ROOT / "bench" / "bench_split_privacy.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "b.json"
    assert bench.main(["--quick", "--mirror", str(mirror), "--modes", "none", "rephrase", "--threads", "1",
                       "--head-split", "16", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert (res["model"], res["ks"], res["m"], res["head_split"], res["act"]) == ("tiny-llama", [1, 2], 0, 16, "int8")
    got = {(r["payload"], r["k"], r["protection"]): r for r in res["split"]}
    assert sorted(got) == sorted([("split_acts", k, m) for k in (1, 2) for m in ("none", "rephrase")]
                                 + [("split_head", 1, m) for m in ("none", "rephrase")])
    for (payload, k, mode), r in got.items():
        assert r["attacker_token_acc_n"] == res["canaries"] == 8
        assert r["attacker_token_acc_ci95_low"] <= r["attacker_token_acc"] <= r["attacker_token_acc_ci95_high"]
        if payload == "split_acts":  # the float16 hidden attack of the same layer, beside it
            assert r["hidden_float16_token_acc"] is not None and r["literature_token_acc"] == bench.LITERATURE.get(k)
    # a random-weight rephraser keeps next to nothing of the raw prompt
    assert got[("split_acts", 1, "rephrase")]["attacker_token_acc"] < got[("split_acts", 1, "none")]["attacker_token_acc"] - 0.5
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    assert bench.main(["--quick", "--mirror", str(mirror), "--ks", "1", "3", "--out", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "k=3 does not fit the probed model (3 layers" in err[0], err
    assert not (tmp_path / "c.json").exists()
