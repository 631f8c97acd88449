"""The authenticated device <-> cloud channel (SIGMA-I, edgefuse.cloud.wire), attacked.

Every test runs the attack over real sockets against a real in-process service (tiny random
qwen2 target) and a real CloudLink or a hand-written device end: a man in the middle that
re-handshakes with both sides, a relay that swaps only the cloud's signature, identity or
ephemeral key, one that flips a byte of a later frame, an unregistered device, a device that
skips IDENTIFY, a replayed IDENTIFY, and a flood of unauthenticated connections."""

from __future__ import annotations

import socket
import threading
import time

import pytest

import edgefuse.cloud.protocol as P
from edgefuse.cloud import wire
from edgefuse.cloud.link import CloudLink, CloudUnavailable
from edgefuse.cloud.service import CloudService
from edgefuse.cloud.target import Target, tokenizer_fingerprint
from edgefuse.models import tiny_model
from edgefuse.transport.crypto import derive_session, generate_keypair, new_session_id
from edgefuse.transport.identity import (CLOUD, Identity, TrustStore, UntrustedPeerError,
                                         fingerprint)
from tests.cloud.conftest import RawClient, TcpRelay, device_keys, service_keys, wait_for

PROMPT = [5, 17, 33, 60, 91]


@pytest.fixture(scope="module")
def tiny():
    target, tok = tiny_model("qwen2", seed=1)
    return target, tok, tokenizer_fingerprint(tok)


@pytest.fixture
def svc(start_service, tiny):
    target, tok, _ = tiny
    return start_service(target, tok, max_wait_ms=2)


def closed_by_peer(sock: socket.socket, timeout_s: float = 10.0) -> bool:
    sock.settimeout(timeout_s)
    try:
        while True:
            if not sock.recv(65536):
                return True
    except ConnectionResetError:
        return True
    except OSError:
        return False


class MessageRelay(TcpRelay):
    """A TCP relay between one device and ``port`` that forwards framed messages, passing each
    through ``transform(direction, index, body) -> body`` ("up" = device -> cloud; index
    counts per direction from 0, the handshake included) and recording what it forwarded."""

    def __init__(self, port: int, transform=None):
        self.transform = transform or (lambda d, i, b: b)
        self.seen = {"up": [], "down": []}
        super().__init__(port)

    def _pump(self, src, dst, d):
        try:
            while True:
                body = wire.recv_message(src)
                self.seen[d].append(body)
                dst.sendall(wire.frame(self.transform(d, len(self.seen[d]) - 1, body)))
        except (OSError, wire.PeerClosed):
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class ManInTheMiddle:
    """An active attacker with its own identity: it answers the device as if it were the
    cloud (its own ephemeral key and identity, a valid signature by its own key) and opens
    its own authenticated-looking connection to the real cloud with its own device key."""

    def __init__(self, cloud_port: int):
        self.identity = Identity.generate()
        self.cloud_port = cloud_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.after_welcome: list[bytes] = []
        self.cloud_answer = None
        self.done = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        dev, _ = self.listener.accept()
        dev.settimeout(10)
        try:
            hello = wire.recv_message(dev)
            # toward the cloud: its own hello and its own IDENTIFY
            up = socket.create_connection(("127.0.0.1", self.cloud_port), timeout=10)
            own, sid = generate_keypair(), new_session_id()
            h2 = wire.encode_hello(own.public_bytes(), sid)
            wire.send_message(up, h2)
            welcome = wire.recv_message(up)
            eph, _, _ = wire.decode_signed_welcome(welcome)
            th = wire.session_transcript(h2, welcome)
            sec = derive_session(own, eph, sid, initiator=True, transcript=th)
            wire.send_message(up, sec.seal(P.encode(wire.make_identify(self.identity, th))))
            try:
                self.cloud_answer = P.decode(sec.open(wire.recv_message(up)))
            except (OSError, wire.PeerClosed) as exc:
                self.cloud_answer = exc
            # toward the device: a welcome signed by the attacker's own identity
            mine = generate_keypair()
            wire.send_message(dev, wire.encode_signed_welcome(self.identity, hello, mine.public_bytes()))
            try:
                while True:
                    self.after_welcome.append(wire.recv_message(dev))
            except (OSError, wire.PeerClosed):
                pass
        finally:
            self.done.set()


# ------------------------------------------------------------------ the device refuses

def test_man_in_the_middle_with_its_own_keys_is_refused_by_the_device(svc):
    mitm = ManInTheMiddle(svc.port)
    keys = device_keys()
    pinned = keys["trust"].get(CLOUD)
    with pytest.raises(UntrustedPeerError) as err:
        CloudLink.connect("127.0.0.1", mitm.port, **keys)
    msg = str(err.value)
    assert fingerprint(mitm.identity.public_bytes()) in msg and fingerprint(pinned) in msg
    assert mitm.done.wait(10)
    assert mitm.after_welcome == []  # the device closed before sealing anything
    # and the cloud refused the attacker's own device key
    assert isinstance(mitm.cloud_answer, P.Error) and mitm.cloud_answer.code == "unauthorized"
    assert "not an authorized device" in mitm.cloud_answer.message
    wait_for(lambda: svc.stats()["auth_failures"] == 1, what="the attacker's IDENTIFY refused")
    assert svc.stats()["sessions_open"] == 0 and svc.stats()["devices_authenticated"] == 0


def _swap(part: str, attacker: Identity):
    """A WELCOME transform: replace one field (the rest passes through)."""
    def transform(d, i, body):
        if d != "down" or i != 0:
            return body
        eph, pub, sig = wire.decode_signed_welcome(body)
        if part == "signature":  # the attacker's own signature over the same transcript
            sig = attacker.sign(wire.SIGN_CONTEXT_CLOUD + wire.welcome_transcript(
                transform.hello, eph, pub))
        elif part == "flipped-signature":
            sig = sig[:10] + bytes([sig[10] ^ 1]) + sig[11:]
        elif part == "identity":
            pub = attacker.public_bytes()
        elif part == "ephemeral":  # its own DH key under the cloud's signature
            eph = generate_keypair().public_bytes()
        return P.MAGIC_WELCOME + eph + pub + sig
    return transform


@pytest.mark.parametrize("part,match", [("signature", "does not verify"),
                                        ("flipped-signature", "does not verify"),
                                        ("identity", "is pinned"),
                                        ("ephemeral", "does not verify")])
def test_relay_swapping_one_welcome_field_is_refused(svc, part, match):
    attacker = Identity.generate()
    transform = _swap(part, attacker)
    relay = MessageRelay(svc.port, lambda d, i, b: (setattr(transform, "hello", b) or b)
                         if (d, i) == ("up", 0) else transform(d, i, b))
    with pytest.raises(UntrustedPeerError, match=match) as err:
        CloudLink.connect("127.0.0.1", relay.port, **device_keys())
    assert "cloud" in str(err.value)
    time.sleep(0.2)
    assert len(relay.seen["up"]) == 1  # the hello only: no IDENTIFY, no OPEN left the device
    assert svc.stats()["devices_authenticated"] == 0


@pytest.mark.parametrize("direction", ["up", "down"])
def test_relay_flipping_a_byte_of_a_later_frame_gets_it_rejected(svc, tiny, direction):
    _, _, fp = tiny
    first_sealed = 2 if direction == "up" else 1  # up: hello, IDENTIFY, OPEN; down: welcome, OPENED

    def flip(d, i, body):
        if d == direction and i == first_sealed:
            return body[:20] + bytes([body[20] ^ 0x01]) + body[21:]
        return body
    relay = MessageRelay(svc.port, flip)
    before = svc.stats()["frames_rejected"]
    link = CloudLink.connect("127.0.0.1", relay.port, **device_keys())
    try:
        assert link.authenticated and link.cloud_identity == device_keys()["trust"].get(CLOUD)
        with pytest.raises(TimeoutError):  # the altered frame is dropped, not answered
            link.open(PROMPT, fp, timeout_s=1.5)
        if direction == "up":
            assert svc.stats()["frames_rejected"] - before == 1 and link.frames_rejected == 0
        else:
            assert link.frames_rejected == 1 and svc.stats()["frames_rejected"] == before
        # the next genuine frame shows the gap: the stream can never line up again, so the
        # connection ends at once with a reason (the device falls back, not waits), and the
        # cloud frees the session
        with pytest.raises((P.RemoteError, ConnectionError)) as err:
            link.open(PROMPT, fp, timeout_s=10)
        if direction == "up":
            assert isinstance(err.value, P.RemoteError) and err.value.code == "integrity"
            assert svc.stats()["integrity_closes"] == 1
        else:
            assert "altered or dropped in transit" in str(err.value)
        wait_for(lambda: not link.alive, what="the connection ends")
        wait_for(lambda: svc.stats()["sessions_open"] == 0, what="the cloud frees the session")
    finally:
        link.close()
    assert svc.stats()["devices_authenticated"] == 1  # the handshake itself went through


# ------------------------------------------------------------------ the cloud refuses

def _foreign_device_keys() -> dict:
    """A valid identity the cloud has never authorized, trusting the real cloud."""
    trust = TrustStore({CLOUD: device_keys()["trust"].get(CLOUD)})
    return {"identity": Identity.generate(), "trust": trust}


def test_unregistered_device_gets_unauthorized_and_cannot_open(svc, tiny):
    _, _, fp = tiny
    keys = _foreign_device_keys()
    link = CloudLink.connect("127.0.0.1", svc.port, **keys)  # the cloud checks out ...
    with pytest.raises(P.RemoteError) as err:  # ... but the device is not served
        link.open(PROMPT, fp, timeout_s=10)
    assert err.value.code == "unauthorized"
    assert fingerprint(keys["identity"].public_bytes()) in err.value.message
    wait_for(lambda: not link.alive, what="the cloud closes the connection")
    link.close()
    s = svc.stats()
    assert s["auth_failures"] == 1 and s["sessions_total"] == 0 and s["devices_authenticated"] == 0
    # a provisioned device is served by the same service
    with CloudLink.connect("127.0.0.1", svc.port, **device_keys(3)) as ok:
        assert ok.open(PROMPT, fp, timeout_s=10).fingerprint == fp
    assert svc.stats()["devices_authenticated"] == 1


def test_device_that_skips_identify_and_sends_open_is_refused(svc, tiny):
    _, _, fp = tiny
    raw = RawClient(svc.port, identify=False)
    raw.send(P.Open(PROMPT, fp))
    err = raw.recv()
    assert isinstance(err, P.Error) and err.code == "unauthorized"
    assert "OPEN before IDENTIFY" in err.message
    assert closed_by_peer(raw.sock)
    assert svc.stats()["sessions_total"] == 0 and svc.stats()["auth_failures"] == 1


def test_replayed_identify_from_another_connection_is_refused(svc, tiny):
    _, _, fp = tiny
    ident = device_keys()["identity"]
    first = RawClient(svc.port, identify=False)
    recorded = wire.make_identify(ident, first.th)
    recorded_frame = first.seal(recorded)  # what an observer of the first connection saw
    first.send_frame(recorded_frame)
    first.send(P.Open(PROMPT, fp))
    assert isinstance(first.recv(), P.Opened)
    # its IDENTIFY, re-sealed on a second connection: the transcript differs
    second = RawClient(svc.port, identify=False)
    second.send(recorded)
    err = second.recv()
    assert err.code == "unauthorized" and "does not verify" in err.message
    assert closed_by_peer(second.sock)
    # its sealed frame replayed as is on a third: it does not even open there
    third = RawClient(svc.port, identify=False)
    third.send_frame(recorded_frame)
    assert closed_by_peer(third.sock)
    s = svc.stats()
    assert s["auth_failures"] == 2 and s["devices_authenticated"] == 1 and s["sessions_total"] == 1
    first.close()


def test_unauthenticated_connections_take_no_session_slot_and_time_out(start_service, tiny):
    target, tok, fp = tiny
    svc = start_service(target, tok, max_sessions=2, max_connections=16, max_handshakes=8,
                        handshake_timeout_s=1.5, max_wait_ms=2)
    t0 = time.monotonic()
    # 6 connections that never authenticate (more than max_sessions): 3 stop after the
    # welcome, 3 send nothing
    lurkers = [RawClient(svc.port, identify=False) for _ in range(3)]
    silent = [socket.create_connection(("127.0.0.1", svc.port), timeout=10) for _ in range(3)]
    wait_for(lambda: svc.stats()["connections_open"] == 6, what="six connections accepted")
    # both session slots still go to real devices
    links = [CloudLink.connect("127.0.0.1", svc.port, **device_keys(p)) for p in (0, 1)]
    for link in links:
        assert link.open(PROMPT, fp, timeout_s=10).fingerprint == fp
    assert svc.stats()["sessions_open"] == 2
    # beyond max_handshakes (8) unauthenticated connections are refused on accept
    extra = [socket.create_connection(("127.0.0.1", svc.port), timeout=10) for _ in range(4)]
    time.sleep(0.3)
    assert svc.stats()["connections_refused"] == 2
    # and every unauthenticated one is closed after handshake_timeout_s
    for sock in [r.sock for r in lurkers] + silent + extra:
        assert closed_by_peer(sock, 5.0)
    assert time.monotonic() - t0 < 6.0
    wait_for(lambda: svc.stats()["connections_open"] == 2, what="only the devices remain")
    s = svc.stats()
    assert s["handshake_timeouts"] == 8 and s["sessions_open"] == 2
    assert all(link.alive for link in links)
    for link in links:
        link.close()


# -------------------------------------------------- one authentication mode, both ends

def test_anonymous_mode_needs_both_ends_and_keys_are_required(start_service, tiny):
    target, tok, fp = tiny
    secure = start_service(target, tok)
    with pytest.raises(CloudUnavailable, match="other authentication mode"):
        CloudLink.connect("127.0.0.1", secure.port, insecure=True)
    assert secure.stats()["handshakes_refused"] == 1
    anon = start_service(target, tok, insecure_anonymous=True)
    with pytest.raises(CloudUnavailable, match="other authentication mode"):
        CloudLink.connect("127.0.0.1", anon.port, **device_keys())
    assert anon.stats()["handshakes_refused"] == 1
    with CloudLink.connect("127.0.0.1", anon.port, insecure=True) as link:  # both asked
        assert not link.authenticated and link.open(PROMPT, fp, timeout_s=10).fingerprint == fp
        assert link.bytes_up == 4 + 53 + 4 + 26 + len(P.encode(P.Open(PROMPT, fp)))
    with pytest.raises(ValueError, match="identity and trust store"):
        CloudLink.connect("127.0.0.1", secure.port)
    with pytest.raises(ValueError, match="identity and its authorized devices"):
        CloudService(Target(target, tok, "t"), "127.0.0.1", 0)


def test_trust_on_first_use_pins_the_presented_key_only_when_asked(svc, tiny):
    _, _, fp = tiny
    ident = device_keys()["identity"]
    with pytest.raises(UntrustedPeerError, match="pins no key"):
        CloudLink.connect("127.0.0.1", svc.port, identity=ident, trust=TrustStore())
    trust = TrustStore()
    with CloudLink.connect("127.0.0.1", svc.port, identity=ident, trust=trust,
                           trust_on_first_use=True) as link:
        assert link.open(PROMPT, fp, timeout_s=10).fingerprint == fp
    assert trust.get(CLOUD) == service_keys()["identity"].public_bytes()
    # once pinned, another cloud key is refused even with trust_on_first_use
    other = TrustStore({CLOUD: Identity.generate().public_bytes()})
    with pytest.raises(UntrustedPeerError, match="is pinned"):
        CloudLink.connect("127.0.0.1", svc.port, identity=ident, trust=other,
                          trust_on_first_use=True)


def test_generate_pins_the_cloud_on_first_use_only_when_asked(svc, tmp_path, capsys):
    """``edgefuse cloud generate --device-dir``: a home that pins no cloud key is refused in one
    line; with ``--trust-on-first-use`` the presented key is printed and saved there."""
    import shutil

    from edgefuse.cli.main import main
    from edgefuse.transport.identity import IDENTITY_FILE, TRUST_FILE, device_dir

    from tests.cloud.conftest import keys_root

    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(device_dir(keys_root(), 0) / IDENTITY_FILE, home / IDENTITY_FILE)  # authorized
    (home / IDENTITY_FILE).chmod(0o600)
    args = ["cloud", "generate", "--model", "tiny-qwen2", "--mode", "cloud", "--prompt", "hi",
            "--max-new-tokens", "2", "--protection", "off", "--port", str(svc.port),
            "--device-dir", str(home)]
    assert main(args) == 2  # a one-line CLI error
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pins no key for 'cloud'" in err[0]
    assert not (home / TRUST_FILE).exists()
    assert main(args + ["--trust-on-first-use"]) == 0
    cloud = service_keys()["identity"]
    assert f"pinned the cloud's key {cloud.fingerprint}" in capsys.readouterr().err
    assert TrustStore.load(home / TRUST_FILE).get(CLOUD) == cloud.public_bytes()
    assert main(args) == 0  # pinned now: no flag needed


def test_decoding_phase_starts_the_service_with_the_operators_keys(tmp_path, monkeypatch):
    """The phase passes ``<keys root>/cloud`` identity and authorized devices (never the
    anonymous mode) down to the child's command line."""
    import types

    from edgefuse.app.phases import decoding as phase
    from edgefuse.app.strategy import NodeInfo
    from edgefuse.cloud import service
    from edgefuse.config import compose
    from edgefuse.transport.identity import AUTHORIZED_FILE, IDENTITY_FILE, cloud_dir

    from tests.cloud.conftest import keys_root

    class Started(Exception):
        pass
    seen = {}
    real_start = service.start_service_process

    def start(model, host, port, **kw):
        seen.update(kw)
        raise Started
    monkeypatch.setattr(service, "start_service_process", start)
    monkeypatch.setattr(phase, "load_queries", lambda cfg: [])
    cfg = compose("tiny", [f"paths.cache_dir={tmp_path}", "data.mirror=hub"])
    node = NodeInfo(node_id=7, partition_id=0, model="tiny-qwen2", lora_rank=4)
    ctx = types.SimpleNamespace(cfg=cfg, strategy=types.SimpleNamespace(nodes={7: node}), out=tmp_path)
    with pytest.raises(Started):
        phase.Decoding().run(ctx)
    root = cloud_dir(keys_root())
    assert seen["identity_path"] == root / IDENTITY_FILE
    assert seen["authorized_path"] == root / AUTHORIZED_FILE
    assert not seen.get("insecure_anonymous")
    # and the child's command line carries them
    calls = []

    class Exits:
        def __init__(self, cmd, **kw):
            calls.append(cmd)

        def poll(self):
            return 1
    monkeypatch.setattr(service.subprocess, "Popen", Exits)
    with pytest.raises(service.ServiceStartError):
        real_start("tiny-qwen2", identity_path=root / IDENTITY_FILE,
                   authorized_path=root / AUTHORIZED_FILE, log_path=tmp_path / "log", timeout_s=5)
    (cmd,) = calls
    assert cmd[cmd.index("--identity") + 1] == str(root / IDENTITY_FILE)
    assert cmd[cmd.index("--authorized-devices") + 1] == str(root / AUTHORIZED_FILE)
    assert "--insecure-anonymous" not in cmd


def test_serve_without_its_keys_is_one_line(tmp_path):
    from tests.cli.test_cli_errors import cli

    rc, line = cli("cloud", "serve", "--model", "tiny-qwen2", "--port", "0",
                   "--identity", str(tmp_path / "none.key"))
    assert rc != 0 and line.startswith("edgefuse: error: no identity key at") and "none.key" in line
    empty = tmp_path / "authorized.json"
    TrustStore().save(empty)
    rc, line = cli("cloud", "serve", "--model", "tiny-qwen2", "--port", "0",
                   "--authorized-devices", str(empty))
    assert rc != 0 and line == f"edgefuse: error: {empty} authorizes no device"


def _fake_cloud(behaviour):
    """A listening socket that answers one device's hello with ``behaviour(conn)``."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def serve():
        conn, _ = srv.accept()
        with conn:
            wire.recv_message(conn)
            behaviour(conn)

    threading.Thread(target=serve, daemon=True).start()
    return srv


def _trickle(conn, announced: int = 16 * 1024 * 1024 - 1):
    """A welcome announced at ``announced`` bytes (16 MiB by default), sent one byte every
    0.3 s (never finishes in time); stops when the device hangs up."""
    try:
        conn.sendall(announced.to_bytes(4, "big"))
        for _ in range(40):
            conn.sendall(b"x")
            time.sleep(0.3)
    except OSError:
        pass


def test_a_cloud_trickling_its_welcome_is_cut_off_at_the_connect_timeout():
    """The handshake's timeout is one deadline, not per read: a fake cloud (anyone at the
    host:port the server names) that drips bytes cannot stall the device past it."""
    srv = _fake_cloud(lambda conn: _trickle(conn, wire.WELCOME_BYTES))
    t0 = time.monotonic()
    with srv, pytest.raises(CloudUnavailable, match="TimeoutError"):
        CloudLink.connect(*srv.getsockname(), timeout_s=1.5, **device_keys())
    assert time.monotonic() - t0 < 4.0  # 1.5 s deadline (+ slack), not 40 × 0.3 s


def test_a_welcome_announced_longer_than_a_welcome_is_refused_before_it_is_read():
    srv = _fake_cloud(_trickle)
    t0 = time.monotonic()
    with srv, pytest.raises(wire.MessageTooLarge, match=f"limit is {wire.WELCOME_BYTES} bytes"):
        CloudLink.connect(*srv.getsockname(), timeout_s=10, **device_keys())
    assert time.monotonic() - t0 < 2.0  # refused on the length prefix, not after reading
