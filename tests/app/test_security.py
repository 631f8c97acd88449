"""Security review of the whole path (issue 5, item 5): each test fails if its protection goes.

1. key material never reaches logs, ``repr``/``str`` or attributes of the crypto objects;
2. a (key, nonce) pair is never used twice, and an exhausted sequence counter refuses;
3. an adapter from the server is checked (group, rank, shapes, finite) before the client
   applies it, and a refused one leaves the previous adapter in place;
4. a fuser that does not verify (unknown source, another sharer, altered config or weights)
   is refused at install and at load;
5. the server rejects a client update whose ``||ΔW||_F`` exceeds ``privacy.max_update_norm``
   (and NaN updates), aggregating the honest ones only;
6. results files carry no raw text unless ``privacy.debug_text``.
"""

import base64
import dataclasses
import json
import logging
import math
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flwr.app import Context, Message, Metadata, RecordDict

from edgefuse.app.handlers import c2c
from edgefuse.app.client_app import _load_adapter
from edgefuse.cloud import wire
from edgefuse.aggregation import (ClientUpdate, MalformedUpdateError, module_shapes, update_norm,
                                  validate_update)
from edgefuse.config import compose, lora_targets
from edgefuse.lora import attach_lora, get_adapter_state, set_adapter_state
from edgefuse.models import tiny_model
from edgefuse.results import JSON_NAME, RunRecorder, redact_results, scrub_text
from edgefuse.transport import crypto
from edgefuse.transport.crypto import (MAX_SEQ, ReplayError, TamperedFrameError, derive_session,
                                       generate_keypair, new_session_id)
from edgefuse.c2c.registry import FuserIntegrityError, FuserVersionError
from edgefuse.app.strategy import GroupedLoRA, NodeInfo
from tests.app.test_client_c2c import SHARER, fusers_message, make_client, make_context, saved_fuser
from tests.app.test_strategy import KEY, reply, state as one_module_state

log = logging.getLogger("edgefuse.security_test")


@pytest.fixture(scope="module")
def cfg():
    return compose("tiny")


# ----------------------------------------------------------------------------- 1. keys


class RecordingAESGCM:
    """Stands in for AESGCM inside crypto: records every (key, nonce) it encrypts with."""

    real = crypto.AESGCM
    used: list = []
    keys: list = []

    def __init__(self, key):
        self.key = bytes(key)
        RecordingAESGCM.keys.append(self.key)
        self._aead = self.real(key)

    def encrypt(self, nonce, data, aad):
        RecordingAESGCM.used.append((self.key, bytes(nonce)))
        return self._aead.encrypt(nonce, data, aad)

    def decrypt(self, nonce, data, aad):
        return self._aead.decrypt(nonce, data, aad)

    def __repr__(self):  # the stand-in is not under test: keep it out of the scans
        return "RecordingAESGCM()"


@pytest.fixture
def recording(monkeypatch):
    RecordingAESGCM.used, RecordingAESGCM.keys = [], []
    monkeypatch.setattr(crypto, "AESGCM", RecordingAESGCM)
    return RecordingAESGCM


def secret_forms(secret: bytes) -> list[str]:
    """How a secret could show up in text: hex (both cases, whole and 8-byte pieces), base64,
    url-safe base64, Python's bytes repr, raw bytes as latin-1."""
    h = secret.hex()
    forms = [h, h.upper(), base64.b64encode(secret).decode(),
             base64.urlsafe_b64encode(secret).decode().rstrip("="), repr(secret)[2:-1],
             secret.decode("latin-1")]
    forms += [h[i:i + 16] for i in range(0, len(h), 16)]
    return forms


def private_bytes(kp) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return kp._private.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                     serialization.NoEncryption())


def test_no_key_material_in_logs_reprs_or_attributes(recording, caplog):
    caplog.set_level(logging.DEBUG)
    # the cloud handshake of cloud/wire.py, both ends in memory
    device, cloud = generate_keypair(), generate_keypair()
    sid = new_session_id()
    dev_pub, got_sid = wire.decode_hello(wire.encode_hello(device.public_bytes(), sid))
    cloud_pub = wire.decode_welcome(wire.encode_welcome(cloud.public_bytes()))
    dev = derive_session(device, cloud_pub, sid, initiator=True)
    srv = derive_session(cloud, dev_pub, got_sid, initiator=False)
    for i in range(50):
        assert srv.open(dev.seal(f"prompt {i}".encode())) == f"prompt {i}".encode()
        assert dev.open(srv.seal(b"token")) == b"token"
    bad = bytearray(dev.seal(b"x"))
    bad[-1] ^= 1
    with pytest.raises(TamperedFrameError) as err:
        srv.open(bytes(bad))
    log.debug("rejected: %s", err.value)
    # a C2C run prekey kept in Flower's context state
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    node = c2c.prekey(ctx)
    objects = [device, cloud, dev, srv, node]
    for obj in objects:
        log.debug("object %r / %s", obj, obj)
    secrets = [private_bytes(device), private_bytes(cloud), private_bytes(node),
               device.exchange(cloud.public_bytes()), *recording.keys]
    assert len(recording.keys) == 4  # two sessions, one key per direction each
    texts = {"log": caplog.text}
    for i, obj in enumerate(objects):
        texts[f"repr {i}"] = repr(obj) + str(obj)
        texts[f"vars {i}"] = repr(vars(obj))
    for secret in secrets:
        for form in secret_forms(secret):
            for where, text in texts.items():
                assert form not in text, f"key material in {where}"
    # the safe reprs are in place (fingerprints, never keys)
    assert repr(device).startswith("KeyPair(public_fp=") and len(repr(device)) < 40
    assert repr(dev).startswith("SecureSession(initiator, session_fp=")
    assert "sent=51" in repr(dev) and "rejected=1" in repr(srv)


# ----------------------------------------------------------------------------- 2. nonces


def test_key_nonce_pairs_never_repeat_over_many_frames(recording):
    a, b = generate_keypair(), generate_keypair()
    sessions = 5
    for s in range(sessions):  # several sessions between the same two key pairs
        sid = new_session_id()
        ini = derive_session(a, b.public_bytes(), sid, initiator=True)
        res = derive_session(b, a.public_bytes(), sid, initiator=False)
        for i in range(1000):  # 1000 frames each way per session: 10k seals in all
            assert res.open(ini.seal(i.to_bytes(4, "big"))) == i.to_bytes(4, "big")
            assert ini.open(res.seal(b"r")) == b"r"
    used = recording.used
    assert len(used) == 2 * sessions * 1000
    assert len(set(used)) == len(used)  # no (key, nonce) pair twice
    assert len({k for k, _ in used}) == 2 * sessions  # one key per direction per session
    assert all(len(n) == 12 for _, n in used)


def test_exhausted_sequence_numbers_refuse_instead_of_wrapping():
    a, b = generate_keypair(), generate_keypair()
    sid = new_session_id()
    ini = derive_session(a, b.public_bytes(), sid, initiator=True)
    res = derive_session(b, a.public_bytes(), sid, initiator=False)
    first = ini.seal(b"first")
    ini._next_send_seq = MAX_SEQ  # jump to the last nonce
    res._next_recv_seq = MAX_SEQ
    assert res.open(ini.seal(b"last")) == b"last"
    for _ in range(2):  # refuses every time, never wraps to 0
        with pytest.raises(OverflowError, match="exhausted"):
            ini.seal(b"one too many")
    assert ini.next_send_seq == MAX_SEQ + 1 and ini.frames_sent == 2
    with pytest.raises(ReplayError):  # the receiver does not wrap either
        res.open(first)


# ----------------------------------------------------------------------------- 3. adapters


def adapter_client(cfg, model="tiny-llama", rank=4):
    """A stand-in for LocalClient with what _load_adapter reads."""
    peft_model, tok = tiny_model(model.removeprefix("tiny-"), seed=0)
    peft = attach_lora(peft_model, rank=rank, alpha=16.0, dropout=0.0,
                       target_modules=lora_targets(cfg, model), seed=0)
    init = get_adapter_state(peft)
    ident = {"partition_id": 0, "model": model, "lora_rank": rank, "lora_alpha": 16.0}
    return SimpleNamespace(slot={"peft": peft, "tok": tok, "init": init},
                           identity=lambda: dict(ident),
                           reset_adapter=lambda: set_adapter_state(peft, init))


def server_message(cfg, st, model="tiny-llama", rank=4) -> Message:
    """What edgefuse.app.strategy sends: content() with the node's group claims."""
    content, _ = GroupedLoRA(cfg).content(2, st, NodeInfo(7, 0, model, rank))
    meta = Metadata(run_id=1, message_id="", src_node_id=0, dst_node_id=7, reply_to_message_id="",
                    group_id="", created_at=time.time(), ttl=60.0, message_type="train")
    return Message(content=content, metadata=meta)


def perturbed(st, seed=0, scale=0.05):
    rng = np.random.default_rng(seed)
    return {k: (rng.normal(0, scale, v.shape).astype(np.float32) if ".lora_B." in k else v.copy())
            for k, v in st.items()}


def assert_state_equal(a, b):
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_server_adapter_is_checked_before_use(cfg):
    client = adapter_client(cfg)
    good = perturbed(client.slot["init"])
    assert _load_adapter(client, server_message(cfg, good)) > 0
    assert_state_equal(get_adapter_state(client.slot["peft"]), good)

    key_b = next(k for k in good if ".lora_B." in k)
    nan, inf = dict(good), dict(good)
    nan[key_b] = good[key_b].copy()
    nan[key_b][0, 0] = np.nan
    inf[key_b] = good[key_b].copy()
    inf[key_b][0, 0] = np.inf
    missing = {k: v for k, v in good.items() if not k.startswith(key_b.split(".lora_B.")[0])}
    rank8 = get_adapter_state(adapter_client(cfg, rank=8).slot["peft"])
    qwen = perturbed(get_adapter_state(adapter_client(cfg, "tiny-qwen2").slot["peft"]))
    cases = [
        (server_message(cfg, perturbed(good, 1)), {"model": "tiny-qwen2"}, "model group 'tiny-qwen2'"),
        (server_message(cfg, rank8, rank=8), {}, "for LoRA rank 8"),
        (server_message(cfg, rank8), {}, "does not match rank 4"),
        (server_message(cfg, nan), {}, "contains NaN"),
        (server_message(cfg, inf), {}, "contains Inf"),
        (server_message(cfg, missing), {}, "module set differs"),
        (server_message(cfg, qwen, "tiny-qwen2"), {}, "model group"),
    ]
    for msg, claims, why in cases:
        if claims:  # the server says the adapter is of another group
            msg.content["config"]["adapter_model"] = claims["model"]
        with pytest.raises(MalformedUpdateError, match="adapter from the server refused") as err:
            _load_adapter(client, msg)
        assert why in str(err.value)
        # refused: the previous adapter stays
        assert_state_equal(get_adapter_state(client.slot["peft"]), good)

    broken = server_message(cfg, good)
    broken.content["config"]["adapter_index"] = "[]"
    with pytest.raises(MalformedUpdateError, match="adapter from the server refused"):
        _load_adapter(client, broken)
    # without the group claims (older servers) the shape / rank / finite checks still apply
    plain = server_message(cfg, nan)
    del plain.content["config"]["adapter_model"], plain.content["config"]["adapter_rank"]
    with pytest.raises(MalformedUpdateError, match="NaN"):
        _load_adapter(client, plain)
    assert_state_equal(get_adapter_state(client.slot["peft"]), good)


GROUP_KINDS = ["train", "evaluate", "query.fusers", "query.share", "query.refine", "query.answer",
               "query.decode", "query.privacy"]


class ClientAppGrid:
    """A Grid whose one node (id 7, partition 0 of the tiny federation) runs the real
    ClientApp in-process; a ClientApp exception becomes an error reply as in Flower."""

    def __init__(self):
        self.context = Context(run_id=1, node_id=7, node_config={"partition-id": 0, "num-partitions": 4},
                               state=RecordDict(), run_config={})

    def send_and_receive(self, messages, *, timeout=None):
        from flwr.app import Error

        from edgefuse.app.client_app import app

        replies = []
        for msg in messages:
            try:
                replies.append(app(msg, self.context))
            except Exception as ex:
                replies.append(Message(Error(code=2, reason=f"{type(ex)}:<'{ex}'>"), reply_to=msg))
        return replies


def test_a_message_for_another_group_is_refused_on_every_kind(monkeypatch):
    """The attack: a server addresses partition 0 (tiny-llama, rank 4) as another group, with
    an adapter. Every message kind is refused before the node loads or applies anything."""
    from flwr.app import ConfigRecord
    from flwr.supercore.task_identity import TaskIdentity

    from edgefuse.app.handlers import privacy as privacy_handler
    from edgefuse.app.handlers.local import LocalClient
    from edgefuse.app.messages import NodeError, ask

    for attr, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, attr, value)
    cfg = compose("tiny", ["privacy=disabled"])
    client = adapter_client(cfg)
    client.cfg = cfg
    loads = []
    monkeypatch.setattr(LocalClient, "load", classmethod(lambda cls, *a: loads.append(a) or client))
    monkeypatch.setattr(privacy_handler, "probe", lambda msg, context, c: RecordDict(
        {"privacy": ConfigRecord({"rows": "[]"})}))
    sent = perturbed(client.slot["init"])
    strategy = GroupedLoRA(cfg)
    strategy.groups = {m: SimpleNamespace(per_client={0: sent}) for m in ("tiny-llama", "tiny-qwen2")}
    grid = ClientAppGrid()
    forged = [(NodeInfo(7, 0, "tiny-qwen2", 4), "adapter group tiny-qwen2 rank 4"),
              (NodeInfo(7, 0, "tiny-llama", 8), "adapter group tiny-llama rank 8")]
    for node, claim in forged:
        for kind in GROUP_KINDS:
            with pytest.raises(NodeError) as err:
                ask(grid, strategy, node, kind, timeout=5, round_idx=2)
            assert (f"{kind}: <class 'edgefuse.app.messages.GroupMismatchError'>:<'{kind} refused: "
                    f"addressed to {claim}, this node is tiny-llama rank 4'>") in str(err.value)
    # a message naming no group at all is refused too
    content, _ = strategy.content(2, sent)
    bare = Message(content, dst_node_id=7, message_type="query.decode")
    (refusal,) = grid.send_and_receive([bare])
    assert refusal.has_error() and "query.decode refused: the message names no adapter group" in refusal.error.reason
    # nothing was loaded, applied or stored
    assert loads == []
    assert_state_equal(get_adapter_state(client.slot["peft"]), client.slot["init"])
    assert len(grid.context.state.array_records) == len(grid.context.state.config_records) == 0

    # the node's own group passes, and its adapter is applied
    reply = ask(grid, strategy, NodeInfo(7, 0, "tiny-llama", 4), "query.privacy", timeout=5, round_idx=2)
    assert reply.json("privacy", "rows") == [] and len(loads) == 1
    assert_state_equal(get_adapter_state(client.slot["peft"]), sent)


# ----------------------------------------------------------------------------- 4. fusers


def test_fuser_from_an_unknown_or_altered_source_is_refused(tmp_path, cfg):
    client = make_client(cfg)
    st, config, card, sharer_model = saved_fuser(tmp_path, client)

    def install(card=card, config=config, tamper=False, sharer=SHARER, meta_edit=None):
        msg = fusers_message(st, config, card, client, sharer_model, tamper=tamper)
        conf = msg.content["c2c"]
        if sharer != SHARER:  # the same fuser, sent as the fuser of another sharer
            conf["sharers"] = [sharer]
            conf[f"meta.{sharer}"] = conf[f"meta.{SHARER}"]
            msg.content[f"fuser.{sharer}"] = msg.content[f"fuser.{SHARER}"]
        if meta_edit:
            meta = json.loads(conf[f"meta.{sharer}"])
            meta_edit(meta)
            conf[f"meta.{sharer}"] = json.dumps(meta)
        ctx = make_context()
        try:
            return c2c.install_fusers(msg, ctx, client), ctx
        finally:
            if not ctx.state.array_records:
                assert not ctx.state.config_records  # a refusal stores nothing

    # a card that was never saved by the registry (no sha256s, size or date): unknown source
    foreign = dataclasses.replace(card, weights_sha256="", created="")
    with pytest.raises(FuserIntegrityError, match="unknown source"):
        install(card=foreign)
    with pytest.raises(FuserIntegrityError, match="unknown source"):
        install(card=dataclasses.replace(card, state_sha256="f" * 16))
    with pytest.raises(FuserIntegrityError, match="sent as the fuser of 'tiny-gemma3'"):
        install(sharer="tiny-gemma3")
    with pytest.raises(FuserIntegrityError, match="config altered"):
        install(meta_edit=lambda m: m["config"].update(gate_init=0.5))
    with pytest.raises(FuserIntegrityError, match="digest"):
        install(tamper=True)
    with pytest.raises(FuserVersionError):  # every refusal is a FuserVersionError
        install(card=foreign)

    # installed, then altered in the client's store: load refuses too
    _, ctx = install()
    c2c.load_fuser(ctx, client, SHARER)
    from flwr.app import Array, ArrayRecord

    rec = ctx.state[f"fuser.{SHARER}"]
    flat = {k: v.numpy().copy() for k, v in rec.items()}
    flat["fuser"][3] += 1.0
    ctx.state[f"fuser.{SHARER}"] = ArrayRecord({k: Array(v) for k, v in flat.items()})
    with pytest.raises(FuserIntegrityError, match="digest"):
        c2c.load_fuser(ctx, client, SHARER)


# ----------------------------------------------------------------------------- 5. update norm


def test_update_norm_matches_hand_computed_value():
    # module m1: s B A = 2 * [[3,0,0],[0,4,0]] -> ||.||_F = 2 * 5 = 10
    # module m2: s B A = 2 * [[0,0],[0,0],[2,0]] -> 4 ; total sqrt(10² + 4²) = sqrt(116)
    st = {"m1.lora_A.weight": np.array([[1, 0, 0], [0, 1, 0]], np.float32),
          "m1.lora_B.weight": np.array([[3, 0], [0, 4]], np.float32),
          "m2.lora_A.weight": np.array([[2, 0], [0, 0]], np.float32),
          "m2.lora_B.weight": np.array([[0, 0], [0, 0], [1, 0]], np.float32)}
    assert update_norm(st, rank=2, alpha=4.0) == pytest.approx(math.sqrt(116))
    # equals the norm of the formed ΔW for a random adapter
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(4, 7)), rng.normal(size=(5, 4))
    rnd = {"x.lora_A.weight": a.astype(np.float32), "x.lora_B.weight": b.astype(np.float32)}
    assert update_norm(rnd, 4, 16.0) == pytest.approx(
        4.0 * np.linalg.norm(b.astype(np.float32) @ a.astype(np.float32)), rel=1e-5)

    upd = ClientUpdate(0, "m", 2, 4.0, 1, st)
    validate_update(upd, "m", None, max_norm=math.sqrt(116) + 1e-6)
    validate_update(upd, "m", None, max_norm=None)
    with pytest.raises(MalformedUpdateError, match="exceeds the bound"):
        validate_update(upd, "m", None, max_norm=10.0)


def test_oversized_and_nan_updates_are_rejected_the_rest_aggregated(cfg):
    assert cfg.privacy.max_update_norm == 100.0
    honest = [reply(10, 0, "tiny-llama", 1, one_module_state([[0.1, 0.2]], [[0.1], [0.0]]), n=1),
              reply(11, 1, "tiny-llama", 1, one_module_state([[0.5, 0.6]], [[0.5], [0.4]]), n=3)]
    huge = reply(12, 2, "tiny-llama", 1, one_module_state([[50.0, 0]], [[50.0], [0]]), n=100)
    nan = reply(13, 3, "tiny-llama", 1, one_module_state([[np.nan, 0]], [[1.0], [0]]), n=1)
    nodes = {i: NodeInfo(i, i - 10, "tiny-llama", 1) for i in (10, 11, 12, 13)}

    attacked = GroupedLoRA(cfg)
    attacked.nodes = dict(nodes)
    rows, _ = attacked.aggregate_train(1, honest + [huge, nan], {})
    by_pid = {r["partition_id"]: r for r in rows}
    assert [by_pid[p]["status"] for p in (0, 1, 2, 3)] == ["ok", "ok", "rejected", "rejected"]
    assert "max_update_norm" in by_pid[2]["reason"] and "4e+04" in by_pid[2]["reason"]
    assert "NaN" in by_pid[3]["reason"]

    clean = GroupedLoRA(cfg)
    clean.nodes = {i: nodes[i] for i in (10, 11)}
    clean.aggregate_train(1, honest, {})
    assert_state_equal(attacked.groups["tiny-llama"].global_state,
                       clean.groups["tiny-llama"].global_state)

    # null = no bound: the same huge update is aggregated
    unbounded = GroupedLoRA(compose("tiny", ["privacy.max_update_norm=null"]))
    unbounded.nodes = {i: nodes[i] for i in (10, 11, 12)}
    rows, _ = unbounded.aggregate_train(1, honest + [huge], {})
    assert all(r["status"] == "ok" for r in rows)


def _factor_attack_round(strategy, r, shift):
    """Two honest replies (partitions 0, 1) and the attacker (partition 2: A = 0, huge B)."""
    honest = [reply(10, 0, "tiny-llama", 1, one_module_state([[0.1 + shift, 0.2]], [[0.1], [0.0]]), n=1),
              reply(11, 1, "tiny-llama", 1, one_module_state([[0.5, 0.6 + shift]], [[0.5], [0.4]]), n=3)]
    attack = reply(12, 2, "tiny-llama", 1, one_module_state([[0.0, 0.0]], [[4e4], [4e4]]), n=1)
    return honest, attack


def _delta(g):
    st = g.global_state
    return g.global_alpha / g.global_rank * st[f"{KEY}.lora_B.weight"].astype(np.float64) @ st[f"{KEY}.lora_A.weight"]


def test_with_flexlora_at_equal_ranks_a_zero_huge_b_update_only_dilutes():
    """The factor attack on FedAvg of A and B: A = 0 with a huge B has ||s B A|| = 0 and passes
    the per-client bound, but an average of factors makes it meet the honest clients' A (the
    aggregate came out ~40,000x the honest one). training.equal_rank=flexlora averages ΔW:
    the attacker's zero update can only dilute the honest mean."""
    cfg = compose("tiny", ["training.equal_rank=flexlora"])
    nodes = {i: NodeInfo(i, i - 10, "tiny-llama", 1) for i in (10, 11, 12)}
    honest, attack = _factor_attack_round(None, 1, 0.0)
    s = GroupedLoRA(cfg)
    s.nodes = dict(nodes)
    rows, groups = s.aggregate_train(1, honest + [attack], {})
    assert groups[0]["method"] == "flexlora" and groups[0]["clipped"] is None
    clean = GroupedLoRA(cfg)
    clean.nodes = {i: nodes[i] for i in (10, 11)}
    clean.aggregate_train(1, honest, {})
    # ΔW with the attacker = (1·ΔW_0 + 3·ΔW_1 + 1·0) / 5 = 4/5 of the honest mean, exactly
    np.testing.assert_allclose(_delta(s.groups["tiny-llama"]), 0.8 * _delta(clean.groups["tiny-llama"]),
                               rtol=1e-5, atol=1e-7)


def test_with_fedavg_of_factors_the_attack_is_clipped_in_round_1_and_refused_from_round_2(cfg):
    assert cfg.training.equal_rank == "fedavg"  # the default, as FlowerTune
    bound = float(cfg.privacy.max_update_norm)
    nodes = {i: NodeInfo(i, i - 10, "tiny-llama", 1) for i in (10, 11, 12)}
    honest, attack = _factor_attack_round(None, 1, 0.0)
    s = GroupedLoRA(cfg)
    s.nodes = dict(nodes)
    rows, groups = s.aggregate_train(1, honest + [attack], {})
    assert [r["status"] for r in rows] == ["ok", "ok", "ok"]  # round 1: no adapter sent to compare with
    g = s.groups["tiny-llama"]
    assert groups[0]["method"] == "fedavg"
    assert update_norm(g.global_state, g.global_rank, g.global_alpha) == pytest.approx(bound, rel=1e-5)
    assert groups[0]["clipped"][1] > 100 * bound  # unclipped it was far above the bound

    s = GroupedLoRA(cfg)  # an honest round 1, then the attack in round 2
    s.nodes = dict(nodes)
    s.aggregate_train(1, honest, {})
    honest2, attack2 = _factor_attack_round(None, 2, 0.01)
    rows, groups = s.aggregate_train(2, honest2 + [attack2], {})
    by_pid = {r["partition_id"]: r for r in rows}
    assert [by_pid[p]["status"] for p in (0, 1, 2)] == ["ok", "ok", "rejected"]
    assert "factors are out of scale" in by_pid[2]["reason"]
    clean = GroupedLoRA(cfg)
    clean.nodes = {i: nodes[i] for i in (10, 11)}
    clean.aggregate_train(1, honest, {})
    clean.aggregate_train(2, honest2, {})
    assert_state_equal(s.groups["tiny-llama"].global_state, clean.groups["tiny-llama"].global_state)


def test_an_inflated_num_examples_is_capped_and_a_foreign_alpha_refused(cfg):
    """A client claiming 1e9 examples would own the FedAvg weights; the server caps every
    claim at what a round can train on (steps_per_round x batch_size). lora_alpha is the
    config's: a reply with another alpha (another scaling of the same factors) is refused."""
    seen = int(cfg.training.steps_per_round) * int(cfg.training.batch_size)
    a = one_module_state([[1.0, 0.0]], [[1.0], [0.0]])
    b = one_module_state([[0.0, 1.0]], [[0.0], [1.0]])
    nodes = {i: NodeInfo(i, i - 10, "tiny-llama", 1) for i in (10, 11)}

    def run(n_b):
        s = GroupedLoRA(cfg)
        s.nodes = dict(nodes)
        rows, _ = s.aggregate_train(1, [reply(10, 0, "tiny-llama", 1, a, n=seen),
                                        reply(11, 1, "tiny-llama", 1, b, n=n_b)], {})
        return rows, s.groups["tiny-llama"].global_state

    rows, inflated = run(10**9)
    assert [r["weight_examples"] for r in rows] == [seen, seen]
    assert rows[1]["num_examples"] == 10**9  # recorded as claimed
    _, honest = run(seen)
    assert_state_equal(inflated, honest)  # equal weights: A = [[0.5, 0.5]]
    np.testing.assert_allclose(inflated[f"{KEY}.lora_A.weight"], [[0.5, 0.5]])

    s = GroupedLoRA(cfg)
    s.nodes = dict(nodes)
    rows, _ = s.aggregate_train(1, [reply(10, 0, "tiny-llama", 1, a, n=seen),
                                    reply(11, 1, "tiny-llama", 1, b, n=seen, alpha=1e6)], {})
    assert rows[1]["status"] == "rejected" and "lora_alpha 1000000.0 differs" in rows[1]["reason"]


def test_a_path_like_model_name_never_reaches_the_file_system(cfg, tmp_path):
    """Finding: a client-declared model name became a server path (adapters/round_NNN/<model>,
    removed and rewritten). query.info claims are checked against federation.clients, so a
    traversal name is refused and the adapter folders carry only the config's names."""
    from edgefuse.app.server_app import save_adapters
    from tests.app.test_strategy import info_reply

    entry = cfg.federation.clients[0]
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("x")
    s = GroupedLoRA(cfg)
    errors = s.add_info([info_reply(1, {"partition_id": 0, "model": str(victim), "lora_rank": int(entry.lora_rank)}),
                         info_reply(2, {"partition_id": 0, "model": "../../victim", "lora_rank": int(entry.lora_rank)})])
    assert s.nodes == {} and len(errors) == 2 and all("query.info refused: claims" in e for e in errors)
    s.add_info([info_reply(3, {"partition_id": 0, "model": str(entry.model), "lora_rank": int(entry.lora_rank)})])
    _, groups = s.aggregate_train(1, [reply(3, 0, str(entry.model), int(entry.lora_rank),
                                            one_module_state([[0.1] * 2] * int(entry.lora_rank),
                                                             [[0.1] * int(entry.lora_rank)] * 2), n=1)], {})
    out = tmp_path / "run"
    save_adapters(cfg, s, groups, out, 1)
    assert [p.name for p in (out / "adapters" / "round_001").iterdir()] == [str(entry.model)]
    assert (victim / "keep.txt").read_text() == "x"


def test_a_round_1_update_of_another_shape_is_refused_and_the_run_goes_on(cfg):
    """Finding: reference shapes existed only after round 1, so two round-1 updates of
    different shapes crashed the average (and the run). Now the model's config decides,
    even when the odd one out has the lowest partition id."""
    from edgefuse.lora import attach_lora as attach

    real = get_adapter_state(attach(tiny_model("llama", seed=0)[0], rank=1, alpha=16.0, dropout=0.0,
                                    target_modules=lora_targets(cfg, "tiny-llama"), seed=0))
    wrong = {k: np.zeros((v.shape[0], v.shape[1] + 3) if k.endswith("lora_A.weight") else v.shape, np.float32)
             for k, v in real.items()}
    nodes = {i: NodeInfo(i, i - 10, "tiny-llama", 1) for i in (10, 11, 12)}
    s = GroupedLoRA(cfg)
    s.nodes = dict(nodes)
    rows, groups = s.aggregate_train(1, [reply(10, 0, "tiny-llama", 1, wrong, n=1),
                                         reply(11, 1, "tiny-llama", 1, real, n=1),
                                         reply(12, 2, "tiny-llama", 1, real, n=1)], {})
    assert [r["status"] for r in rows] == ["rejected", "ok", "ok"]
    assert "module shapes differ from tiny-llama's" in rows[0]["reason"]
    assert groups[0]["clients"] == [1, 2]
    assert s.shapes["tiny-llama"] == module_shapes(real)


def test_honest_training_stays_well_inside_the_default_bound(cfg):
    from edgefuse.data import tokenize_example
    from edgefuse.training import train_steps

    model, tok = tiny_model("llama", seed=0)
    t = cfg.training
    rank = 4
    peft = attach_lora(model, rank=rank, alpha=float(t.lora_alpha), dropout=0.0,
                       target_modules=lora_targets(cfg, "tiny-llama"), seed=0)
    rows = [tokenize_example({"instruction": f"Question {i}?", "context": "",
                              "response": f"Answer number {i} is fine."}, tok, 64) for i in range(8)]
    norms = []
    for r in range(3):  # three rounds of the tiny experiment's steps at its (large) lr
        train_steps(peft, rows, tok.pad_token_id, steps=int(t.steps_per_round),
                    batch_size=int(t.batch_size), lr=float(t.lr), max_grad_norm=float(t.max_grad_norm),
                    seed=0, round_idx=r)
        norms.append(update_norm(get_adapter_state(peft), rank, float(t.lora_alpha)))
    print("honest update norms per round:", [f"{n:.3f}" for n in norms])
    assert 0 < norms[0] and max(norms) < float(cfg.privacy.max_update_norm) / 10


# ----------------------------------------------------------------------------- 6. results text

PRIVATE = "Alice Example's card number is 4111 1111 1111 1111"


def run_record(tmp_path: Path, debug_text: bool) -> Path:
    out = tmp_path / ("debug" if debug_text else "private")
    rec = RunRecorder(out, {"privacy": {"debug_text": debug_text}, "seed": 0})
    rec.add_round({"round": 1, "clients": [{"partition_id": 0, "model": "tiny-llama",
                                            "lora_rank": 4, "status": "ok", "reason": None}]})
    rec.update({"decoding": [{"mode": "edge", "devices": 1, "rtt_ms": 0.0, "prompts": 1}],
                "decoding_records": [{"qid": "dolly/1", "kind": "dolly", "mode": "edge", "device": 0,
                                      "text": PRIVATE + " (answer)", "reference": PRIVATE,
                                      "tokens": [4111, 1111, 1111, 1111], "prompt": PRIVATE}],
                "c2c": [{"receiver": "tiny-llama", "sharers": [], "mode": "alone", "n": 1,
                         "answers": {"dolly/1": PRIVATE}, "error": None}]})
    rec.set_summary({"probe": [{"canary": PRIVATE, "answer": 2}]})
    rec.finish()
    return out


def test_results_carry_no_private_text_unless_debug(tmp_path):
    out = run_record(tmp_path, debug_text=False)
    files = [p for p in out.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {JSON_NAME, "results.csv", "decoding.csv", "c2c.csv"}
    needles = [PRIVATE.encode(), b"Alice", b"4111"]
    for p in files:
        data = p.read_bytes()
        for needle in needles:
            assert needle not in data, f"private text in {p.name}"
    res = json.loads((out / JSON_NAME).read_text())
    recd = res["decoding_records"][0]
    assert recd["text"].startswith(f"<text {len(PRIVATE) + 9} chars hmac:")
    assert recd["tokens"].startswith("<data 4 items hmac:")
    assert recd["qid"] == "dolly/1" and recd["mode"] == "edge"  # ids and numbers stay
    assert res["summary"]["probe"][0]["answer"] == 2
    assert res["config"]["privacy"] == {"debug_text": False}

    out = run_record(tmp_path, debug_text=True)
    res = json.loads((out / JSON_NAME).read_text())
    assert res["decoding_records"][0]["reference"] == PRIVATE
    assert PRIVATE.encode() in (out / JSON_NAME).read_bytes()


def test_scrub_text_tags():
    a, b = scrub_text(PRIVATE), scrub_text(PRIVATE)
    assert a == b and a != scrub_text(PRIVATE + ".")  # equal texts compare within a run
    assert PRIVATE not in a and a.startswith(f"<text {len(PRIVATE)} chars hmac:")
    assert scrub_text(PRIVATE, debug_text=True) == PRIVATE
    assert scrub_text(None) is None and scrub_text(3) == 3
    results = {"config": {"prompt": "kept"}, "rounds": [], "x": [{"prompt": PRIVATE}]}
    red = redact_results(results)
    assert red["config"]["prompt"] == "kept" and PRIVATE not in json.dumps(red)
    assert results["x"][0]["prompt"] == PRIVATE  # the input is not changed


def test_a_node_never_seals_twice_under_one_session(tmp_path):
    """A server that repeats a session id for one peer is refused: one exchange per id."""
    from flwr.app import ConfigRecord, Context, RecordDict

    from edgefuse.app.handlers.c2c import SessionReuseError, _session, signed_prekey
    from edgefuse.transport.identity import device_dir, provision

    provision(tmp_path, 2)
    ctx = [Context(run_id=1, node_id=p, node_config={"partition-id": p, "device-dir": str(device_dir(tmp_path, p))},
                   state=RecordDict(), run_config={}) for p in (0, 1)]
    info = signed_prekey(ctx[1])
    peer = {"peer_name": "device-1", "peer_identity_key": info["identity_key"],
            "peer_public_key": info["public_key"], "peer_prekey_signature": info["prekey_signature"]}
    conf = ConfigRecord({**peer, "session_id": "ab" * 16})
    first, handshake = _session(ctx[0], conf)
    assert first.seal(b"x") and len(handshake.ephemeral) == 32
    with pytest.raises(SessionReuseError, match="already used to seal payloads for device-1"):
        _session(ctx[0], conf)
    _session(ctx[0], ConfigRecord({**peer, "session_id": "cd" * 16}))  # a fresh session id is fine
