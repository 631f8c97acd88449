"""Fuser registry: versions, save/load round trip, refusals, integrity, packing, retrain rule.

A small C2C fuser between the tiny llama (sharer) and qwen2 (receiver) models, weights
randomised so the round trip is not trivially zero.
"""

import json
import math
import re

import numpy as np
import pytest
import torch

from edgefuse.models import tiny_model
from edgefuse.c2c.fuser import C2CFuser, FuserConfig, kv_spec_from_config
from edgefuse.c2c.registry import (
    FuserCard,
    FuserIntegrityError,
    FuserRegistry,
    FuserVersion,
    FuserVersionError,
    ModelVersion,
    adapter_change,
    adapter_hash,
    config_hash,
    needs_retrain,
    pack_state,
    unpack_state,
)

SHARER, RECEIVER = "tiny-llama", "org/tiny-qwen2"  # a "/" as in hub ids


@pytest.fixture(scope="module")
def specs():
    return {a: kv_spec_from_config(tiny_model(a)[0].config) for a in ("llama", "qwen2")}


def make_fuser(specs, seed=0, bottleneck=8):
    config = FuserConfig(bottleneck=bottleneck)
    fuser = C2CFuser(specs["qwen2"], specs["llama"], config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in fuser.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    full = {"fuser": config.to_dict(), "receiver_kv": specs["qwen2"].to_dict(),
            "sharer_kv": specs["llama"].to_dict()}
    return fuser, full


def adapter(seed=0):
    rng = np.random.default_rng(seed)
    return {"m.q_proj.lora_A.weight": rng.standard_normal((2, 4)).astype(np.float32),
            "m.q_proj.lora_B.weight": rng.standard_normal((4, 2)).astype(np.float32)}


def versions(config, sharer_hash="base", receiver_hash=None):
    receiver_hash = receiver_hash or adapter_hash(adapter(1))
    s, r = ModelVersion(SHARER, sharer_hash), ModelVersion(RECEIVER, receiver_hash)
    return s, r, FuserVersion(s, r, config_hash(config))


def save_one(reg, specs, seed=0, **kw):
    fuser, config = make_fuser(specs, seed)
    s, r, v = versions(config, **kw)
    card = FuserCard.for_version(v, train_steps=100, train_examples=64, data="dolly public 64",
                                 scores={"val_loss": 2.5, "base_val_loss": 3.0})
    path = reg.save(fuser, config, v, card)
    return fuser, config, s, r, v, path


def hidden(root):
    return [p for p in root.rglob(".*")]


# ---------------------------------------------------------------- round trip


def test_save_latest_load_for_round_trip(tmp_path, specs):
    reg = FuserRegistry(tmp_path)
    assert reg.latest(SHARER, RECEIVER) is None
    fuser, config, s, r, v, path = save_one(reg, specs)
    assert path == tmp_path / "tiny-llama__to__org%2Ftiny-qwen2" / v.id
    assert sorted(p.name for p in path.iterdir()) == ["card.json", "config.json", "fuser.safetensors"]
    assert reg.latest(SHARER, RECEIVER) == v

    state, cfg, card = reg.load_for(s, r)
    ref = fuser.state_dict()
    assert set(state) == set(ref)
    for k in ref:
        assert torch.equal(state[k], ref[k])
    assert cfg == config
    assert card.version == v and card.version_id == v.id
    assert (card.train_steps, card.train_examples, card.data) == (100, 64, "dolly public 64")
    assert card.scores == {"val_loss": 2.5, "base_val_loss": 3.0}
    assert card.params == fuser.num_parameters() and card.bytes == fuser.nbytes()
    assert card.created and card.format_version == 2 and card.trained_on["device"] == "cpu"
    assert json.loads((path / "card.json").read_text())["weights_sha256"] == card.weights_sha256
    assert reg.list() == [card]

    # the weights load into a fresh fuser built from the saved config
    fresh = C2CFuser(specs["qwen2"], specs["llama"], FuserConfig.from_dict(cfg["fuser"]))
    fresh.load_state_dict(state)


def test_version_id_stable_and_dict_round_trip():
    cfg = FuserConfig().to_dict()
    v = FuserVersion(ModelVersion("a", "base"), ModelVersion("b", "0123"), config_hash(cfg))
    assert FuserVersion.from_dict(json.loads(json.dumps(v.to_dict()))) == v
    assert v.id == FuserVersion.from_dict(v.to_dict()).id and len(v.id) == 16
    other = FuserVersion(ModelVersion("a", "base"), ModelVersion("b", "0124"), v.config_hash)
    assert other.id != v.id
    with pytest.raises(ValueError):
        FuserVersion.from_dict({"sharer": {"spec": "a", "adapter_hash": "base"}})


def test_resave_becomes_latest_and_replaces_same_version(tmp_path, specs):
    reg = FuserRegistry(tmp_path)
    _, _, _, _, v1, _ = save_one(reg, specs)
    fuser2, _, s2, r2, v2, _ = save_one(reg, specs, seed=1, receiver_hash="abcdef0123456789")
    assert v2 != v1 and reg.latest(SHARER, RECEIVER) == v2
    assert len(reg.list()) == 2
    fuser3, _, _, _, v3, _ = save_one(reg, specs, seed=2, receiver_hash="abcdef0123456789")
    assert v3 == v2 and len(reg.list()) == 2  # same version retrained: replaced
    state, _, _ = reg.load_for(s2, r2)
    assert all(torch.equal(state[k], t) for k, t in fuser3.state_dict().items())
    assert hidden(tmp_path) == []


# ---------------------------------------------------------------- refusals


def test_mismatched_receiver_adapter_refused(tmp_path, specs):
    reg = FuserRegistry(tmp_path)
    _, _, s, r, _, _ = save_one(reg, specs)
    client_receiver = ModelVersion(RECEIVER, adapter_hash(adapter(2)))
    with pytest.raises(FuserVersionError, match="receiver adapter hash") as e:
        reg.load_for(s, client_receiver)
    assert r.adapter_hash in str(e.value) and client_receiver.adapter_hash in str(e.value)
    assert "sharer" not in str(e.value).split("refusing to apply it:")[1]


def test_mismatched_sharer_spec_refused(tmp_path, specs):
    reg = FuserRegistry(tmp_path)
    _, _, s, r, v, _ = save_one(reg, specs)
    with pytest.raises(FuserVersionError, match="sharer spec: fuser expects 'tiny-llama', "
                                                "got 'other-llama'"):
        reg.check_compatible(v, ModelVersion("other-llama", "base"), r)
    # a pair with no fuser at all
    with pytest.raises(FuserVersionError, match="no fuser registered"):
        reg.load_for(ModelVersion("other-llama", "base"), r)
    reg.check_compatible(v, s, r)  # matching: no error


def test_tampered_weights_refused(tmp_path, specs):
    reg = FuserRegistry(tmp_path)
    _, _, s, r, v, path = save_one(reg, specs)
    w = path / "fuser.safetensors"
    data = bytearray(w.read_bytes())
    data[-5] ^= 0x01
    w.write_bytes(bytes(data))
    with pytest.raises(FuserIntegrityError, match="sha256.*refusing"):
        reg.load_for(s, r)


def test_unparseable_weights_refused_even_with_matching_sha(tmp_path, specs):
    import hashlib
    reg = FuserRegistry(tmp_path)
    _, _, s, r, v, path = save_one(reg, specs)
    garbage = b"not a safetensors file"
    (path / "fuser.safetensors").write_bytes(garbage)
    card = json.loads((path / "card.json").read_text())
    card["weights_sha256"] = hashlib.sha256(garbage).hexdigest()
    (path / "card.json").write_text(json.dumps(card))
    with pytest.raises(FuserIntegrityError, match="not a valid safetensors"):
        reg.load_state(v)


def test_edited_card_or_config_refused(tmp_path, specs):
    reg = FuserRegistry(tmp_path)
    _, config, s, r, v, path = save_one(reg, specs)
    card = json.loads((path / "card.json").read_text())
    card["receiver_adapter_hash"] = "0" * 16  # pretend it fits another adapter
    (path / "card.json").write_text(json.dumps(card))
    with pytest.raises(FuserIntegrityError, match="card edited or corrupted"):
        reg.latest(SHARER, RECEIVER)

    reg2 = FuserRegistry(tmp_path / "b")
    _, config, s, r, v, path = save_one(reg2, specs)
    (path / "config.json").write_text(json.dumps({**config, "fuser": {}}))
    with pytest.raises(FuserIntegrityError, match="config edited"):
        reg2.load_for(s, r)
    (path.parent / "latest").write_text("../../etc\n")
    with pytest.raises(FuserIntegrityError, match="not a version id"):
        reg2.latest(SHARER, RECEIVER)


# ---------------------------------------------------------------- atomic save


def test_atomic_save_leaves_no_temp_and_failures_change_nothing(tmp_path, specs, monkeypatch):
    reg = FuserRegistry(tmp_path)
    _, _, s, r, v1, _ = save_one(reg, specs)
    assert hidden(tmp_path) == []

    # a card that cannot be written (NaN score): nothing written at all
    fuser, config = make_fuser(specs, 1)
    _, _, v2 = versions(config, receiver_hash="1" * 16)
    bad = FuserCard.for_version(v2, scores={"val_loss": float("nan")})
    with pytest.raises(ValueError, match="NaN"):
        reg.save(fuser, config, v2, bad)

    # a crash while writing the files: the temp folder is removed, latest unchanged
    import edgefuse.c2c.registry as registry
    calls = []

    def failing_write(path, data):
        calls.append(path.name)
        if path.name == "card.json":
            raise OSError("disk full")
        return real_write(path, data)

    real_write = registry._write
    monkeypatch.setattr(registry, "_write", failing_write)
    with pytest.raises(OSError, match="disk full"):
        reg.save(fuser, config, v2, FuserCard.for_version(v2))
    assert calls == ["fuser.safetensors", "config.json", "card.json"]
    assert hidden(tmp_path) == []
    assert not reg.path(v2).exists()
    assert reg.latest(SHARER, RECEIVER) == v1
    assert [c.version for c in reg.list()] == [v1]


def test_save_checks_config_and_card(tmp_path, specs):
    reg = FuserRegistry(tmp_path)
    fuser, config = make_fuser(specs)
    _, _, v = versions(config)
    with pytest.raises(ValueError, match="config hashes to"):
        reg.save(fuser, {**config, "extra": 1}, v, FuserCard.for_version(v))
    other = FuserVersion(v.sharer, ModelVersion(RECEIVER, "base"), v.config_hash)
    with pytest.raises(ValueError, match="the card is for version"):
        reg.save(fuser, config, v, FuserCard.for_version(other))
    assert not tmp_path.exists() or list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- hashes


def test_adapter_hash_stable_sensitive_and_base():
    a = adapter(0)
    assert adapter_hash(None) == "base"
    h = adapter_hash(a)
    assert len(h) == 16 and h == adapter_hash({k: v.copy() for k, v in reversed(a.items())})
    assert h == adapter_hash({k: v.astype(np.float64) for k, v in a.items()})  # values, not dtype
    assert h == adapter_hash({k: torch.from_numpy(v) for k, v in a.items()})
    changed = {k: v.copy() for k, v in a.items()}
    changed["m.q_proj.lora_B.weight"][3, 1] += 1e-3
    assert adapter_hash(changed) != h
    reshaped = {k: v.reshape(-1) for k, v in a.items()}
    assert adapter_hash(reshaped) != h
    assert adapter_hash({}) != "base"


def test_config_hash_order_independent():
    a = {"bottleneck": 8, "reduction": "mean", "nested": {"x": 1, "y": [1, 2]}}
    b = {"nested": {"y": [1, 2], "x": 1}, "reduction": "mean", "bottleneck": 8}
    assert config_hash(a) == config_hash(b) and len(config_hash(a)) == 12
    assert config_hash(a) != config_hash({**a, "bottleneck": 9})
    with pytest.raises(ValueError, match="JSON"):
        config_hash({"x": float("nan")})


# ---------------------------------------------------------------- retraining rule


def lora(b):
    """One rank-1 module on 2x2: A = [1, 0], B = b, so ΔW = [[b0, 0], [b1, 0]]."""
    return {"m.lora_A.weight": np.array([[1.0, 0.0]], np.float32),
            "m.lora_B.weight": np.array([[b[0]], [b[1]]], np.float32)}


def test_needs_retrain_hand_checked_2x2():
    old = lora([1.0, 0.0])                      # ΔW_old = [[1, 0], [0, 0]], ||.||_F = 1
    small, large = lora([1.0, 0.03]), lora([1.0, 0.1])  # differences of norm 0.03 and 0.1
    assert adapter_change(old, small) == pytest.approx(0.03, rel=1e-6)
    assert adapter_change(old, large) == pytest.approx(0.1, rel=1e-6)
    assert not needs_retrain(old, small)
    assert needs_retrain(old, large)
    assert not needs_retrain(old, large, threshold=0.2)
    # two modules: norms are pooled, ratio = sqrt(0.1² + 0) / sqrt(1² + 2²)
    two_old = {**old, **{k.replace("m.", "n."): 2 * v for k, v in lora([1.0, 0.0]).items()}}
    two_new = {**large, **{k: v for k, v in two_old.items() if k.startswith("n.")}}
    # n: A = [2, 0], B = [2, 0]ᵀ -> ΔW = [[4, 0], [0, 0]]
    assert adapter_change(two_old, two_new) == pytest.approx(0.1 / math.sqrt(1 + 16), rel=1e-6)


def test_needs_retrain_structure_and_none():
    a = lora([1.0, 0.0])
    assert not needs_retrain(None, None)
    assert needs_retrain(None, a) and needs_retrain(a, None)
    assert not needs_retrain(a, {k: v.copy() for k, v in a.items()})
    zero = lora([0.0, 0.0])
    assert not needs_retrain(zero, zero)
    assert needs_retrain(zero, lora([1e-3, 0.0]))  # from B = 0 init: any update counts
    rank2 = {"m.lora_A.weight": np.zeros((2, 2), np.float32),
             "m.lora_B.weight": np.zeros((2, 2), np.float32)}
    assert needs_retrain(a, rank2)              # rank changed
    assert needs_retrain(a, {"k.lora_A.weight": a["m.lora_A.weight"],
                             "k.lora_B.weight": a["m.lora_B.weight"]})  # other module
    with pytest.raises(ValueError):
        needs_retrain(a, a, threshold=-1)
    with pytest.raises(ValueError):
        needs_retrain({"m.weight": np.zeros((2, 2))}, a)


# ---------------------------------------------------------------- wire packing


def test_pack_unpack_round_trip(specs):
    fuser, _ = make_fuser(specs)
    arrays, index = pack_state(fuser.state_dict())
    assert list(arrays) == ["fuser"] and arrays["fuser"].dtype == np.float32
    assert arrays["fuser"].size == fuser.num_parameters()
    state = unpack_state(arrays, index)
    ref = fuser.state_dict()
    assert set(state) == set(ref)
    for k, t in ref.items():
        assert state[k].dtype == np.float32 and np.array_equal(state[k], t.numpy())
    fresh = C2CFuser(fuser.receiver_spec, fuser.sharer_spec, fuser.config)
    fresh.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    assert unpack_state(*pack_state({})) == {}


def test_unpack_rejects_malformed_index(specs):
    fuser, _ = make_fuser(specs)
    arrays, index_json = pack_state(fuser.state_dict())
    index = json.loads(index_json)
    n = arrays["fuser"].size

    def edit(i, **changes):
        out = [dict(e) for e in index]
        out[i].update(changes)
        return json.dumps(out)

    bad = {
        "not valid JSON": "{",
        "must be a JSON list": json.dumps({"a": 1}),
        "out of bounds": edit(-1, offset=n),
        "!= prod": edit(0, size=index[0]["size"] + 1),
        "gap or overlap": edit(1, offset=index[1]["offset"] - 1),
        "repeated key": edit(1, key=index[0]["key"]),
        "bad shape": edit(0, shape=[-1]),
        "bad key or part": json.dumps([{**index[0], "part": "x"}] + index[1:]),
        "lacks or adds fields": json.dumps([{**index[0], "extra": 1}] + index[1:]),
        "add up to": json.dumps(index[:-1]),
    }
    for reason, text in bad.items():
        with pytest.raises(ValueError, match=re.escape(reason)):
            unpack_state(arrays, text)
    with pytest.raises(ValueError, match="1-D float"):
        unpack_state({"fuser": arrays["fuser"].astype(np.int32)}, index_json)
    with pytest.raises(ValueError, match="missing packed part 'fuser'"):
        unpack_state({}, index_json)
    nan = arrays["fuser"].copy()
    nan[0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        unpack_state({"fuser": nan}, index_json)
    with pytest.raises(ValueError, match="dtype"):
        pack_state({"x": np.arange(3)})


def test_cli_lists_a_registry(tmp_path, specs, capsys):
    from edgefuse.cli.main import main

    reg = FuserRegistry(tmp_path)
    fuser, _, _, _, v, _ = save_one(reg, specs)
    assert main(["fusers", "list", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert v.id in out and f"{fuser.num_parameters():,}" in out and "yes" in out
    assert main(["fusers", "list", str(tmp_path / "missing")]) == 2
    assert "no registry folder" in capsys.readouterr().err
