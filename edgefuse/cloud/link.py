"""The device end of the cloud connection: handshake, sealed messages, an emulated WAN and
exact byte accounting.

Threads: a reader thread receives, opens and decodes every frame as it arrives; with a WAN
profile a writer thread puts sealed frames on the socket when their emulated uplink delay has
passed. The caller is never blocked by emulated delay: :meth:`CloudLink.send` returns at once,
:meth:`CloudLink.recv` waits only for a message that is due. This is what lets a decoder draft
block k+1 while block k is "in flight".

WAN timing (per direction its own :class:`edgefuse.transport.WanLink` over the same profile;
``nbytes`` = the framed message, length prefix included):

- up: a message sent at ``t`` is written to the socket at
  ``max(t + up.delay_s(nbytes), previous up write time)``;
- down: a message read from the socket at ``a`` becomes visible to :meth:`recv` at
  ``max(a + down.delay_s(nbytes), previous down visibility time)``.

Frames never overtake each other in one direction. The handshake is delayed the same way
(synchronously, inside :meth:`CloudLink.connect`).

Authentication (:mod:`edgefuse.cloud.wire`, SIGMA-I): :meth:`CloudLink.connect` takes the
device's own Ed25519 identity and trust store (a device's
:meth:`edgefuse.app.device.DeviceHome.identity` / ``trust()``, never anything the server
sends), refuses a cloud whose identity is not the pinned ``cloud`` key or whose signature
does not verify (:class:`edgefuse.transport.identity.UntrustedPeerError`, before a byte is
sealed), and proves the device's identity in the first sealed frame (IDENTIFY). A device the
cloud does not authorize learns it from the answer to its first request (ERROR
``unauthorized``, then the cloud closes).
"""

from __future__ import annotations

import collections
import logging
import queue
import socket
import threading
import time

from edgefuse.cloud import protocol as P
from edgefuse.cloud.wire import (WELCOME_ANONYMOUS_BYTES, WELCOME_BYTES, PeerClosed, check_welcome, decode_health, decode_welcome,
                                 encode_health_probe, encode_hello, frame, make_identify,
                                 recv_message, send_message, session_transcript)
from edgefuse.transport.crypto import (FrameError, ReorderError, SecureSession, derive_session,
                                       generate_keypair, new_session_id)
from edgefuse.transport.identity import Identity, TrustStore
from edgefuse.privacy.audit import outbound
from edgefuse.transport.wan import WanLink, WanProfile

log = logging.getLogger("edgefuse.cloud")
HEALTH_MAX_BYTES = 65536  # a health answer is a small JSON object


class CloudUnavailable(ConnectionError):
    """The cloud cannot be reached: connection refused, closed by the cloud, reset, or this
    link already closed."""


class CloudLink:
    """One device session with the cloud service. Build it with :meth:`connect`.

    Counters (all since :meth:`connect`, handshake included):

    - ``bytes_up`` / ``bytes_down``: bytes written to / read from the socket (length
      prefixes, handshake, AES-GCM headers and tags included). Up is counted when the frame is
      actually written (with a WAN, after its emulated delay), down when it is read.
    - ``messages_up`` / ``messages_down``: sealed protocol messages written / read (the
      handshake's HELLO, WELCOME and sealed IDENTIFY are not counted).
    - ``round_trips``: :meth:`request` calls (and so :meth:`open`) plus
      :meth:`count_round_trip` calls.
    - ``frames_rejected``: frames from the cloud that failed to open (dropped).

    ``wan_up`` / ``wan_down``: the emulated :class:`WanLink` per direction (None without WAN);
    their ``delay_s_total`` is the emulated delay in seconds. ``cloud_identity``: the cloud's
    verified Ed25519 public key (None on an anonymous link); ``authenticated``: whether the
    link was made with the SIGMA-I handshake.
    """

    def __init__(self, sock: socket.socket, secure: SecureSession, wan: WanProfile | None,
                 wan_up: WanLink | None, wan_down: WanLink | None, handshake_up: int,
                 handshake_down: int, peer: str, cloud_identity: bytes | None = None):
        self._sock = sock
        self._secure = secure
        self.wan = wan
        self.wan_up = wan_up
        self.wan_down = wan_down
        self.peer = peer
        self.bytes_up = handshake_up
        self.bytes_down = handshake_down
        self.messages_up = 0
        self.messages_down = 0
        self.round_trips = 0
        self.frames_rejected = 0
        self.opened: P.Opened | None = None
        self.cloud_identity = cloud_identity
        self.authenticated = cloud_identity is not None
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self._inbox: collections.deque = collections.deque()  # (visible_at, message | exception)
        self._dead: str | None = None  # why the connection is gone
        self._closed = False
        self._last_up_due = 0.0
        self._last_down_due = 0.0
        self._outbox: queue.Queue | None = None
        self._writer: threading.Thread | None = None
        if wan_up is not None:
            self._outbox = queue.Queue()
            self._writer = threading.Thread(target=self._write_loop, name="cloudlink-writer",
                                            daemon=True)
            self._writer.start()
        self._reader = threading.Thread(target=self._read_loop, name="cloudlink-reader",
                                        daemon=True)
        self._reader.start()

    # ----------------------------------------------------------------------- connect

    @classmethod
    def connect(cls, host: str, port: int, wan: WanProfile | None = None,
                timeout_s: float = 10.0, *, identity: Identity | None = None,
                trust: TrustStore | None = None, trust_on_first_use: bool = False,
                insecure: bool = False) -> CloudLink:
        """Connect and do the authenticated handshake (the device is the initiator).

        ``identity`` / ``trust``: this device's Ed25519 identity and trust store (required);
        the cloud must present the key ``trust`` pins as ``cloud`` and sign the handshake with
        it. ``trust_on_first_use``: if ``trust`` pins no cloud key yet, pin the one presented
        (in memory; save the store to keep it; ``cloud_identity`` is the key). ``insecure``:
        the anonymous handshake, for the benchmark's "auth off" column only (a default service
        refuses it; ``identity``/``trust`` are then ignored). ``wan``: emulate this link
        profile (None = no delay). ``timeout_s``: seconds for the whole handshake, the TCP
        connect included (a cloud that trickles its welcome byte by byte is cut off at it);
        a welcome announced longer than a welcome is refused before it is read.

        Raises :class:`edgefuse.transport.identity.UntrustedPeerError` (the cloud's identity
        is not the pinned one or its signature does not verify; the socket is closed before
        anything is sealed), :class:`CloudUnavailable` (refused, closed, no welcome in time),
        :class:`edgefuse.cloud.protocol.ProtocolError` (the answer is not a welcome of this
        handshake), :class:`edgefuse.transport.HandshakeError` (a bad peer key),
        ``ValueError`` (no identity or trust store and not ``insecure``)."""
        if not insecure and (not isinstance(identity, Identity)
                             or not isinstance(trust, TrustStore)):
            raise ValueError("a cloud link needs this device's identity and trust store "
                             "(DeviceHome.identity() / trust()); insecure=True (anonymous) is "
                             "for the benchmark only")
        deadline = time.monotonic() + timeout_s
        try:
            sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as exc:
            raise CloudUnavailable(f"cannot connect to the cloud at {host}:{port}: {exc}") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            up = WanLink(wan) if wan is not None else None
            down = WanLink(wan) if wan is not None else None
            own, sid = generate_keypair(), new_session_id()
            hello_body = encode_hello(own.public_bytes(), sid, anonymous=insecure)
            hello = frame(hello_body)
            if up is not None:
                time.sleep(up.delay_s(len(hello)))
            sock.sendall(hello)
            body = recv_message(sock, max(WELCOME_BYTES, WELCOME_ANONYMOUS_BYTES), deadline)
            handshake_down = len(body) + P.LENGTH_PREFIX_BYTES
            if down is not None:
                time.sleep(down.delay_s(handshake_down))
            cloud_key, handshake_up = None, len(hello)
            if insecure:
                secure = derive_session(own, decode_welcome(body), sid, initiator=True)
            else:
                eph, cloud_key = check_welcome(hello_body, body, trust, trust_on_first_use)
                th = session_transcript(hello_body, body)
                secure = derive_session(own, eph, sid, initiator=True, transcript=th)
                # IDENTIFY, the first sealed frame: part of the handshake (its bytes and delay
                # are the handshake's); the first request follows it on the wire
                ident = frame(secure.seal(P.encode(make_identify(identity, th))))
                if up is not None:
                    time.sleep(up.delay_s(len(ident)))
                sock.sendall(ident)
                handshake_up += len(ident)
            sock.settimeout(None)
        except (OSError, PeerClosed) as exc:
            sock.close()
            raise CloudUnavailable(f"handshake with the cloud at {host}:{port} failed: "
                                   f"{type(exc).__name__}: {exc} (a service in the other "
                                   "authentication mode closes on this hello)") from exc
        except BaseException:
            sock.close()
            raise
        return cls(sock, secure, wan, up, down, handshake_up, handshake_down, f"{host}:{port}",
                   cloud_key)

    # --------------------------------------------------------------------------- I/O

    def send(self, msg: P.Message) -> None:
        """Seal and send one message. Without WAN it is written before this returns; with a
        WAN it is queued and written after its emulated uplink delay (this returns at once).
        Raises :class:`CloudUnavailable` if the connection is gone
        (:class:`edgefuse.cloud.protocol.RemoteError` instead when the cloud's last message
        before it closed was an ERROR, e.g. ``unauthorized``),
        :class:`edgefuse.cloud.protocol.ProtocolError` for a message that cannot be encoded."""
        plain = P.encode(msg)
        # the device's outbound audit sees every frame before it is sealed
        outbound("draft_tokens" if isinstance(msg, (P.Open, P.Verify, P.Fuse))
                 else "hidden" if isinstance(msg, (P.Mid, P.Head)) else "control", plain)
        with self._send_lock:
            self._check_alive()
            data = frame(self._secure.seal(plain))
            if self._outbox is None:
                try:
                    self._sock.sendall(data)
                except OSError as exc:
                    self._mark_dead(f"send failed: {exc}")
                    raise CloudUnavailable(f"cloud at {self.peer}: send failed: {exc}") from exc
                self.bytes_up += len(data)
                self.messages_up += 1
            else:
                due = max(time.monotonic() + self.wan_up.delay_s(len(data)), self._last_up_due)
                self._last_up_due = due
                self._outbox.put((due, data))

    def recv(self, timeout_s: float | None = None) -> P.Message:
        """The next message from the cloud, once visible (after its emulated downlink delay).
        ``timeout_s``: seconds to wait (None = forever); a message arriving later stays queued
        for the next call.

        Raises ``TimeoutError`` on timeout, :class:`CloudUnavailable` when the connection is
        gone (after every message already received was delivered) or this link is closed,
        :class:`edgefuse.cloud.protocol.RemoteError` when the cloud answered ERROR,
        :class:`edgefuse.cloud.protocol.ProtocolError` for a message that did not parse."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self._closed:
                    raise CloudUnavailable(f"cloud link to {self.peer} is closed")
                now = time.monotonic()
                if self._inbox and self._inbox[0][0] <= now:
                    item = self._inbox.popleft()[1]
                    break
                if not self._inbox and self._dead is not None:
                    raise CloudUnavailable(f"cloud at {self.peer}: {self._dead}")
                wait = self._inbox[0][0] - now if self._inbox else None
                if deadline is not None:
                    remaining = deadline - now
                    if remaining <= 0:
                        raise TimeoutError(f"no message from the cloud at {self.peer} within "
                                           f"{timeout_s:.3f} s")
                    wait = remaining if wait is None else min(wait, remaining)
                self._cond.wait(wait)
        if isinstance(item, Exception):
            raise item
        if isinstance(item, P.Error):
            raise P.RemoteError(item.code, item.message)
        return item

    def request(self, msg: P.Message, timeout_s: float | None = None) -> P.Message:
        """:meth:`send` then :meth:`recv` (one round trip, counted in ``round_trips``).
        Raises what those raise."""
        self.round_trips += 1
        self.send(msg)
        return self.recv(timeout_s)

    def count_round_trip(self, n: int = 1) -> None:
        """Count ``n`` round trips a pipelining caller completed with send/recv."""
        self.round_trips += n

    def open(self, prompt: list[int], fingerprint: str, temperature: float = 0.0,
             top_k: int = 0, seed: int = 0, max_new: int = 256,
             timeout_s: float | None = 60.0, auth: P.CloudAuth | None = None) -> P.Opened:
        """OPEN a session (prefill ``prompt`` at the cloud) under the cache tuple ``auth``
        (None = keep everything); only the last ``auth.held(len(prompt))`` prompt ids are
        sent, the rest is counted as ``offset``. Returns the cloud's :class:`Opened`.
        Raises :class:`edgefuse.cloud.protocol.RemoteError` (``busy``, ``fingerprint``, ``context``,
        …), ``TimeoutError``, :class:`CloudUnavailable`,
        :class:`edgefuse.cloud.protocol.ProtocolError` for an unexpected answer."""
        auth = auth if auth is not None else P.CloudAuth()
        prompt = [int(t) for t in prompt]
        keep = auth.held(len(prompt))
        reply = self.request(P.Open(prompt=prompt[len(prompt) - keep:], fingerprint=fingerprint,
                                    temperature=float(temperature), top_k=int(top_k),
                                    seed=int(seed), max_new=int(max_new), auth=auth,
                                    offset=len(prompt) - keep), timeout_s)
        if not isinstance(reply, P.Opened):
            raise P.ProtocolError(f"expected OPENED, got {type(reply).__name__}")
        self.opened = reply
        return reply

    def open_split(self, split: P.SplitRequest, fingerprint: str,
                   auth: P.CloudAuth | None = None, offset: int = 0,
                   timeout_s: float | None = 60.0) -> P.Opened:
        """OPEN a split-inference session (no prompt ids: the prompt goes as the first MID's
        activations) under the cache tuple ``auth`` (None = keep everything); ``offset``:
        committed rows before the first MID's window. Returns the cloud's :class:`Opened`
        (its ``split`` echoes the accepted split); answers to an earlier session still in
        flight are skipped. Raises
        :class:`edgefuse.cloud.protocol.RemoteError` (``split``: a split this cloud does not
        serve; ``busy``, ``fingerprint``, ...), ``TimeoutError``, :class:`CloudUnavailable`,
        :class:`edgefuse.cloud.protocol.ProtocolError` for an unexpected answer."""
        self.round_trips += 1
        self.send(P.Open(prompt=[], fingerprint=fingerprint,
                         auth=auth if auth is not None else P.CloudAuth(),
                         offset=int(offset), split=split))
        reply = self.recv_until(P.Opened, timeout_s)
        if reply.split != split:
            raise P.ProtocolError(f"expected OPENED for split {split}, got {reply!r:.120}")
        self.opened = reply
        return reply

    def authorize(self, auth: P.CloudAuth, timeout_s: float | None = 60.0) -> int:
        """Send AUTH: the open session's cache tuple becomes ``auth`` (the endpoint-authorized
        cache control (flagCache, LCache) of the edge–cloud seed design). The cloud evicts
        what ``auth`` no longer allows before it answers; ``P.REVOKE`` = AUTH(False, 0)
        drops everything. Answers to earlier requests still unread are skipped (the cloud
        answers in order). Returns the committed tokens the cloud holds now.
        Raises :class:`edgefuse.cloud.protocol.RemoteError` (``protocol``: no open session; also an
        ERROR answering an earlier request), ``TimeoutError``, :class:`CloudUnavailable`."""
        self.round_trips += 1
        self.send(P.Auth(auth))
        return int(self.recv_until(P.Authed, timeout_s).held)

    def recv_until(self, kind: type, timeout_s: float | None = None):
        """The next message of type ``kind``, skipping answers to earlier requests still in
        flight (a late top-k, an earlier session's MIDOUT), within ``timeout_s`` in all (None:
        wait). Raises what :meth:`recv` raises (``TimeoutError`` when time runs out)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            msg = self.recv(None if deadline is None else max(deadline - time.monotonic(), 0.0))
            if isinstance(msg, kind):
                return msg

    def close(self, timeout_s: float = 5.0) -> None:
        """Send CLOSE (after every queued message, honouring the WAN delay, waiting at most
        ``timeout_s`` seconds), then close the socket. Idempotent; never raises."""
        with self._send_lock:
            if self._closed:
                return
        try:
            self.send(P.Close())
        except (CloudUnavailable, OSError):
            pass
        with self._send_lock:
            self._closed = True
        if self._writer is not None:
            self._outbox.put(None)
            self._writer.join(timeout_s)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._cond:
            self._cond.notify_all()
        self._reader.join(timeout_s)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    @property
    def alive(self) -> bool:
        """Whether the connection is still up (not closed, not dropped by the cloud)."""
        return not self._closed and self._dead is None

    def __enter__(self) -> CloudLink:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------------- internals

    def _check_alive(self) -> None:
        if self._closed:
            raise CloudUnavailable(f"cloud link to {self.peer} is closed")
        if self._dead is not None:
            with self._cond:  # the cloud's last word (e.g. ERROR unauthorized) before it closed
                err = next((m for _, m in self._inbox if isinstance(m, P.Error)), None)
                if err is not None:
                    self._inbox.clear()
            if err is not None:
                raise P.RemoteError(err.code, err.message)
            raise CloudUnavailable(f"cloud at {self.peer}: {self._dead}")

    def _mark_dead(self, why: str) -> None:
        with self._cond:
            if self._dead is None:
                self._dead = why
            self._cond.notify_all()

    def _write_loop(self) -> None:
        while True:
            item = self._outbox.get()
            if item is None:
                return
            due, data = item
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            if self._dead is not None:
                continue  # drop: the connection is gone (send() already refuses new ones)
            try:
                self._sock.sendall(data)
            except OSError as exc:
                self._mark_dead(f"send failed: {exc}")
                continue
            self.bytes_up += len(data)
            self.messages_up += 1

    def _read_loop(self) -> None:
        while True:
            try:
                body = recv_message(self._sock)
            except PeerClosed:
                self._mark_dead("connection closed by the cloud")
                return
            except P.ProtocolError as exc:  # oversized announcement: the stream is lost
                self._mark_dead(str(exc))
                return
            except OSError as exc:
                self._mark_dead("link closed" if self._closed else f"connection lost: {exc}")
                return
            arrival = time.monotonic()
            nbytes = len(body) + P.LENGTH_PREFIX_BYTES
            self.bytes_down += nbytes
            try:
                plain = self._secure.open(body)
            except ReorderError as exc:  # a genuine frame was altered or dropped: never lines up again
                self.frames_rejected += 1
                self._mark_dead(f"frames from the cloud were altered or dropped in transit ({exc})")
                try:  # end the connection too, so the cloud frees the session now
                    self._sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                return
            except FrameError as exc:
                self.frames_rejected += 1
                log.warning("cloud link %s: rejected frame (%s): %s", self.peer,
                            type(exc).__name__, exc)
                continue
            self.messages_down += 1
            try:
                item = P.decode(plain)
            except P.ProtocolError as exc:
                item = exc
            due = arrival
            if self.wan_down is not None:
                due = max(arrival + self.wan_down.delay_s(nbytes), self._last_down_due)
                self._last_down_due = due
            with self._cond:
                self._inbox.append((due, item))
                self._cond.notify_all()


def cloud_health(host: str, port: int, timeout_s: float = 5.0, token: str | None = None) -> dict:
    """Ask the cloud service for its status (one cleartext JSON message; see
    :meth:`edgefuse.cloud.service.CloudService.health`). ``timeout_s``: seconds for connect + answer;
    ``token``: the service's health token (its full counters; None: liveness and load only).
    Raises :class:`CloudUnavailable` (refused, closed, no answer in time),
    :class:`edgefuse.cloud.protocol.ProtocolError` (not JSON)."""
    deadline = time.monotonic() + timeout_s
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            send_message(sock, encode_health_probe(token))
            body = recv_message(sock, HEALTH_MAX_BYTES, deadline)
    except (OSError, PeerClosed) as exc:
        raise CloudUnavailable(f"no health answer from the cloud at {host}:{port}: "
                               f"{type(exc).__name__}: {exc}") from exc
    return decode_health(body)
