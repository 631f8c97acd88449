"""Framed TCP I/O and the handshake, shared by the cloud service and the device link.

Every message on the socket is ``u32 length (big-endian) ‖ body`` (``LENGTH_PREFIX_BYTES`` = 4
bytes of prefix, body at most ``MAX_MESSAGE_BYTES``). The first message decides what the
connection is:

- ``MAGIC_HEALTH`` (optionally followed by the service's health token): a health probe. The
  cloud answers one cleartext message, a JSON object, and closes the connection: without the
  token only liveness and load (status, model, sessions and connections open, queue depth,
  uptime_s); with it every counter too (see
  :meth:`edgefuse.cloud.service.CloudService.health`).
- a HELLO: the device's side of the handshake below.

The handshake is SIGMA-I (Krawczyk, "SIGMA: the 'SIGn-and-MAc' approach to authenticated
Diffie-Hellman", CRYPTO 2003), signed ephemeral X25519 with the Ed25519 identities of
:mod:`edgefuse.transport.identity`, in the shape of TLS 1.3's (RFC 8446) and IKEv2's: each
signature covers the hash of the whole transcript so far, the signer's own identity included
(which binds the identity to the session as SIGMA's MAC does), and the session keys are
derived from the ephemeral-ephemeral secret with that transcript bound in. Messages (the
sizes are bodies; each has 4 more bytes of length prefix)::

    HELLO     device→cloud  "EFC2" ‖ e_D (32, X25519) ‖ u8 n ‖ session id (n = 1..255)
                            = 53 bytes with the 16-byte session id CloudLink sends
    WELCOME   cloud→device  "EFC2" ‖ e_S (32, X25519) ‖ I_S (32, Ed25519) ‖ sig_S (64)
                            = 132 bytes
    IDENTIFY  device→cloud  the first sealed frame: 0x06 ‖ I_D (32) ‖ sig_D (64)
                            = 97 bytes of plaintext, 123 framed (FRAME_OVERHEAD 26)

    th_W = SHA-256("edgefuse-sigma-i-v1 welcome" ‖ u16 len(HELLO) ‖ HELLO ‖ e_S ‖ I_S)
    sig_S = Ed25519_S("edgefuse cloud welcome v1\0" ‖ th_W)
    th_K = SHA-256("edgefuse-sigma-i-v1 keys" ‖ u16 len(HELLO) ‖ HELLO ‖ WELCOME)
    keys = derive_session(DH(e_D, e_S), session id, transcript = th_K)
    th_I = SHA-256("edgefuse-sigma-i-v1 identify" ‖ th_K ‖ I_D)
    sig_D = Ed25519_D("edgefuse device identify v1\0" ‖ th_I)

The device checks that ``I_S`` is the key pinned as ``cloud`` in its own trust store and that
``sig_S`` verifies (:func:`check_welcome`, else :class:`UntrustedPeerError` and nothing is
sent). The cloud serves only a device whose ``I_D`` is in its authorized-devices store and
whose ``sig_D`` verifies (:func:`check_identify`); IDENTIFY travels sealed, so a passive
observer never learns which device it is (SIGMA-I's initiator identity protection; the
cloud's identity is public). A recorded IDENTIFY replayed on another connection fails: its
transcript, and so its keys, differ. The whole exchange is 1.5 round trips; the device sends
IDENTIFY and its OPEN back to back, so a session still starts after one round trip plus the
OPEN's (as TLS 1.3 sends the client Finished with its first data).

The anonymous handshake ("EFC1": ``HELLO ‖ e_D ‖ u8 n ‖ session id``, answered
``"EFC1" ‖ e_S``, 36 bytes, keys from the bare DH) is kept only for the benchmark's
"authentication off" column: a service speaks it only when started with
``--insecure-anonymous`` and a link only with ``insecure=True``, and each closes on the
other kind, so neither end can be moved to it by the network or by a default.

Every later message is one :meth:`SecureSession.seal` frame whose plaintext is a
:func:`edgefuse.cloud.protocol.encode` message.

Both an asyncio flavour (the service) and a blocking-socket flavour (the link) are provided;
the byte counts they return are the exact bytes written to / read from the socket, length
prefix included.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import struct
import time

from edgefuse.cloud.protocol import (LENGTH_PREFIX_BYTES, MAGIC_HEALTH, MAGIC_HELLO,
                                     MAGIC_HELLO_ANONYMOUS, MAGIC_WELCOME,
                                     MAGIC_WELCOME_ANONYMOUS, MAX_MESSAGE_BYTES, Identify,
                                     ProtocolError)
from edgefuse.transport.crypto import MAX_SESSION_ID_BYTES, PUBLIC_KEY_BYTES
from edgefuse.transport.identity import (CLOUD, SIGNATURE_BYTES, Identity, IdentityError,
                                         TrustStore, UntrustedPeerError, fingerprint,
                                         verify_signature)

_PREFIX = struct.Struct(">I")
assert _PREFIX.size == LENGTH_PREFIX_BYTES

HELLO_MIN_BYTES = len(MAGIC_HELLO) + PUBLIC_KEY_BYTES + 1 + 1  # a 1-byte session id at least
WELCOME_BYTES = len(MAGIC_WELCOME) + 2 * PUBLIC_KEY_BYTES + SIGNATURE_BYTES  # 132
WELCOME_ANONYMOUS_BYTES = len(MAGIC_WELCOME_ANONYMOUS) + PUBLIC_KEY_BYTES  # 36
_LABEL = b"edgefuse-sigma-i-v1 "
SIGN_CONTEXT_CLOUD = b"edgefuse cloud welcome v1\x00"
SIGN_CONTEXT_DEVICE = b"edgefuse device identify v1\x00"


class MessageTooLarge(ProtocolError):
    """A message body over ``MAX_MESSAGE_BYTES`` (16 MiB), to send or announced by the peer.
    The stream cannot be resynchronised after an oversized announcement: close it."""


class PeerClosed(ConnectionError):
    """The peer closed the connection (cleanly between messages, or in the middle of one)."""


def frame(body: bytes) -> bytes:
    """``u32 len ‖ body``: the bytes that go on the socket for one message
    (``len(body) + 4`` bytes). Raises :class:`MessageTooLarge`."""
    n = len(body)
    if n > MAX_MESSAGE_BYTES:
        raise MessageTooLarge(f"message of {n} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    return _PREFIX.pack(n) + bytes(body)


def _check_length(n: int, limit: int = MAX_MESSAGE_BYTES) -> int:
    if n > limit:
        raise MessageTooLarge(f"peer announced a {n}-byte message; the limit is "
                              f"{limit} bytes")
    return n


# ----------------------------------------------------------------------------- blocking sockets

def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """Read exactly ``n`` bytes; raises :class:`PeerClosed` on EOF (and whatever ``OSError``
    the socket raises, e.g. ``TimeoutError`` under a socket timeout). ``deadline``: a
    ``time.monotonic()`` instant by which all ``n`` bytes must be in (``TimeoutError``
    after it, however slowly the peer trickles them); None = the socket's own timeout."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{len(buf)} of {n} bytes arrived before the deadline")
            sock.settimeout(remaining)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            where = "between messages" if not buf and n == LENGTH_PREFIX_BYTES else "mid-message"
            raise PeerClosed(f"connection closed by peer ({where})")
        buf += chunk
    return bytes(buf)


def recv_message(sock: socket.socket, max_bytes: int = MAX_MESSAGE_BYTES,
                 deadline: float | None = None) -> bytes:
    """Read one framed message and return its body (``len(body) + 4`` bytes were read).
    ``max_bytes``: the largest body accepted, checked before it is read; ``deadline``: as
    :func:`recv_exact`, for the whole message. Raises :class:`PeerClosed`,
    :class:`MessageTooLarge`, ``OSError`` (``TimeoutError`` past the deadline)."""
    (n,) = _PREFIX.unpack(recv_exact(sock, LENGTH_PREFIX_BYTES, deadline))
    return recv_exact(sock, _check_length(n, max_bytes), deadline) if n else b""


def send_message(sock: socket.socket, body: bytes) -> int:
    """Write one framed message; returns the bytes written (``len(body) + 4``).
    Raises :class:`MessageTooLarge`, ``OSError``."""
    data = frame(body)
    sock.sendall(data)
    return len(data)


# ----------------------------------------------------------------------------------- asyncio

async def aread_message(reader: asyncio.StreamReader) -> bytes:
    """Read one framed message from an asyncio stream; returns its body.
    Raises :class:`PeerClosed` on EOF, :class:`MessageTooLarge`."""
    try:
        (n,) = _PREFIX.unpack(await reader.readexactly(LENGTH_PREFIX_BYTES))
        return await reader.readexactly(_check_length(n)) if n else b""
    except asyncio.IncompleteReadError as exc:
        where = "between messages" if not exc.partial else "mid-message"
        raise PeerClosed(f"connection closed by peer ({where})") from None


def write_message(writer: asyncio.StreamWriter, body: bytes) -> int:
    """Queue one framed message on an asyncio stream (no drain); returns the bytes queued
    (``len(body) + 4``). Raises :class:`MessageTooLarge`."""
    data = frame(body)
    writer.write(data)
    return len(data)


# --------------------------------------------------------------------------------- handshake

def encode_hello(public_key: bytes, session_id: bytes, anonymous: bool = False) -> bytes:
    """``"EFC2" ‖ ephemeral X25519 key (32 bytes) ‖ u8 n ‖ session id (n = 1..255 bytes)``
    (``anonymous``: magic ``"EFC1"``, the benchmark-only handshake). Raises
    :class:`ProtocolError` for a wrong-size key or session id."""
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise ProtocolError(f"public key must be {PUBLIC_KEY_BYTES} bytes, got {len(public_key)}")
    if not 1 <= len(session_id) <= MAX_SESSION_ID_BYTES:
        raise ProtocolError(f"session id must be 1..{MAX_SESSION_ID_BYTES} bytes, got {len(session_id)}")
    magic = MAGIC_HELLO_ANONYMOUS if anonymous else MAGIC_HELLO
    return magic + bytes(public_key) + bytes([len(session_id)]) + bytes(session_id)


def hello_is_anonymous(body: bytes) -> bool:
    """Whether a hello asks for the anonymous handshake (``"EFC1"``) rather than SIGMA-I
    (``"EFC2"``); raises :class:`ProtocolError` if it is neither."""
    magic = bytes(body[:4])
    if magic not in (MAGIC_HELLO, MAGIC_HELLO_ANONYMOUS):
        raise ProtocolError(f"not a hello: {len(body)} bytes starting {magic!r}")
    return magic == MAGIC_HELLO_ANONYMOUS


def decode_hello(body: bytes) -> tuple[bytes, bytes]:
    """``(ephemeral public key, session id)`` of a hello of either kind; raises
    :class:`ProtocolError` if malformed."""
    if len(body) < HELLO_MIN_BYTES:
        raise ProtocolError(f"not a hello: {len(body)} bytes starting {bytes(body[:4])!r}")
    hello_is_anonymous(body)
    pos = len(MAGIC_HELLO)
    key = bytes(body[pos:pos + PUBLIC_KEY_BYTES])
    n = body[pos + PUBLIC_KEY_BYTES]
    sid = bytes(body[pos + PUBLIC_KEY_BYTES + 1:])
    if n == 0 or len(sid) != n:
        raise ProtocolError(f"hello announces a {n}-byte session id but carries {len(sid)} bytes")
    return key, sid


def encode_welcome(public_key: bytes) -> bytes:
    """The anonymous welcome, ``"EFC1" ‖ X25519 public key (32 bytes)``; raises
    :class:`ProtocolError`."""
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise ProtocolError(f"public key must be {PUBLIC_KEY_BYTES} bytes, got {len(public_key)}")
    return MAGIC_WELCOME_ANONYMOUS + bytes(public_key)


def decode_welcome(body: bytes) -> bytes:
    """The cloud's public key from an anonymous welcome; raises :class:`ProtocolError` if
    malformed (a signed welcome included: an anonymous link refuses it)."""
    if len(body) != WELCOME_ANONYMOUS_BYTES or not bytes(body).startswith(MAGIC_WELCOME_ANONYMOUS):
        raise ProtocolError(f"not an anonymous welcome: {len(body)} bytes starting "
                            f"{bytes(body[:4])!r}")
    return bytes(body[len(MAGIC_WELCOME_ANONYMOUS):])


def _sha256(*parts: bytes) -> bytes:
    h = hashlib.sha256()
    for p in parts:
        h.update(p)
    return h.digest()


def _hello_part(hello: bytes) -> bytes:
    if not 1 <= len(hello) <= 0xFFFF:
        raise ProtocolError(f"a hello is 1..65535 bytes, got {len(hello)}")
    return struct.pack(">H", len(hello)) + bytes(hello)


def welcome_transcript(hello: bytes, ephemeral: bytes, identity_public: bytes) -> bytes:
    """``th_W``, the 32-byte hash the cloud signs: the hello, its ephemeral key, its identity."""
    return _sha256(_LABEL + b"welcome", _hello_part(hello), bytes(ephemeral), bytes(identity_public))


def session_transcript(hello: bytes, welcome: bytes) -> bytes:
    """``th_K``, the 32-byte hash of hello and (signed) welcome bound into the session keys
    (the ``transcript`` of :func:`edgefuse.transport.derive_session`)."""
    return _sha256(_LABEL + b"keys", _hello_part(hello), bytes(welcome))


def identify_transcript(session_th: bytes, device_public: bytes) -> bytes:
    """``th_I``, the 32-byte hash the device signs: ``th_K`` and its own identity."""
    return _sha256(_LABEL + b"identify", bytes(session_th), bytes(device_public))


def encode_signed_welcome(identity: Identity, hello: bytes, ephemeral: bytes) -> bytes:
    """The cloud's WELCOME to ``hello``: ``"EFC2" ‖ ephemeral ‖ identity key ‖ signature of
    th_W`` (132 bytes). Raises :class:`ProtocolError` for a wrong-size ephemeral key."""
    if len(ephemeral) != PUBLIC_KEY_BYTES:
        raise ProtocolError(f"public key must be {PUBLIC_KEY_BYTES} bytes, got {len(ephemeral)}")
    pub = identity.public_bytes()
    sig = identity.sign(SIGN_CONTEXT_CLOUD + welcome_transcript(hello, ephemeral, pub))
    return MAGIC_WELCOME + bytes(ephemeral) + pub + sig


def decode_signed_welcome(body: bytes) -> tuple[bytes, bytes, bytes]:
    """``(ephemeral key, identity key, signature)`` of a signed welcome (nothing verified);
    raises :class:`ProtocolError` if it is not 132 bytes starting ``"EFC2"`` (an anonymous
    welcome included: an authenticated link refuses it)."""
    if len(body) != WELCOME_BYTES or not bytes(body).startswith(MAGIC_WELCOME):
        raise ProtocolError(f"not a signed welcome: {len(body)} bytes starting "
                            f"{bytes(body[:4])!r} (an anonymous or foreign service?)")
    pos = len(MAGIC_WELCOME)
    eph = bytes(body[pos:pos + PUBLIC_KEY_BYTES])
    pub = bytes(body[pos + PUBLIC_KEY_BYTES:pos + 2 * PUBLIC_KEY_BYTES])
    return eph, pub, bytes(body[pos + 2 * PUBLIC_KEY_BYTES:])


def check_welcome(hello: bytes, body: bytes, trust: TrustStore,
                  trust_on_first_use: bool = False) -> tuple[bytes, bytes]:
    """The device's check of the cloud's WELCOME to its ``hello``: the identity must be the
    key pinned as ``cloud`` in ``trust`` (the device's own store) and its signature of th_W
    must verify. ``trust_on_first_use``: when ``trust`` pins no ``cloud`` key yet, pin this
    one in memory (the caller saves the store) once its signature verified.

    Returns ``(ephemeral key, identity key)``. Raises :class:`ProtocolError` (malformed),
    :class:`UntrustedPeerError` (another key than the pinned one, none pinned, or a
    signature that does not verify; the message names the fingerprints)."""
    eph, pub, sig = decode_signed_welcome(body)
    try:
        pinned = trust.get(CLOUD)
    except UntrustedPeerError:
        if not trust_on_first_use:
            raise UntrustedPeerError(
                f"the cloud presented key {fingerprint(pub)}, but this device pins no key for "
                f"{CLOUD!r}{f' in {trust.path}' if trust.path else ''}: refusing (provision the "
                "device, or pin the cloud on first use)") from None
        pinned = None
    if pinned is not None and pub != pinned:
        raise UntrustedPeerError(
            f"the cloud presented key {fingerprint(pub)}, but {fingerprint(pinned)} is pinned "
            f"for {CLOUD!r}: refusing (a relay or man-in-the-middle may have swapped it)")
    try:
        verify_signature(pub, sig, SIGN_CONTEXT_CLOUD + welcome_transcript(hello, eph, pub))
    except IdentityError:
        raise UntrustedPeerError(
            f"the cloud's signature by key {fingerprint(pub)} does not verify over this "
            f"handshake (pinned: {fingerprint(pinned) if pinned else 'none'}): refusing (a relay "
            "may have replaced its key or signature)") from None
    if pinned is None:
        trust.pin(CLOUD, pub)
    return eph, pub


def make_identify(identity: Identity, session_th: bytes) -> Identify:
    """The device's IDENTIFY for the session with transcript hash ``session_th`` (th_K)."""
    pub = identity.public_bytes()
    return Identify(pub, identity.sign(SIGN_CONTEXT_DEVICE + identify_transcript(session_th, pub)))


def check_identify(msg: Identify, session_th: bytes, authorized: TrustStore) -> str:
    """The cloud's check of a device's IDENTIFY: its key must be in ``authorized`` and its
    signature of th_I must verify. Returns the device's name in the store. Raises
    :class:`UntrustedPeerError` (not authorized) or :class:`IdentityError` (bad signature)."""
    name = authorized.find(msg.public_key)
    if name is None:
        raise UntrustedPeerError(f"device key {fingerprint(msg.public_key)} is not an authorized "
                                 "device of this cloud")
    try:
        verify_signature(msg.public_key, msg.signature,
                         SIGN_CONTEXT_DEVICE + identify_transcript(session_th, msg.public_key))
    except IdentityError:
        raise IdentityError(f"the IDENTIFY signature of {name!r} ({fingerprint(msg.public_key)}) "
                            "does not verify over this handshake (replayed or forged)") from None
    return name


def is_health_probe(body: bytes) -> bool:
    """Whether a connection's first message is a health probe (with or without a token)."""
    return bytes(body[:len(MAGIC_HEALTH)]) == MAGIC_HEALTH


def encode_health_probe(token: str | None = None) -> bytes:
    """A health probe: ``MAGIC_HEALTH`` alone, or ``MAGIC_HEALTH ‖ token`` (UTF-8) to ask a
    service started with that token for its full status."""
    return MAGIC_HEALTH + (token.encode() if token else b"")


def health_probe_token(body: bytes) -> bytes:
    """The token bytes a health probe carries (``b""`` for none)."""
    return bytes(body[len(MAGIC_HEALTH):])


def encode_health(status: dict) -> bytes:
    """The cleartext health answer: compact JSON (UTF-8)."""
    return json.dumps(status, separators=(",", ":"), sort_keys=True).encode()


def decode_health(body: bytes) -> dict:
    """Parse a health answer; raises :class:`ProtocolError` if it is not a JSON object."""
    try:
        obj = json.loads(bytes(body))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"health answer is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("health answer is not a JSON object")
    return obj
