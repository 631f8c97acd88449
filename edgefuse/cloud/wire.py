"""Framed TCP I/O and the cleartext handshake, shared by the cloud service and the device link.

Every message on the socket is ``u32 length (big-endian) ‖ body`` (``LENGTH_PREFIX_BYTES`` = 4
bytes of prefix, body at most ``MAX_MESSAGE_BYTES``). The first message decides what the
connection is:

- ``MAGIC_HEALTH`` (optionally followed by the service's health token): a health probe. The
  cloud answers one cleartext message, a JSON object, and closes the connection: without the
  token only liveness and load (status, model, sessions and connections open, queue depth,
  uptime_s); with it every counter too (see
  :meth:`edgefuse.cloud.service.CloudService.health`).
- ``MAGIC_HELLO ‖ 32-byte X25519 public key ‖ u8 n ‖ n-byte session id``: the device's hello.
  The cloud answers ``MAGIC_WELCOME ‖ 32-byte X25519 public key``; both ends then call
  :func:`edgefuse.transport.derive_session` with the device as the initiator.

Every later message is one :meth:`SecureSession.seal` frame whose plaintext is a
:func:`edgefuse.cloud.protocol.encode` message.

Both an asyncio flavour (the service) and a blocking-socket flavour (the link) are provided;
the byte counts they return are the exact bytes written to / read from the socket, length
prefix included.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct

from edgefuse.cloud.protocol import (LENGTH_PREFIX_BYTES, MAGIC_HEALTH, MAGIC_HELLO, MAGIC_WELCOME,
                            MAX_MESSAGE_BYTES, ProtocolError)
from edgefuse.transport.crypto import MAX_SESSION_ID_BYTES, PUBLIC_KEY_BYTES

_PREFIX = struct.Struct(">I")
assert _PREFIX.size == LENGTH_PREFIX_BYTES

HELLO_MIN_BYTES = len(MAGIC_HELLO) + PUBLIC_KEY_BYTES + 1 + 1  # a 1-byte session id at least
WELCOME_BYTES = len(MAGIC_WELCOME) + PUBLIC_KEY_BYTES


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


def _check_length(n: int) -> int:
    if n > MAX_MESSAGE_BYTES:
        raise MessageTooLarge(f"peer announced a {n}-byte message; the limit is "
                              f"{MAX_MESSAGE_BYTES} bytes")
    return n


# ----------------------------------------------------------------------------- blocking sockets

def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Read exactly ``n`` bytes; raises :class:`PeerClosed` on EOF (and whatever ``OSError``
    the socket raises, e.g. ``TimeoutError`` under a socket timeout)."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            where = "between messages" if not buf and n == LENGTH_PREFIX_BYTES else "mid-message"
            raise PeerClosed(f"connection closed by peer ({where})")
        buf += chunk
    return bytes(buf)


def recv_message(sock: socket.socket) -> bytes:
    """Read one framed message and return its body (``len(body) + 4`` bytes were read).
    Raises :class:`PeerClosed`, :class:`MessageTooLarge`, ``OSError``."""
    (n,) = _PREFIX.unpack(recv_exact(sock, LENGTH_PREFIX_BYTES))
    return recv_exact(sock, _check_length(n)) if n else b""


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

def encode_hello(public_key: bytes, session_id: bytes) -> bytes:
    """``MAGIC_HELLO ‖ public key (32 bytes) ‖ u8 n ‖ session id (n = 1..255 bytes)``.
    Raises :class:`ProtocolError` for a wrong-size key or session id."""
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise ProtocolError(f"public key must be {PUBLIC_KEY_BYTES} bytes, got {len(public_key)}")
    if not 1 <= len(session_id) <= MAX_SESSION_ID_BYTES:
        raise ProtocolError(f"session id must be 1..{MAX_SESSION_ID_BYTES} bytes, got {len(session_id)}")
    return MAGIC_HELLO + bytes(public_key) + bytes([len(session_id)]) + bytes(session_id)


def decode_hello(body: bytes) -> tuple[bytes, bytes]:
    """``(public key, session id)`` of a hello; raises :class:`ProtocolError` if malformed."""
    if len(body) < HELLO_MIN_BYTES or not body.startswith(MAGIC_HELLO):
        raise ProtocolError(f"not a hello: {len(body)} bytes starting {bytes(body[:4])!r}")
    pos = len(MAGIC_HELLO)
    key = bytes(body[pos:pos + PUBLIC_KEY_BYTES])
    n = body[pos + PUBLIC_KEY_BYTES]
    sid = bytes(body[pos + PUBLIC_KEY_BYTES + 1:])
    if n == 0 or len(sid) != n:
        raise ProtocolError(f"hello announces a {n}-byte session id but carries {len(sid)} bytes")
    return key, sid


def encode_welcome(public_key: bytes) -> bytes:
    """``MAGIC_WELCOME ‖ public key (32 bytes)``; raises :class:`ProtocolError`."""
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise ProtocolError(f"public key must be {PUBLIC_KEY_BYTES} bytes, got {len(public_key)}")
    return MAGIC_WELCOME + bytes(public_key)


def decode_welcome(body: bytes) -> bytes:
    """The cloud's public key from a welcome; raises :class:`ProtocolError` if malformed."""
    if len(body) != WELCOME_BYTES or not body.startswith(MAGIC_WELCOME):
        raise ProtocolError(f"not a welcome: {len(body)} bytes starting {bytes(body[:4])!r}")
    return bytes(body[len(MAGIC_WELCOME):])


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
