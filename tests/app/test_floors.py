"""Device privacy floors in the real ClientApp (edgefuse.app.client_app, edgefuse.app.device).

The attack: a server sends a message whose resolved config loosens the device's privacy
(protection off, raw text in results, a cloud that keeps everything, a cloud or a peer the
device never agreed to). The device is partition 2 of the tiny federation (tiny-qwen2); its
floor is ``floors.yaml`` in its own home. Each looser config is refused with an error reply
naming the field, and nothing was sent: a listening socket given as the "cloud" sees no
connection, the outbound audit saw no payload, no model was loaded. A tighter config is
accepted and decoded end to end through a real in-process cloud service (the positive
control that shows the socket and audit checks would notice). The floor comes from the
device's home, never from ``paths.cache_dir`` of the server's config.
"""

import inspect
import json
import shutil
import socket
import time
from types import SimpleNamespace

import pytest
from flwr.app import ConfigRecord, Context, Error, Message, RecordDict

from edgefuse.app import client_app
from edgefuse.app.handlers import decoding as decoding_handler
from edgefuse.app.handlers.local import LocalClient
from edgefuse.config import client_entry, compose, lora_targets, to_json
from edgefuse.lora import attach_lora, get_adapter_state, set_adapter_state
from edgefuse.models import tiny_model
from edgefuse.privacy.audit import AUDIT
from edgefuse.transport.identity import device_dir
from tests.app.test_phases import server_identity  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("server_identity")
PID = 2  # tiny-qwen2, rank 4 in experiment=tiny
SECRET = "Quillon Vardebrand, quillon.vardebrand@example.org"


class Listener:
    """A TCP socket posing as the cloud: it must see no connection when a message is refused."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]

    def connections(self, wait: float = 0.3) -> int:
        self.sock.settimeout(wait)
        n = 0
        while True:
            try:
                conn, _ = self.sock.accept()
            except (socket.timeout, BlockingIOError):
                return n
            conn.close()
            n += 1

    def close(self):
        self.sock.close()


@pytest.fixture
def listener():
    ls = Listener()
    yield ls
    ls.close()


@pytest.fixture
def loads(monkeypatch):
    """LocalClient.load is recorded (and fails the test if called where it must not be)."""
    calls = []
    monkeypatch.setattr(LocalClient, "load", classmethod(lambda cls, *a: calls.append(a) or pytest.fail(
        "a model was loaded for a refused message")))
    return calls


def home_with(tmp_path, text: str | None):
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    if text is not None:
        (home / "floors.yaml").write_text(text)
    return home


def node_config(home=None, **extra) -> dict:
    conf = {"partition-id": PID, "num-partitions": 4, **extra}
    if home is not None:
        conf["device-dir"] = str(home)
    return conf


def message(cfg, kind: str, port: int | None = None) -> Message:
    """What the server sends node 2: the config with the node's group, and for query.decode
    the cloud's address and a prompt with private text."""
    content = RecordDict({"config": ConfigRecord({"cfg": to_json(cfg), "round": 1,
                                                  "adapter_model": "tiny-qwen2", "adapter_rank": 4})})
    if kind == "query.decode":
        q = {"qid": "dolly/0", "kind": "dolly", "instruction": f"Write to {SECRET} about the fox.",
             "context": "", "choices": None, "answer": None, "reference": "", "category": "c"}
        content["cloud"] = ConfigRecord({"host": "127.0.0.1", "port": int(port), "queries": json.dumps([q])})
    if kind in ("query.share", "query.refine"):
        content["c2c"] = ConfigRecord({"queries": "[]", "kind": "kv", "peer_model": "tiny-llama",
                                       "peer_public_key": bytes(32), "session_id": "00" * 16})
    return Message(content, dst_node_id=7, message_type=kind)


def ask(msg: Message, conf: dict) -> Message:
    """The real ClientApp on ``msg``; an exception becomes an error reply, as in Flower."""
    context = Context(run_id=1, node_id=7, node_config=conf, state=RecordDict(), run_config={})
    AUDIT.snapshot(reset=True)
    try:
        return client_app.app(msg, context)
    except Exception as ex:  # noqa: BLE001 - what Flower's runtime does
        return Message(Error(code=2, reason=f"{type(ex)}:<'{ex}'>"), reply_to=msg)


def assert_refused_and_silent(reply: Message, listener: Listener, loads: list, *needles: str) -> str:
    assert reply.has_error(), "the message was accepted"
    reason = reply.error.reason
    assert "FloorViolation" in reason or "FloorError" in reason, reason
    for needle in needles:
        assert needle in reason, reason
    assert listener.connections() == 0  # no cloud connection was attempted
    assert AUDIT.snapshot() == {}  # no payload passed the outbound audit
    assert loads == []
    return reason


def test_the_listener_counts_a_connection(listener):
    """The control for "no cloud connection was attempted": one connection is counted."""
    with socket.create_connection(("127.0.0.1", listener.port), timeout=5):
        assert listener.connections() == 1


LOOSER = [  # (server overrides, floors.yaml or None = no file, what the refusal names)
    (["privacy.protection=off"], None,
     ["query.decode refused", "protection: the server's privacy.protection='off' is looser than this "
      "device's floor protection='redact' (from default (no {floors}))"]),
    (["privacy=disabled"], "protection: redact\n",
     ["protection: the server's privacy.enabled=false (protection 'off') is looser", "(from {floors})"]),
    ([f"+federation.clients.{PID}.protection=redact"], "protection: both\n",
     [f"protection: the server's federation.clients.{PID}.protection='redact' is looser than this "
      "device's floor protection='both' (from {floors})"]),
    (["privacy.debug_text=true"], "debug_text: false\n",
     ["debug_text: the server's privacy.debug_text=true is looser than this device's floor "
      "debug_text=false (from {floors})"]),
    (["privacy.cloud_auth.flag_cache=true"], "cloud_cache: {flag_cache: false}\n",
     ["cloud_cache: the server's privacy.cloud_auth.flag_cache=true is looser than this device's "
      "floor flag_cache=false (from {floors})"]),
    (["privacy.cloud_auth.l_cache=512"], "cloud_cache: {l_cache: 64}\n",
     ["cloud_cache: the server's privacy.cloud_auth.l_cache=512 is looser than this device's floor "
      "l_cache=64 (from {floors})"]),
    (["privacy.redact.entities=[URL]", "privacy.redact.known_identities=false"], None,  # "redact" that redacts nothing
     ["protection: the server's privacy.redact.entities leaves out PERSON, EMAIL_ADDRESS",
      "protection: the server's privacy.redact.known_identities=false is looser than this device's floor "
      "redact.known_identities=true (from default (no {floors}))"]),
    (["cloud=disabled"], "cloud: false\n",  # the config says no cloud, the message still asks
     ["cloud: the server's message contacts the cloud, looser than this device's floor cloud=false "
      "(from {floors})"]),
]


@pytest.mark.parametrize("over,floor_text,needles", LOOSER)
def test_a_decode_request_looser_than_the_floor_is_refused_and_nothing_leaves(
        tmp_path, listener, loads, over, floor_text, needles):
    home = home_with(tmp_path, floor_text)
    floors = home / "floors.yaml"
    cfg = compose("tiny", over)
    reply = ask(message(cfg, "query.decode", listener.port), node_config(home))
    assert_refused_and_silent(reply, listener, loads, *[n.format(floors=floors) for n in needles])


@pytest.mark.parametrize("kind", ["query.share", "query.refine"])
def test_c2c_sharing_refused_by_a_floor_without_it(tmp_path, listener, loads, kind):
    home = home_with(tmp_path, "c2c_share: false\n")
    reply = ask(message(compose("tiny"), kind), node_config(home))
    assert_refused_and_silent(reply, listener, loads, f"{kind} refused: ", "c2c_share: the server's message "
                              f"shares with a peer, looser than this device's floor c2c_share=false "
                              f"(from {home / 'floors.yaml'})")


@pytest.mark.parametrize("kind", ["train", "evaluate", "query.fusers", "query.answer", "query.privacy"])
def test_raw_text_in_results_refused_on_every_message(tmp_path, listener, loads, kind):
    reply = ask(message(compose("tiny", ["privacy.debug_text=true"]), kind), node_config(home_with(tmp_path, None)))
    assert_refused_and_silent(reply, listener, loads, f"{kind} refused: ", "debug_text: the server's "
                              "privacy.debug_text=true is looser than this device's floor debug_text=false")


def test_train_and_probe_are_not_refused_for_fields_they_do_not_use(tmp_path, monkeypatch):
    """A floor that forbids the cloud and sharing does not stop training or the (offline)
    probe: only the fields a message type uses are checked; the handler runs."""
    home = home_with(tmp_path, "cloud: false\nc2c_share: false\nprotection: both\n")
    reached = []

    def load(cls, *args):
        reached.append(args)
        raise RuntimeError("handler reached")

    monkeypatch.setattr(LocalClient, "load", classmethod(load))
    for kind in ("train", "query.privacy"):
        reply = ask(message(compose("tiny", ["privacy=disabled"]), kind), node_config(home))
        assert "handler reached" in reply.error.reason and "Floor" not in reply.error.reason
    assert len(reached) == 2


def test_the_floor_is_read_from_the_device_home_not_the_servers_cache_dir(tmp_path, listener, loads, monkeypatch):
    """The server points paths.cache_dir at a folder holding a permissive floors.yaml (at the
    home path a device would have under it, and at its top): the device still reads its own."""
    evil = tmp_path / "server-chosen"
    for d in (evil, evil / "identity" / "devices" / f"partition-{PID}", device_dir(evil / "identity", PID)):
        d.mkdir(parents=True, exist_ok=True)
        (d / "floors.yaml").write_text("protection: off\ndebug_text: true\n")
    cfg = compose("tiny", ["privacy.protection=redact", f"paths.cache_dir={evil}"])
    # 1. a deployed device: device-dir in its own node_config
    home = home_with(tmp_path, "protection: both\n")
    reply = ask(message(cfg, "query.decode", listener.port), node_config(home))
    assert_refused_and_silent(reply, listener, loads, f"floor protection='both' (from {home / 'floors.yaml'})")
    # 2. the simulation's home under the operator's keys root ($EDGEFUSE_KEYS)
    keys = tmp_path / "keys"
    monkeypatch.setenv("EDGEFUSE_KEYS", str(keys))
    sim_home = device_dir(keys.resolve(), PID)
    sim_home.mkdir(parents=True)
    (sim_home / "floors.yaml").write_text("protection: both\n")
    reply = ask(message(cfg, "query.decode", listener.port), node_config())
    reason = assert_refused_and_silent(reply, listener, loads, f"(from {sim_home / 'floors.yaml'})")
    assert str(evil) not in reason


def test_node_config_floor_keys(tmp_path, listener, loads):
    home = home_with(tmp_path, "protection: off\n")
    reply = ask(message(compose("tiny", ["privacy=disabled"]), "query.decode", listener.port),
                node_config(home, **{"floor-protection": "redact"}))
    assert_refused_and_silent(reply, listener, loads, "floor protection='redact' (from node_config floor-protection)")


@pytest.mark.parametrize("text,needle", [
    ("protection: [both\n", "not valid YAML"),
    ("protection: most\n", "protection: expected one of off, redact, rephrase, both, got 'most'"),
    ("cloud_cache: {keep: everything}\n", "cloud_cache: unknown keys 'keep'; known: flag_cache, l_cache"),
])
def test_a_malformed_floor_file_refuses_every_message(tmp_path, listener, loads, text, needle):
    home = home_with(tmp_path, text)
    for kind in ("query.decode", "train"):
        reply = ask(message(compose("tiny"), kind, listener.port), node_config(home))
        assert_refused_and_silent(reply, listener, loads, f"{kind} refused: this device's privacy floor is "
                                  f"unreadable: {home / 'floors.yaml'}: ", needle)


# ----------------------------------------------------------------------------- accepted


def provisioned_home(tmp_path, floor_text: str):
    """A device home holding provisioned partition 2's identity and trust store (the cloud
    pinned) and ``floor_text`` as its floors.yaml."""
    from edgefuse.app.device import keys_root
    from edgefuse.transport.identity import IDENTITY_FILE, TRUST_FILE

    home = home_with(tmp_path, floor_text)
    for name in (IDENTITY_FILE, TRUST_FILE):
        shutil.copy2(device_dir(keys_root(), PID) / name, home / name)
    return home


def cloud_service(target, tok):
    """An in-process cloud service with the provisioned cloud keys (where the service takes them)."""
    from edgefuse.app.device import keys_root
    from edgefuse.cloud.service import CloudService
    from edgefuse.cloud.target import Target
    from edgefuse.transport.identity import AUTHORIZED_FILE, IDENTITY_FILE, TrustStore, cloud_dir, load_identity

    kw = {}
    if "identity" in inspect.signature(CloudService).parameters:
        root = cloud_dir(keys_root())
        kw = {"identity": load_identity(root / IDENTITY_FILE), "authorized": TrustStore.load(root / AUTHORIZED_FILE)}
    return CloudService(Target(target, tok, "tiny-target"), "127.0.0.1", 0, max_wait_ms=5, **kw)


def _device(cfg):
    model, tok = tiny_model("qwen2", seed=0)
    peft = attach_lora(model, rank=4, alpha=16.0, dropout=0.0, target_modules=lora_targets(cfg, "tiny-qwen2"),
                       seed=0)
    init = get_adapter_state(peft)
    return SimpleNamespace(cfg=cfg, entry=client_entry(cfg, PID), slot={"peft": peft, "tok": tok, "init": init},
                           reset_adapter=lambda: set_adapter_state(peft, init))


@pytest.mark.parametrize("over,floor_text", [
    # tighter than the floor on every field: used as it is
    (["privacy.protection=both", "privacy.cloud_auth.flag_cache=false", "privacy.cloud_auth.l_cache=32"],
     "protection: redact\ncloud_cache: {flag_cache: true, l_cache: 64}\n"),
    # a device that opted out of protection accepts plain text (the control: the same socket
    # and audit checks see the traffic)
    (["privacy=disabled"], "protection: off\n"),
])
def test_a_tighter_config_is_accepted_and_decoded_through_the_cloud(tmp_path, monkeypatch, one_thread, mirror,
                                                                    over, floor_text):
    cfg = compose("tiny", [*over, "cloud.modes=[cloud]", "cloud.devices=1", "cloud.decode.drafter=ngram",
                           f"data.mirror={mirror}", f"paths.cache_dir={tmp_path / 'cache'}"])
    client = _device(cfg)
    monkeypatch.setattr(LocalClient, "load", classmethod(lambda cls, *a: client))
    seen = []
    real = decoding_handler.decode
    monkeypatch.setattr(decoding_handler, "decode", lambda m, c, cl: seen.append(cl.cfg) or real(m, c, cl))
    target, tok = tiny_model("qwen2", seed=1)
    svc = cloud_service(target, tok)
    svc.start_in_thread()
    try:
        t0 = time.time()
        reply = ask(message(cfg, "query.decode", svc.port), node_config(provisioned_home(tmp_path, floor_text)))
    finally:
        svc.stop()
    assert not reply.has_error(), reply.error.reason
    assert seen and seen[0] is cfg  # the server's (stricter) config, as it was sent
    dec = reply.content["decoding"]
    records = json.loads(str(dec["records"]))
    assert [r["mode"] for r in records] == ["cloud"] and records[0]["qid"] == "dolly/0"
    assert str(dec["protection"]) == ("both" if "privacy.protection=both" in over else "off")
    stats = json.loads(str(reply.content["privacy_audit"]["stats"]))
    assert stats["draft_tokens"]["payloads"] > 0  # the cloud frames passed the audit
    if "privacy.protection=both" in over:  # the live canary went too, under the accepted protection
        assert cfg.privacy.probe.live_canaries == 1 and stats["draft_tokens"]["canary_hits"] == 0
    assert time.time() - t0 < 300


def test_a_message_type_without_its_own_entry_is_checked_on_every_field(tmp_path):
    """A message type FLOOR_CHECKS does not list (a future query) is checked on every field
    and counts as using the cloud and a peer: the check fails closed."""
    from edgefuse.app.device import FLOOR_CHECKS, check_floor
    from edgefuse.privacy.floors import FloorViolation

    assert "query.future" not in FLOOR_CHECKS
    cfg = compose("tiny", ["cloud=disabled", "c2c=disabled"])
    home = home_with(tmp_path, "cloud: false\nc2c_share: false\n")
    with pytest.raises(FloorViolation) as err:
        check_floor(cfg, client_entry(cfg, PID), node_config(home), "query.future")
    assert str(err.value).startswith("query.future refused: ")
    assert "cloud: the server's message contacts the cloud" in str(err.value)
    assert "c2c_share: the server's message shares with a peer" in str(err.value)
    # the same config as a train message: only debug_text, which passes
    assert check_floor(cfg, client_entry(cfg, PID), node_config(home), "train").cloud is False
