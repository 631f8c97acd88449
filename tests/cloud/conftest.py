"""Shared pieces of the cloud tests: an in-process link to a real :class:`Target`, the
target's own greedy continuation (the reference every lossless mode must equal), a perturbed
copy of a model (a draft that agrees with its target often but not always), a started
in-process :class:`CloudService`, and the provisioned keys both ends authenticate with
(:func:`service_keys`, :func:`device_keys`: the session's ``provisioned_keys``)."""

from __future__ import annotations

import collections
import copy
import socket
import threading
import time

import pytest
import torch

import edgefuse.cloud.protocol as P
from edgefuse.cloud.service import CloudService
from edgefuse.cloud import wire
from edgefuse.cloud.target import SessionError, Target
from edgefuse.transport.crypto import derive_session, generate_keypair, new_session_id
from edgefuse.transport.identity import (AUTHORIZED_FILE, IDENTITY_FILE, TRUST_FILE, TrustStore,
                                         cloud_dir, device_dir, load_identity)


def keys_root():
    from edgefuse.app.device import keys_root as root

    return root()


def service_keys() -> dict:
    """``identity=`` / ``authorized=`` keyword arguments of :class:`CloudService`: the
    provisioned cloud identity and authorized devices."""
    root = cloud_dir(keys_root())
    return {"identity": load_identity(root / IDENTITY_FILE),
            "authorized": TrustStore.load(root / AUTHORIZED_FILE)}


def device_keys(pid: int = 0) -> dict:
    """``identity=`` / ``trust=`` keyword arguments of :meth:`CloudLink.connect`: the
    provisioned device ``pid``'s identity and trust store (pins the cloud)."""
    home = device_dir(keys_root(), pid)
    return {"identity": load_identity(home / IDENTITY_FILE),
            "trust": TrustStore.load(home / TRUST_FILE)}


def target_greedy(model, prompt: list[int], n: int) -> list[int]:
    """The ``n`` greedy tokens ``model.generate`` continues ``prompt`` with (no EOS stop)."""
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def perturbed_copy(model, scale: float, seed: int = 0):
    """A deep copy of ``model`` with Gaussian noise added to every weight (``scale`` times the
    tensor's own standard deviation): a draft whose greedy tokens match the target's only
    some of the time."""
    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std().clamp_min(1e-3))
    return m.eval()


class TcpRelay:
    """A TCP relay between one client and ``port`` on loopback: accepts once, connects to the
    target and runs :meth:`_pump` (each subclass's) in a thread per direction ("up" = client
    -> target, "down" = back)."""

    def __init__(self, port: int):
        self.target_port = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.threads = []
        self.accepted = threading.Thread(target=self._accept, daemon=True)
        self.accepted.start()

    def _accept(self):
        client, _ = self.listener.accept()
        server = socket.create_connection(("127.0.0.1", self.target_port))
        for src, dst, direction in ((client, server, "up"), (server, client, "down")):
            t = threading.Thread(target=self._pump, args=(src, dst, direction), daemon=True)
            t.start()
            self.threads.append(t)

    def _pump(self, src, dst, direction):
        raise NotImplementedError

    def join(self, timeout_s=5.0):
        self.accepted.join(timeout_s)
        for t in self.threads:
            t.join(timeout_s)
        self.listener.close()


class DirectLink:
    """The device end of the protocol without a socket: messages are encoded and decoded
    exactly as on the wire and answered by a real :class:`Target` (one session)."""

    def __init__(self, target: Target, fail_after: int | None = None, lag: bool = False):
        self.target, self.session = target, None
        self.inbox: collections.deque = collections.deque()
        self.bytes_up = self.bytes_down = self.round_trips = 0
        self.fail_after, self.sent = fail_after, 0
        self.lag = lag  # a slow cloud: each TOPK shows up only after the next request
        self.held = None

    def _deliver(self, msg):
        data = P.encode(msg)
        self.bytes_up += len(data)
        self.sent += 1
        if self.fail_after is not None and self.sent > self.fail_after:
            raise ConnectionError("cloud went away")
        msg = P.decode(data)
        if isinstance(msg, P.Close):
            self.target.close(self.session)
            return
        if isinstance(msg, P.Open):
            try:
                self.session = self.target.open(msg)
                reply = P.Opened(self.target.name, self.target.fingerprint, self.target.context_len)
            except SessionError as exc:
                reply = P.Error(exc.code, str(exc))
        else:
            (reply,) = self.target.step([(self.session, msg)])
        out = P.encode(reply)
        self.bytes_down += len(out)
        if self.held is not None:
            self.inbox.append(self.held)
            self.held = None
        if self.lag and isinstance(reply, P.TopK):
            self.held = P.decode(out)
        else:
            self.inbox.append(P.decode(out))

    def send(self, msg):
        self._deliver(msg)

    def count_round_trip(self):
        self.round_trips += 1

    def recv(self, timeout_s=None):
        if not self.inbox:
            raise TimeoutError("no reply yet")
        msg = self.inbox.popleft()
        if isinstance(msg, P.Error):
            raise P.RemoteError(msg.code, msg.message)
        return msg

    def request(self, msg, timeout_s=None):
        self.round_trips += 1
        self.send(msg)
        return self.recv(timeout_s)

    def open(self, prompt, fingerprint, temperature=0.0, top_k=0, seed=0, max_new=256):
        self.send(P.Open(prompt, fingerprint, temperature, top_k, seed, max_new))
        return self.recv()


@pytest.fixture
def start_service():
    """Factory: ``start_service(model, tok, name="tiny-target", **service_kw)`` starts an
    in-process :class:`CloudService` over a fresh ``Target`` of ``model`` with the
    provisioned cloud keys (:func:`service_keys`); all are stopped after the test."""
    started = []

    def start(model, tok, name: str = "tiny-target", **kw) -> CloudService:
        if not kw.get("insecure_anonymous"):
            kw = {**service_keys(), **kw}
        svc = CloudService(Target(model, tok, name), "127.0.0.1", 0, **kw)
        svc.start_in_thread()
        started.append(svc)
        return svc

    yield start
    for svc in started:
        svc.stop()


def wait_for(cond, timeout_s=20.0, what="condition"):
    """Poll ``cond()`` until true; ``AssertionError`` after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


class RawClient:
    """A device end written by hand (no CloudLink), to put arbitrary bytes on the socket.

    It does the SIGMA-I handshake itself: HELLO, the WELCOME checked against ``trust``
    (``pid``'s by default), then, when ``identify``, IDENTIFY signed by ``identity``
    (device ``pid``'s by default). ``identify=False`` leaves the connection before IDENTIFY
    (``self.th`` is the transcript hash, to sign something else by hand)."""

    def __init__(self, port: int, pid: int = 0, identity=None, trust=None, identify: bool = True):
        keys = device_keys(pid)
        identity = identity or keys["identity"]
        trust = trust or keys["trust"]
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        own, sid = generate_keypair(), new_session_id()
        self.hello = wire.encode_hello(own.public_bytes(), sid)
        wire.send_message(self.sock, self.hello)
        self.welcome = wire.recv_message(self.sock)
        peer, _ = wire.check_welcome(self.hello, self.welcome, trust)
        self.th = wire.session_transcript(self.hello, self.welcome)
        self.secure = derive_session(own, peer, sid, initiator=True, transcript=self.th)
        if identify:
            self.send(wire.make_identify(identity, self.th))

    def seal(self, msg) -> bytes:
        return self.secure.seal(P.encode(msg) if not isinstance(msg, bytes) else msg)

    def send_frame(self, frame: bytes) -> None:
        wire.send_message(self.sock, frame)

    def send(self, msg) -> None:
        self.send_frame(self.seal(msg))

    def recv(self) -> P.Message:
        return P.decode(self.secure.open(wire.recv_message(self.sock)))

    def close(self):
        self.sock.close()
