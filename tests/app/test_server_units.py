"""The server's pieces outside a federation run, on hand-made replies and a fake Grid:
evaluate aggregation, round messages, node identities (``query.info``, tokenizer identity
within a model group and between device and cloud, refused before round 1), and the C2C
relay (queries chunked into several messages, one failing receiver, ciphertext only).

The relay tests run the real device handlers (:mod:`edgefuse.app.handlers.c2c`) in-process
on tiny random-weight models (tiny-llama as partition 0, tiny-qwen2 as partition 2), each
with its own signed prekey in its own Flower ``Context`` and its identity and pins from the
keys the test session provisions.
"""

import json
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flwr.app import (Array, ArrayRecord, ConfigRecord, Context, Error, Message, Metadata, MetricRecord,
                      RecordDict)

from edgefuse.app import client_app
from edgefuse.app.device import DeviceHome
from edgefuse.app.handlers import c2c as handlers
from edgefuse.app.phases import PhaseContext
from edgefuse.app.phases import c2c as c2c_phase
from edgefuse.app.phases.c2c import C2C
from edgefuse.app.strategy import GroupedLoRA, NodeInfo, TokenizerMismatchError
from edgefuse.c2c import peer
from edgefuse.c2c.handshake import prekey_message
from edgefuse.c2c.fuser import C2CFuser, FuserConfig, kv_spec_from_config
from edgefuse.c2c.registry import FuserCard, FuserRegistry, FuserVersion, config_hash, pack_state
from edgefuse.cloud.target import tokenizer_fingerprint
from edgefuse.config import ConfigError, compose, from_json, lora_targets, to_json
from edgefuse.eval.queries import Query
from edgefuse.lora import attach_lora, get_adapter_state, set_adapter_state, unpack_adapter
from edgefuse.models import tiny_model, tiny_tokenizer
from edgefuse.results import JSON_NAME
from edgefuse.transport.identity import verify_signature
from edgefuse.transport.wan import WanLink, WanProfile
from tests.app.test_phases import CLIENTS, FakeGrid, run_main, server_identity  # noqa: F401
from tests.app.test_strategy import KEY, error_reply, info_reply, reply, state

OFF = "c2c=disabled cloud=disabled privacy=disabled outputs.save_adapters=false"
pytestmark = pytest.mark.usefixtures("server_identity")  # Flower's ServerApp identity, for Messages


@pytest.fixture
def strategy():
    # hand-made states are far larger than real adapters: no norm bound (see test_security)
    s = GroupedLoRA(compose("tiny", ["privacy.max_update_norm=null"]))
    s.nodes = {10: NodeInfo(10, 0, "tiny-llama", 1), 11: NodeInfo(11, 1, "tiny-llama", 2),
               12: NodeInfo(12, 2, "tiny-qwen2", 1), 13: NodeInfo(13, 3, "tiny-gemma3", 1)}
    return s


def eval_reply(node_id, loss, base, seconds=0.25):
    metrics = MetricRecord({"eval_loss": loss, "eval_ppl": float(np.exp(loss)), "base_eval_loss": base,
                            "base_eval_ppl": float(np.exp(base)), "seconds": seconds})
    return SimpleNamespace(has_error=lambda: False, content=RecordDict({"metrics": metrics}),
                           metadata=SimpleNamespace(src_node_id=node_id))


# ----------------------------------------------------------------------- evaluate, configure


def test_aggregate_evaluate_fills_each_clients_row_with_its_own_figures(strategy):
    """Replies out of order, one error, one unknown node, one node silent: every row gets
    exactly its node's losses, and bytes_down = train bytes + evaluate bytes sent to it."""
    rows, _ = strategy.aggregate_train(1, [
        reply(10, 0, "tiny-llama", 1, state([[1, 2]], [[1], [0]]), n=1),
        reply(11, 1, "tiny-llama", 2, state([[5, 6], [7, 8]], [[5, 1], [4, 1]]), n=3),
        reply(12, 2, "tiny-qwen2", 1, state([[9, 9]], [[9], [9]]), n=7)], {10: 100, 11: 200, 12: 300})
    strategy.aggregate_evaluate(rows, [
        eval_reply(11, 1.25, 2.5), error_reply(12, "Traceback ...\nRuntimeError: out of memory"),
        eval_reply(10, 0.75, 2.0, seconds=1.5), eval_reply(99, 0.01, 0.01)],
        {10: 7, 11: 8, 12: 9, 13: 10})
    by_pid = {r["partition_id"]: r for r in rows}
    assert [r["partition_id"] for r in rows] == [0, 1, 2, 3]
    assert (by_pid[0]["eval_loss"], by_pid[0]["base_eval_loss"], by_pid[0]["eval_seconds"]) == (0.75, 2.0, 1.5)
    assert (by_pid[1]["eval_loss"], by_pid[1]["base_eval_loss"], by_pid[1]["eval_seconds"]) == (1.25, 2.5, 0.25)
    assert by_pid[0]["eval_ppl"] == pytest.approx(np.exp(0.75))
    assert by_pid[1]["base_eval_ppl"] == pytest.approx(np.exp(2.5))
    assert by_pid[2]["eval_loss"] is None and by_pid[2]["eval_error"] == "RuntimeError: out of memory"
    assert by_pid[3]["eval_loss"] is None and "eval_error" not in by_pid[3]
    assert [by_pid[p]["bytes_down"] for p in range(4)] == [107, 208, 309, 10]
    assert [by_pid[p]["status"] for p in range(4)] == ["ok", "ok", "ok", "failed"]
    assert all(r["eval_loss"] != 0.01 for r in rows)  # node 99 is nobody's


def test_configure_sends_each_node_its_group_round_config_and_adapter(strategy):
    strategy.aggregate_train(1, [
        reply(10, 0, "tiny-llama", 1, state([[1, 0]], [[1], [0]]), n=1),
        reply(11, 1, "tiny-llama", 2, state([[0, 1], [1, 1]], [[0, 1], [1, 0]]), n=1),
        reply(12, 2, "tiny-qwen2", 1, state([[9, 9]], [[9], [9]]), n=7)], {})
    msgs, nbytes = strategy.configure(4, "evaluate")
    assert [m.metadata.dst_node_id for m in msgs] == [10, 11, 12, 13]
    assert all(m.metadata.message_type == "evaluate" for m in msgs)
    for m in msgs:
        node = strategy.nodes[m.metadata.dst_node_id]
        conf = m.content["config"]
        assert (conf["adapter_model"], conf["adapter_rank"], conf["round"]) == (node.model, node.lora_rank, 4)
        assert from_json(str(conf["cfg"])) == strategy.cfg and str(conf["cfg"]) == to_json(strategy.cfg)
        want = strategy.client_state(node)
        if want is None:  # tiny-gemma3 never trained: no adapter, no index, 0 bytes
            assert node.node_id == 13 and "adapter" not in m.content.array_records
            assert "adapter_index" not in conf and nbytes[13] == 0
            continue
        arrays = {k: v.numpy() for k, v in m.content["adapter"].items()}
        got = unpack_adapter(arrays, str(conf["adapter_index"]))
        assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
        assert nbytes[node.node_id] == sum(a.nbytes for a in arrays.values()) + len(str(conf["adapter_index"]).encode())
    # FlexLoRA: each llama client gets the global at its own rank; qwen2 its own group's global
    a = {m.metadata.dst_node_id: m for m in msgs}
    shape = lambda nid: unpack_adapter({k: v.numpy() for k, v in a[nid].content["adapter"].items()},  # noqa: E731
                                       str(a[nid].content["config"]["adapter_index"]))[f"{KEY}.lora_A.weight"].shape
    assert (shape(10), shape(11), shape(12)) == ((1, 2), (2, 2), (1, 2))
    qwen = unpack_adapter({k: v.numpy() for k, v in a[12].content["adapter"].items()},
                          str(a[12].content["config"]["adapter_index"]))
    np.testing.assert_array_equal(qwen[f"{KEY}.lora_B.weight"], [[9], [9]])


# ----------------------------------------------------------------------- node identities


def test_info_is_asked_of_unidentified_nodes_only_and_a_refused_node_again(strategy):
    strategy.nodes = {}
    msgs = strategy.info_messages([101, 102])
    assert [(m.metadata.dst_node_id, m.metadata.message_type) for m in msgs] == [(101, "query.info"),
                                                                               (102, "query.info")]
    conf = msgs[0].content["config"]
    assert conf["round"] == 0 and "adapter_model" not in conf and "adapter" not in msgs[0].content.array_records
    entry = strategy.cfg.federation.clients[0]
    honest = {"partition_id": 0, "model": str(entry.model), "lora_rank": int(entry.lora_rank),
              "public_key": bytes(range(32)), "tokenizer": "abc"}
    errors = strategy.add_info([info_reply(101, honest), error_reply(102, "node lost")])
    assert errors == ["node 102: node lost"]
    assert strategy.nodes[101] == NodeInfo(101, 0, str(entry.model), int(entry.lora_rank), bytes(range(32)), "abc")
    assert [m.metadata.dst_node_id for m in strategy.info_messages([101, 102])] == [102]


def test_clients_of_one_model_with_different_tokenizers_stop_the_run(strategy):
    strategy.nodes = {}
    clients = strategy.cfg.federation.clients
    rec = lambda pid, tok: {"partition_id": pid, "model": str(clients[pid].model),  # noqa: E731
                            "lora_rank": int(clients[pid].lora_rank), "public_key": bytes(32), "tokenizer": tok}
    assert str(clients[0].model) == str(clients[1].model) != str(clients[2].model)
    # same fingerprint within a group, another one in another group: fine
    assert strategy.add_info([info_reply(1, rec(0, "aaaa")), info_reply(3, rec(2, "bbbb"))]) == []
    with pytest.raises(TokenizerMismatchError) as err:
        strategy.add_info([info_reply(2, rec(1, "cccc"))])
    assert str(err.value).startswith(f"partition 1 (node 2) runs {clients[1].model} with tokenizer cccc, "
                                     "partition 0 (node 1) with tokenizer aaaa: clients of one base model "
                                     "must have identical tokenizers")
    assert set(strategy.nodes) == {1, 3}


class InfoGrid(FakeGrid):
    """The fake federation whose query.info replies carry each node's tokenizer fingerprint."""

    def __init__(self, log, fingerprints):
        super().__init__(log)
        self.fingerprints = fingerprints

    def _answer(self, kind, msg):
        content = super()._answer(kind, msg)
        if kind == "query.info":
            content["info"]["tokenizer"] = self.fingerprints[msg.metadata.dst_node_id]
        return content


def test_a_tokenizer_mismatch_in_a_group_refuses_the_run_before_round_1_trains(tmp_path):
    same = tokenizer_fingerprint(tiny_tokenizer())
    ok = InfoGrid([], {n: same for n in CLIENTS})
    assert run_main(tmp_path / "ok", ok, rounds=1)["status"] == "completed"
    log = []
    bad = InfoGrid(log, {**{n: same for n in CLIENTS}, 102: "0123456789abcdef"})  # partition 1, tiny-llama
    with pytest.raises(TokenizerMismatchError, match="partition 1 .* tiny-llama with tokenizer 0123456789abcdef"):
        run_main(tmp_path / "bad", bad, rounds=1)
    assert log == ["query.info"] * 4  # nothing was trained
    res = json.loads((tmp_path / "bad" / "run" / JSON_NAME).read_text())
    assert res["status"] == "failed" and "TokenizerMismatchError" in res["error"] and res["rounds"] == []


def test_the_client_reports_its_tokenizer_fingerprint():
    cfg = compose("tiny")
    content = RecordDict({"config": ConfigRecord({"cfg": to_json(cfg)})})
    msg = Message(content, dst_node_id=1, message_type="query.info")
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 3, "num-partitions": 4},
                      state=RecordDict(), run_config={})
    rec = client_app.info(msg, context).content["info"]
    assert (rec["partition_id"], rec["model"]) == (3, "tiny-gemma3")
    assert rec["tokenizer"] == tokenizer_fingerprint(tiny_tokenizer(chat_template=False, kind="spm"))
    assert bytes(rec["public_key"]) == handlers.prekey(context).public_bytes()
    assert bytes(rec["identity_key"]) == DeviceHome.of(context.node_config).identity().public_bytes()
    verify_signature(bytes(rec["identity_key"]), bytes(rec["prekey_signature"]),
                     prekey_message("device-3", bytes(rec["public_key"]), context.run_id))


def test_a_device_whose_tokens_cannot_meet_the_clouds_on_bytes_is_refused_before_round_1(tmp_path, monkeypatch):
    """The decoding phase's check (each device model against the cloud model), run by the
    ServerApp before it awaits any node: a device tokenizer of another tokenizer is fine (it
    decodes across the vocabularies), one whose tokens cannot be spelled as bytes (a
    word-level vocabulary) is one ConfigError naming the model."""
    import edgefuse.models
    from tests.c2c.test_fusers import CHARS, char_tokenizer

    real = edgefuse.models.load_tokenizer

    def load(name, root=None, allow_fetch=True):
        return char_tokenizer(CHARS) if name == "tiny-llama" else real(name, root, allow_fetch)

    monkeypatch.setattr(edgefuse.models, "load_tokenizer", load)
    over = "c2c=disabled privacy=disabled outputs.save_adapters=false"
    log = []
    with pytest.raises(ConfigError, match="cloud.device_model: 'tiny-llama' cannot decode with 'tiny-qwen2' "
                                          "across tokenizers: cannot map"):
        run_main(tmp_path, FakeGrid(log), overrides=over, rounds=1)
    assert log == []  # not one message sent
    res = json.loads((tmp_path / "run" / JSON_NAME).read_text())
    assert res["status"] == "failed" and res["rounds"] == []


# ----------------------------------------------------------------------- the C2C relay

SECRET = "Quillon Vardebrand of 17 Marrowgate Lane"  # planted in every prompt
DEVICES = {101: (0, "tiny-llama", "llama"), 103: (2, "tiny-qwen2", "qwen2")}


def planted_queries() -> list[Query]:
    out = []
    for i in range(3):
        out.append(Query(f"mmlu/test/planted/{i}", "mmlu", f"Which city does {SECRET} name? (question {i})",
                         "", ["Paris", "Rome", "Oslo", "Lima"], i % 4, None, "planted"))
    for i in range(2):
        out.append(Query(f"dolly/planted/{i}", "dolly", f"Write to {SECRET}.", f"Letter {i}.", None, None,
                         "Dear friend.", "creative_writing"))
    return out


class Device:
    """One in-process device: a tiny model with a random LoRA adapter, its Flower Context."""

    def __init__(self, cfg, node_id):
        pid, self.model_name, arch = DEVICES[node_id]
        model, tok = tiny_model(arch, seed=pid)
        peft = attach_lora(model, rank=4, alpha=16.0, dropout=0.0,
                           target_modules=lora_targets(cfg, self.model_name), seed=pid)
        rng = np.random.default_rng(pid)
        set_adapter_state(peft, {k: (rng.normal(0, 0.05, v.shape).astype(np.float32) if ".lora_B." in k else v)
                                 for k, v in get_adapter_state(peft).items()})
        self.client = SimpleNamespace(entry=SimpleNamespace(model=self.model_name),
                                      slot={"peft": peft, "tok": tok}, cfg=cfg)
        self.context = Context(run_id=1, node_id=node_id, node_config={"partition-id": pid},
                               state=RecordDict(), run_config={})
        info = handlers.signed_prekey(self.context)  # what its query.info tells the server
        self.node = NodeInfo(node_id, pid, self.model_name, 4, info["public_key"], "",
                             info["identity_key"], info["prekey_signature"])


def install_fuser(tmp_path, receiver: Device, sharer: Device, seed: int) -> None:
    """Register a random fuser sharer -> receiver for both sides' current versions and
    install it on the receiver through its query.fusers handler."""
    r_model, s_model = receiver.client.slot["peft"], sharer.client.slot["peft"]
    fcfg = FuserConfig(bottleneck=8, gate_init=1.0)
    torch.manual_seed(seed)
    fuser = C2CFuser(kv_spec_from_config(r_model.config), kv_spec_from_config(s_model.config), fcfg)
    with torch.no_grad():
        for p in fuser.parameters():
            p.add_(0.05 * torch.randn(p.shape))
    version = FuserVersion(handlers.my_version(sharer.client), handlers.my_version(receiver.client),
                           config_hash(fcfg.to_dict()))
    reg = FuserRegistry(tmp_path / f"reg-{seed}")
    reg.save(fuser, fcfg.to_dict(), version, FuserCard.for_version(version, train_steps=1))
    st, config, card = reg.load_state(version)
    packed, index = pack_state(st)
    name = sharer.model_name
    meta = {"card": card.to_json(), "config": config, "index": index,
            "receiver_kv": kv_spec_from_config(r_model.config).to_dict(),
            "sharer_kv": kv_spec_from_config(s_model.config).to_dict()}
    content = RecordDict({"c2c": ConfigRecord({"sharers": [name], f"meta.{name}": json.dumps(meta)}),
                          f"fuser.{name}": ArrayRecord({k: Array(v) for k, v in packed.items()})})
    msg = Message(content=content, metadata=Metadata(
        run_id=1, message_id="", src_node_id=0, dst_node_id=receiver.node.node_id, reply_to_message_id="",
        group_id="", created_at=time.time(), ttl=60.0, message_type="query.fusers"))
    assert handlers.install_fusers(msg, receiver.context, receiver.client)["installed"] == [name]


class RelayGrid:
    """The Grid between the server and the devices: each message goes to the device's real
    handler; ``fail`` = {(node id, message type)} answer with an error. ``sent`` and
    ``replies`` keep every message that passed through the server."""

    HANDLERS = {"query.share": handlers.share, "query.refine": handlers.refine,
                "query.answer": handlers.answer}

    def __init__(self, devices, fail=()):
        self.devices, self.fail = devices, set(fail)
        self.sent, self.replies = [], []

    def send_and_receive(self, messages, *, timeout=None):
        out = []
        for msg in messages:
            self.sent.append(msg)
            dst, kind = msg.metadata.dst_node_id, msg.metadata.message_type
            dev = self.devices[dst]
            try:
                if (dst, kind) in self.fail:
                    raise RuntimeError("the device went away")
                rep = Message(self.HANDLERS[kind](msg, dev.context, dev.client), reply_to=msg)
            except Exception as ex:  # as Flower's runtime reports a ClientApp exception
                rep = Message(Error(code=2, reason=f"{type(ex)}:<'{ex}'>"), reply_to=msg)
            self.replies.append(rep)
            out.append(rep)
        return out


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module on one torch thread (see conftest)."""


@pytest.fixture(scope="module")
def relay_cfg():
    return compose("tiny", ["c2c.eval.batch_queries=2", "c2c.eval.modes=[alone,t2t,c2c,co_c2c]",
                            "c2c.eval.max_new_tokens=2"])


@pytest.fixture(scope="module")
def devices(relay_cfg, tmp_path_factory):
    devs = {n: Device(relay_cfg, n) for n in DEVICES}
    tmp = tmp_path_factory.mktemp("fusers")
    install_fuser(tmp, devs[101], devs[103], seed=1)  # qwen2 -> llama
    install_fuser(tmp, devs[103], devs[101], seed=2)  # llama -> qwen2
    return devs


def relay_phase(cfg, devices, grid, tmp_path, monkeypatch) -> C2C:
    """The C2C phase as the ServerApp holds it after the fusers went out (both pairs)."""
    monkeypatch.setattr(c2c_phase, "load_queries", lambda cfg: planted_queries())
    monkeypatch.setattr(handlers, "_T2T", {})  # no T2T answers cached from another test
    strategy = GroupedLoRA(cfg)
    strategy.nodes = {n: d.node for n, d in devices.items()}
    phase = C2C()
    phase.ctx = PhaseContext(cfg=cfg, grid=grid, strategy=strategy, out=tmp_path, timeout=5.0,
                             recorder=None, last_round=1, round=1)
    phase.cfg, phase.strategy = cfg, strategy
    phase.reps = {d.model_name: d.node for d in devices.values()}
    phase.pairs = [("tiny-qwen2", "tiny-llama"), ("tiny-llama", "tiny-qwen2")]
    phase.gates = {}
    phase.wan = WanLink(WanProfile.from_name("none"))
    return phase


def queries_of(msg) -> list[str]:
    return [q["qid"] for q in json.loads(str(msg.content["c2c"]["queries"]))]


def test_queries_travel_in_chunks_of_batch_queries(relay_cfg, devices, tmp_path, monkeypatch):
    grid = RelayGrid(devices)
    rows = relay_phase(relay_cfg, devices, grid, tmp_path, monkeypatch).evaluate()
    qids = [q.qid for q in planted_queries()]
    chunks = [qids[0:2], qids[2:4], qids[4:5]]
    assert [(r["receiver"], r["mode"]) for r in rows] == [
        (r, m) for r in ("tiny-llama", "tiny-qwen2") for m in ("alone", "t2t", "c2c", "co_c2c")]
    assert all(r["n"] == 5 and r["n_mmlu"] == 3 and r["n_dolly"] == 2 and "error" not in r for r in rows)
    answers = [m for m in grid.sent if m.metadata.message_type == "query.answer"]
    assert len(answers) == 8 * 3 and [queries_of(m) for m in answers] == chunks * 8
    # per receiver and mode: t2t and c2c ask the sharer once per chunk, co_c2c the receiver
    # (share) then the sharer (refine) once per chunk
    kinds = [(m.metadata.message_type, m.metadata.dst_node_id) for m in grid.sent]
    llama = kinds[:kinds.index(("query.answer", 103))]
    share_q, ans_l, ref_q, share_l = (("query.share", 103), ("query.answer", 101), ("query.refine", 103),
                                      ("query.share", 101))
    assert llama == ([ans_l] * 3 + [share_q, ans_l] * 3 + [share_q, ans_l] * 3
                     + [share_l, ref_q, ans_l] * 3)
    for m in answers:  # one sealed frame per query of the chunk
        conf = m.content["c2c"]
        for i in range(len(conf["sharers"])):
            assert len(list(conf[f"frames.{i}_lengths"])) == len(queries_of(m))


def test_one_failing_receiver_gets_error_rows_and_the_others_go_on(relay_cfg, devices, tmp_path, monkeypatch):
    cfg = relay_cfg.copy()
    cfg.c2c.eval.modes = ["alone", "c2c"]
    grid = RelayGrid(devices, fail={(103, "query.answer")})
    rows = relay_phase(cfg, devices, grid, tmp_path, monkeypatch).evaluate()
    by = {(r["receiver"], r["mode"]): r for r in rows}
    assert len(rows) == 4
    for mode in ("alone", "c2c"):
        bad, good = by[("tiny-qwen2", mode)], by[("tiny-llama", mode)]
        assert bad["n"] == 0 and bad["mmlu_acc"] is None and bad["latency_ms"] is None
        assert bad["error"].startswith("partition 2 (tiny-qwen2, node 103) query.answer: ")
        assert "the device went away" in bad["error"]
        assert good["n"] == 5 and "error" not in good and good["mmlu_acc"] is not None
    # the failing receiver was asked once per mode (its first chunk), then the next mode began
    asked = [m for m in grid.sent if (m.metadata.message_type, m.metadata.dst_node_id) == ("query.answer", 103)]
    assert len(asked) == 2


def all_bytes(content: RecordDict) -> list[bytes]:
    """Every value of every record of a message, as bytes."""
    out = []
    for rec in content.array_records.values():
        out += [arr.numpy().tobytes() for arr in rec.values()]
    for rec in list(content.config_records.values()) + list(content.metric_records.values()):
        for v in rec.values():
            for x in (v if isinstance(v, list) else [v]):
                out.append(bytes(x) if isinstance(x, bytes) else str(x).encode())
    return out


def test_the_server_relays_ciphertext_only(relay_cfg, devices, tmp_path, monkeypatch):
    """Every payload a device seals is recorded in plaintext as it is built; nothing the
    devices send the server, and no frame the server forwards, holds the planted prompt text,
    a payload's header or 16 bytes of a KV payload's body."""
    plaintexts = []
    real = peer.encode_payload

    def record(kind, qid, sender, body):
        data = real(kind, qid, sender, body)
        plaintexts.append(data)
        return data

    monkeypatch.setattr(peer, "encode_payload", record)
    grid = RelayGrid(devices)
    rows = relay_phase(relay_cfg, devices, grid, tmp_path, monkeypatch).evaluate()
    assert all("error" not in r for r in rows)
    kv = [p for p in plaintexts if json.loads(p[8:8 + int.from_bytes(p[4:8], "little")])["kind"] == "kv"]
    assert len(kv) == 2 * (5 + 10) and len(plaintexts) > len(kv)  # c2c: 5, co_c2c: 10 per receiver; t2t text
    relayed = [b for rep in grid.replies for b in all_bytes(rep.content)]  # devices -> server
    relayed += [arr.numpy().tobytes() for m in grid.sent if m.metadata.message_type == "query.answer"
                for name, rec in m.content.array_records.items() if name.startswith("frames")
                for arr in rec.values()]  # server -> receiver
    blob = b"\x00".join(relayed)
    assert len(blob) > sum(map(len, kv))  # the frames are in there
    assert SECRET.encode() not in blob
    for magic in (b"EFP1", b"EKV1"):  # peer payload, KV blob
        assert magic not in blob, f"{magic!r} relayed in the clear"
    # each header whole (its query id alone is the server's own); 8 windows of each KV body
    # (a T2T body is the sharer's greedy answer, which that device reports in mode alone too)
    for p in plaintexts:
        n = 8 + int.from_bytes(p[4:8], "little")
        body = p[n:] if p in kv else b""
        windows = [p[8:n]] + [body[i:i + 16] for i in range(0, len(body) - 15, max(len(body) // 8, 1))]
        hit = next((w for w in windows if w in blob), None)
        assert hit is None, f"{len(p)}-byte plaintext relayed in the clear: {hit!r}"
    # what the server forwards is what a device sealed, byte for byte
    def frames(msgs, kinds):
        return [a.numpy().tobytes() for m in msgs if m.metadata.message_type in kinds
                for name, rec in m.content.array_records.items() if name.startswith("frames")
                for a in rec.values()]

    sealed = set(frames([r for r in grid.replies if not r.has_error()], ("query.share", "query.refine")))
    forwarded = frames(grid.sent, ("query.answer", "query.refine"))
    assert forwarded and set(forwarded) <= sealed
