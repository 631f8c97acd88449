"""The ClientApp's C2C handlers (edgefuse.app.handlers.c2c) on Flower records, without a federation:
installing fusers (version and integrity checks), rebuilding them, and the node's run prekey.

The client is a stand-in object with the attributes the handlers read (``entry``, ``slot``,
``cfg``); its model is tiny-llama with a LoRA adapter, the fusers' sharer tiny-qwen2.
"""

import json
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, Metadata, RecordDict

from edgefuse.app.handlers import c2c
from edgefuse.c2c.handshake import prekey_message
from edgefuse.transport.crypto import HandshakeError
from edgefuse.transport.identity import IdentityError, device_dir, load_identity, provision, verify_signature
from edgefuse.config import compose, lora_targets
from edgefuse.lora import attach_lora, get_adapter_state, set_adapter_state
from edgefuse.models import tiny_model
from edgefuse.c2c.fuser import C2CFuser, FuserConfig, kv_spec_from_config
from edgefuse.c2c.registry import (FuserCard, FuserIntegrityError, FuserRegistry, FuserVersion,
                             FuserVersionError, ModelVersion, adapter_hash, config_hash, pack_state)

SHARER = "tiny-qwen2"


@pytest.fixture(scope="module")
def cfg():
    return compose("tiny")


def make_client(cfg):
    model, tok = tiny_model("llama", seed=0)
    peft = attach_lora(model, rank=4, alpha=16.0, dropout=0.0,
                       target_modules=lora_targets(cfg, "tiny-llama"), seed=0)
    state = get_adapter_state(peft)
    rng = np.random.default_rng(0)
    set_adapter_state(peft, {k: (rng.normal(0, 0.05, v.shape).astype(np.float32) if ".lora_B." in k else v)
                             for k, v in state.items()})
    return SimpleNamespace(entry=SimpleNamespace(model="tiny-llama"), slot={"peft": peft, "tok": tok}, cfg=cfg)


def make_context():
    return Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})


def make_message(content: RecordDict) -> Message:
    meta = Metadata(run_id=1, message_id="", src_node_id=0, dst_node_id=1, reply_to_message_id="",
                    group_id="", created_at=time.time(), ttl=60.0, message_type="query.fusers")
    return Message(content=content, metadata=meta)


@pytest.fixture
def client(cfg):
    return make_client(cfg)


def saved_fuser(tmp_path, client, receiver_hash=None, seed=0):
    """Register a randomly initialised tiny-llama <- tiny-qwen2 fuser; return (state, config, card)."""
    sharer_model, _ = tiny_model("qwen2", seed=1)
    fcfg = FuserConfig(bottleneck=8, gate_init=1.0)
    torch.manual_seed(seed)
    fuser = C2CFuser(kv_spec_from_config(client.slot["peft"].config), kv_spec_from_config(sharer_model.config), fcfg)
    with torch.no_grad():
        for p in fuser.parameters():
            p.add_(0.01 * torch.randn(p.shape))
    receiver = ModelVersion("tiny-llama", receiver_hash or c2c.my_version(client).adapter_hash)
    version = FuserVersion(ModelVersion(SHARER, "base"), receiver, config_hash(fcfg.to_dict()))
    reg = FuserRegistry(tmp_path)
    reg.save(fuser, fcfg.to_dict(), version, FuserCard.for_version(version, train_steps=3))
    state, config, card = reg.load_state(version)
    return state, config, card, sharer_model


def fusers_message(state, config, card, client, sharer_model, tamper=False) -> Message:
    """What edgefuse.app.phases.c2c.C2C._distribute sends for one sharer."""
    packed, index = pack_state(state)
    if tamper:
        packed = {k: v.copy() for k, v in packed.items()}
        packed["fuser"][5] += 1.0
    meta = {"card": card.to_json(), "config": config, "index": index,
            "receiver_kv": kv_spec_from_config(client.slot["peft"].config).to_dict(),
            "sharer_kv": kv_spec_from_config(sharer_model.config).to_dict()}
    content = RecordDict({"c2c": ConfigRecord({"sharers": [SHARER], f"meta.{SHARER}": json.dumps(meta)}),
                          f"fuser.{SHARER}": ArrayRecord({k: Array(v) for k, v in packed.items()})})
    return make_message(content)


def test_my_version_is_spec_and_adapter_hash(client):
    v = c2c.my_version(client)
    assert v == ModelVersion("tiny-llama", adapter_hash(get_adapter_state(client.slot["peft"])))
    assert v.adapter_hash != "base" and len(v.adapter_hash) == 16


def test_install_and_load_matching_fuser(tmp_path, client):
    state, config, card, sharer_model = saved_fuser(tmp_path, client)
    ctx = make_context()
    out = c2c.install_fusers(fusers_message(state, config, card, client, sharer_model), ctx, client)
    assert out == {"installed": [SHARER], "version": c2c.my_version(client)}
    assert f"fuser.{SHARER}" in ctx.state.array_records and f"fusermeta.{SHARER}" in ctx.state.config_records
    fuser, got_card = c2c.load_fuser(ctx, client, SHARER)
    assert isinstance(fuser, C2CFuser) and not fuser.training
    assert got_card == card
    assert fuser.config == FuserConfig(bottleneck=8, gate_init=1.0)
    loaded = fuser.state_dict()
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    assert c2c.load_gate(ctx, client, [SHARER]) is None  # no gate was sent

    # the client's adapter moves on: the installed fuser is refused
    peft = client.slot["peft"]
    set_adapter_state(peft, {k: v * 1.5 for k, v in get_adapter_state(peft).items()})
    with pytest.raises(FuserVersionError, match="receiver adapter hash"):
        c2c.load_fuser(ctx, client, SHARER)
    with pytest.raises(FuserVersionError, match="no fuser installed for sharer 'tiny-gemma3'"):
        c2c.load_fuser(ctx, client, "tiny-gemma3")


def test_install_refuses_other_receiver_adapter(tmp_path, client):
    state, config, card, sharer_model = saved_fuser(tmp_path, client, receiver_hash="0123456789abcdef")
    ctx = make_context()
    with pytest.raises(FuserVersionError, match="receiver adapter hash") as err:
        c2c.install_fusers(fusers_message(state, config, card, client, sharer_model), ctx, client)
    assert not isinstance(err.value, FuserIntegrityError)
    assert "0123456789abcdef" in str(err.value) and c2c.my_version(client).adapter_hash in str(err.value)
    assert len(ctx.state.array_records) == 0 and len(ctx.state.config_records) == 0


def test_install_refuses_altered_weights(tmp_path, client):
    state, config, card, sharer_model = saved_fuser(tmp_path, client)
    ctx = make_context()
    with pytest.raises(FuserIntegrityError, match="digest"):
        c2c.install_fusers(fusers_message(state, config, card, client, sharer_model, tamper=True), ctx, client)
    assert f"fuser.{SHARER}" not in ctx.state.array_records
    assert f"fusermeta.{SHARER}" not in ctx.state.config_records


def test_install_refuses_other_kv_shapes(tmp_path, client):
    state, config, card, sharer_model = saved_fuser(tmp_path, client)
    msg = fusers_message(state, config, card, client, sharer_model)
    conf = msg.content["c2c"]
    meta = json.loads(conf[f"meta.{SHARER}"])
    meta["receiver_kv"]["num_layers"] = 2
    meta["receiver_kv"]["kv_heads"] = meta["receiver_kv"]["kv_heads"][:2]
    meta["receiver_kv"]["head_dim"] = meta["receiver_kv"]["head_dim"][:2]
    meta["receiver_kv"]["sliding"] = meta["receiver_kv"]["sliding"][:2]
    conf[f"meta.{SHARER}"] = json.dumps(meta)
    ctx = make_context()
    with pytest.raises(FuserVersionError, match="KV shapes"):
        c2c.install_fusers(msg, ctx, client)
    assert len(ctx.state.array_records) == 0


def test_the_prekey_is_per_run_signed_kept_in_state_only_and_forgotten(tmp_path):
    """One prekey per run (a new run id rotates it), signed by the device's identity for its
    name and run, held in context.state; query.forget drops it, after which the node refuses
    to open rather than make up a new key."""
    provision(tmp_path, 2)
    home = {"partition-id": 1, "device-dir": str(device_dir(tmp_path, 1))}
    ctx = Context(run_id=7, node_id=1, node_config=home, state=RecordDict(), run_config={})
    assert c2c.PREKEY_RECORD not in ctx.state.config_records
    a = c2c.prekey(ctx)
    rec = ctx.state[c2c.PREKEY_RECORD]
    assert len(bytes(rec["private"])) == 32 and int(rec["run_id"]) == 7
    assert c2c.prekey(ctx).public_bytes() == a.public_bytes()  # stable within the run
    info = c2c.signed_prekey(ctx)
    assert info["public_key"] == a.public_bytes()
    assert info["identity_key"] == load_identity(device_dir(tmp_path, 1) / "identity.key").public_bytes()
    verify_signature(info["identity_key"], info["prekey_signature"],
                     prekey_message("device-1", a.public_bytes(), 7))
    with pytest.raises(IdentityError):  # signed for this run and name only
        verify_signature(info["identity_key"], info["prekey_signature"],
                         prekey_message("device-1", a.public_bytes(), 8))
    assert not any(p.suffix not in (".key", ".json") for p in device_dir(tmp_path, 1).iterdir())
    # the next run of the series keeps the state but gets a new prekey
    ctx.state[c2c.SEALED_RECORD] = ConfigRecord({"tags": ["device-0:ab:cd"]})
    later = Context(run_id=8, node_id=1, node_config=home, state=ctx.state, run_config={})
    b = c2c.prekey(later)
    assert c2c.SEALED_RECORD not in later.state.config_records
    assert b.public_bytes() != a.public_bytes() and int(later.state[c2c.PREKEY_RECORD]["run_id"]) == 8
    assert c2c.forget_prekey(later) is True and c2c.PREKEY_RECORD not in later.state.config_records
    assert c2c.forget_prekey(later) is False
    with pytest.raises(HandshakeError, match="device-1 holds no prekey for run 8"):
        c2c._run_prekey(later)
