"""Authenticated, ordered, encrypted frames between two ends (device ↔ cloud, device ↔ device).

Key agreement is X25519 (RFC 7748); HKDF-SHA256 (RFC 5869) turns the shared secret into two
AES-256-GCM keys (NIST SP 800-38D), one per direction, so each end seals with one key and opens
with the other. All primitives come from the ``cryptography`` library.

This module agrees keys; it does not say who the peer is. Anonymous X25519 alone is open to a
man in the middle: the device ↔ cloud link authenticates both ends with a SIGMA-I handshake
of Ed25519-signed ephemeral keys (:mod:`edgefuse.cloud.wire`) and passes its transcript hash
to :func:`derive_session`.

Frame layout (all integers big-endian)::

    offset  size  field
    0       1     version       (FRAME_VERSION = 1)
    1       1     direction     (0 = initiator→responder, 1 = responder→initiator)
    2       8     sequence no.  (0, 1, 2, … per direction)
    10      n     AES-GCM ciphertext (n = len(plaintext))
    10+n    16    AES-GCM tag

``FRAME_OVERHEAD`` = 10 + 16 = 26 bytes. The 12-byte GCM nonce is 4 zero bytes followed by the
8-byte sequence number; each direction has its own key and its sequence number never repeats,
so a (key, nonce) pair is never reused. The associated data is
``len(session_id) (2 bytes) ‖ session_id ‖ header``, which binds the session, the direction and
the sequence number to the tag.

A receiver accepts exactly the next sequence number: older authentic frames raise
:class:`ReplayError`, newer ones :class:`ReorderError` (one ordered stream, e.g. TCP, carries
the frames, so a gap means something was dropped or reordered). Any rejected frame leaves the
session unchanged, so the next genuine frame still opens.

Secrets: the private key, the X25519 shared secret and the two derived AES keys are never
stored as readable attributes, and neither ``repr``/``str`` of :class:`KeyPair` nor of
:class:`SecureSession` shows them (a key pair shows an 8-hex fingerprint of its *public* key,
a session its role, session-id fingerprint and counters). Nothing in this module logs.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

FRAME_VERSION = 1
DIR_INITIATOR_TO_RESPONDER = 0
DIR_RESPONDER_TO_INITIATOR = 1
PUBLIC_KEY_BYTES = 32
KEY_BYTES = 32  # AES-256
TAG_BYTES = 16  # AES-GCM tag
_HEADER = struct.Struct(">BBQ")  # version, direction, sequence number
HEADER_BYTES = _HEADER.size  # 10
FRAME_OVERHEAD = HEADER_BYTES + TAG_BYTES  # 26 bytes added to every plaintext
MAX_SEQ = 2**64 - 1
MAX_SESSION_ID_BYTES = 255
MAX_TRANSCRIPT_BYTES = 64  # a transcript hash bound into the keys (SHA-256: 32)
HKDF_INFO = b"edgefuse/v1"
_NONCE_PREFIX = b"\x00\x00\x00\x00"
_DIR_NAMES = {
    DIR_INITIATOR_TO_RESPONDER: "initiator->responder",
    DIR_RESPONDER_TO_INITIATOR: "responder->initiator",
}


class HandshakeError(ValueError):
    """Key agreement refused: malformed peer key, bad session id, or a degenerate shared secret."""


class FrameError(ValueError):
    """A frame was rejected (base class); the session is left unchanged."""


class TruncatedFrameError(FrameError):
    """The frame is shorter than header + tag (``FRAME_OVERHEAD`` bytes)."""


class ReplayError(FrameError):
    """An authentic frame whose sequence number was already received (replayed or stale)."""


class ReorderError(FrameError):
    """An authentic frame from ahead of the expected sequence number (a gap in the stream)."""


class TamperedFrameError(FrameError):
    """The AES-GCM tag did not verify: altered bytes, wrong key, or another session's frame."""


def _fingerprint(data: bytes) -> str:
    """First 8 hex chars of sha256(data): names a public value without printing it."""
    return hashlib.sha256(data).hexdigest()[:8]


class KeyPair:
    """An X25519 key pair (RFC 7748). Keep one per handshake; the private key never leaves.

    ``repr``/``str`` show only a fingerprint of the public key.
    """

    def __init__(self, private_key: X25519PrivateKey):
        self._private = private_key
        self._public = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    def public_bytes(self) -> bytes:
        """The raw 32-byte public key to send to the peer."""
        return self._public

    def __repr__(self) -> str:
        return f"KeyPair(public_fp={_fingerprint(self._public)})"

    __str__ = __repr__

    def exchange(self, peer_public: bytes) -> bytes:
        """The 32-byte X25519 shared secret with ``peer_public``; raises :class:`HandshakeError`."""
        if not isinstance(peer_public, (bytes, bytearray, memoryview)):
            raise HandshakeError(f"peer public key must be bytes, got {type(peer_public).__name__}")
        peer_public = bytes(peer_public)
        if len(peer_public) != PUBLIC_KEY_BYTES:
            raise HandshakeError(
                f"peer public key must be {PUBLIC_KEY_BYTES} bytes, got {len(peer_public)}"
            )
        try:
            shared = self._private.exchange(X25519PublicKey.from_public_bytes(peer_public))
        except ValueError as exc:  # the library refuses low-order points (all-zero secret)
            raise HandshakeError(f"peer public key is degenerate (low-order point): {exc}") from exc
        if shared == bytes(len(shared)):  # belt and braces: never key a session from zeros
            raise HandshakeError("X25519 shared secret is all zeros (low-order peer key)")
        return shared


def generate_keypair() -> KeyPair:
    """A fresh random X25519 key pair."""
    return KeyPair(X25519PrivateKey.generate())


def new_session_id(nbytes: int = 16) -> bytes:
    """A random session id (default 16 bytes) for one end to pick and send with its public key."""
    return os.urandom(nbytes)


def _hkdf(secret: bytes, salt: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=salt, info=info).derive(secret)


def derive_session(
    own: KeyPair, peer_public: bytes, session_id: bytes, initiator: bool,
    transcript: bytes = b"",
) -> SecureSession:
    """Agree on a :class:`SecureSession` with the peer.

    Both ends call this with their own key pair, the other's 32-byte public key, the same
    ``session_id`` (1–255 bytes, fresh per session, e.g. :func:`new_session_id`), and opposite
    ``initiator`` flags. HKDF-SHA256 with ``salt = session_id`` derives one 32-byte key per
    direction; ``info`` is ``b"edgefuse/v1"`` + the direction label + the initiator's and the
    responder's public keys (binding the keys to this exchange, as libsodium's ``crypto_kx``
    does) + ``transcript``.

    ``transcript``: the hash of the handshake messages so far (0–64 bytes; b"" = none). An
    authenticated handshake (:mod:`edgefuse.cloud.wire`, SIGMA-I) passes its transcript hash,
    so the keys of a session are bound to every handshake byte, the signed identities
    included, as TLS 1.3's key schedule binds the transcript (RFC 8446 §7.1).

    Raises :class:`HandshakeError` for a peer key that is not 32 bytes, a low-order peer key
    (all-zero shared secret), a peer key equal to our own (a reflected handshake), or a bad
    ``session_id``, a ``transcript`` that is not bytes or is over 64 bytes.
    """
    if not isinstance(transcript, (bytes, bytearray)) or len(transcript) > MAX_TRANSCRIPT_BYTES:
        raise HandshakeError(f"transcript must be 0..{MAX_TRANSCRIPT_BYTES} bytes")
    if not isinstance(session_id, (bytes, bytearray)) or not (
        1 <= len(session_id) <= MAX_SESSION_ID_BYTES
    ):
        raise HandshakeError(
            f"session_id must be 1..{MAX_SESSION_ID_BYTES} bytes, got {session_id!r:.40}"
        )
    session_id = bytes(session_id)
    shared = own.exchange(peer_public)
    peer_public = bytes(peer_public)
    if peer_public == own.public_bytes():
        raise HandshakeError("peer public key equals our own (reflected handshake)")
    init_pub, resp_pub = (
        (own.public_bytes(), peer_public) if initiator else (peer_public, own.public_bytes())
    )
    keys = {
        d: _hkdf(shared, session_id,
                 HKDF_INFO + b" " + name.encode() + init_pub + resp_pub + bytes(transcript))
        for d, name in _DIR_NAMES.items()
    }
    send_dir = DIR_INITIATOR_TO_RESPONDER if initiator else DIR_RESPONDER_TO_INITIATOR
    recv_dir = 1 - send_dir
    return SecureSession(
        session_id=session_id,
        initiator=bool(initiator),
        send_key=keys[send_dir],
        recv_key=keys[recv_dir],
    )


class SecureSession:
    """One end of an encrypted, ordered frame stream; built by :func:`derive_session`.

    Counters (frame bytes as they go on the wire, header and tag included):
    ``bytes_sent`` / ``frames_sent`` count every sealed frame; ``bytes_received`` /
    ``frames_received`` count accepted frames only; ``frames_rejected`` counts the rest.
    ``seal`` and ``open`` are thread-safe.

    The AES keys live only inside the two AES-GCM objects; ``repr``/``str`` show the role,
    a session-id fingerprint and the counters, never key bytes.
    """

    def __init__(self, session_id: bytes, initiator: bool, send_key: bytes, recv_key: bytes):
        self.session_id = bytes(session_id)
        self.initiator = initiator
        self.send_direction = DIR_INITIATOR_TO_RESPONDER if initiator else DIR_RESPONDER_TO_INITIATOR
        self.recv_direction = 1 - self.send_direction
        self._send = AESGCM(send_key)
        self._recv = AESGCM(recv_key)
        self._aad_prefix = struct.pack(">H", len(self.session_id)) + self.session_id
        self._next_send_seq = 0
        self._next_recv_seq = 0
        self._lock = threading.Lock()
        self.bytes_sent = 0
        self.bytes_received = 0
        self.frames_sent = 0
        self.frames_received = 0
        self.frames_rejected = 0

    def __repr__(self) -> str:
        role = "initiator" if self.initiator else "responder"
        return (f"SecureSession({role}, session_fp={_fingerprint(self.session_id)}, "
                f"sent={self.frames_sent}, received={self.frames_received}, "
                f"rejected={self.frames_rejected})")

    __str__ = __repr__

    @property
    def next_send_seq(self) -> int:
        """Sequence number the next sealed frame will carry."""
        return self._next_send_seq

    @property
    def next_recv_seq(self) -> int:
        """Sequence number the next accepted frame must carry."""
        return self._next_recv_seq

    @staticmethod
    def _nonce(seq: int) -> bytes:
        return _NONCE_PREFIX + seq.to_bytes(8, "big")

    def seal(self, plaintext: bytes) -> bytes:
        """Encrypt one message into a frame of ``len(plaintext) + FRAME_OVERHEAD`` bytes.

        Raises ``TypeError`` for a non-bytes plaintext and ``OverflowError`` once 2**64 frames
        have been sent (the nonce space is spent; start a new session).
        """
        if not isinstance(plaintext, (bytes, bytearray, memoryview)):
            raise TypeError(f"plaintext must be bytes, got {type(plaintext).__name__}")
        with self._lock:
            seq = self._next_send_seq
            if seq > MAX_SEQ:
                raise OverflowError("send sequence numbers exhausted; start a new session")
            header = _HEADER.pack(FRAME_VERSION, self.send_direction, seq)
            frame = header + self._send.encrypt(
                self._nonce(seq), bytes(plaintext), self._aad_prefix + header
            )
            self._next_send_seq = seq + 1
            self.bytes_sent += len(frame)
            self.frames_sent += 1
            return frame

    def open(self, frame: bytes) -> bytes:
        """Verify and decrypt the next frame of the peer's stream; returns the plaintext.

        Checks, in order: length (:class:`TruncatedFrameError`), version and direction bytes
        (:class:`FrameError`), the GCM tag over header and session id
        (:class:`TamperedFrameError`), then the sequence number against the expected one
        (:class:`ReplayError` if lower, :class:`ReorderError` if higher). The tag is checked
        before the sequence number, so replay/reorder errors are reported only for authentic
        frames. A rejected frame changes nothing but ``frames_rejected``.
        """
        if not isinstance(frame, (bytes, bytearray, memoryview)):
            raise TypeError(f"frame must be bytes, got {type(frame).__name__}")
        frame = bytes(frame)
        with self._lock:
            try:
                plaintext = self._check_and_decrypt(frame)
            except FrameError:
                self.frames_rejected += 1
                raise
            self._next_recv_seq += 1  # after seq MAX_SEQ no frame can match: stream is spent
            self.bytes_received += len(frame)
            self.frames_received += 1
            return plaintext

    def _check_and_decrypt(self, frame: bytes) -> bytes:
        if len(frame) < FRAME_OVERHEAD:
            raise TruncatedFrameError(
                f"frame is {len(frame)} bytes, shorter than header + tag ({FRAME_OVERHEAD} bytes)"
            )
        version, direction, seq = _HEADER.unpack_from(frame)
        if version != FRAME_VERSION:
            raise FrameError(f"unsupported frame version {version} (expected {FRAME_VERSION})")
        if direction != self.recv_direction:
            got = _DIR_NAMES.get(direction, f"unknown ({direction})")
            raise FrameError(
                f"frame direction is {got} but this end receives "
                f"{_DIR_NAMES[self.recv_direction]}"
            )
        header = frame[:HEADER_BYTES]
        try:
            plaintext = self._recv.decrypt(
                self._nonce(seq), frame[HEADER_BYTES:], self._aad_prefix + header
            )
        except InvalidTag:
            raise TamperedFrameError(
                f"frame (seq {seq}) failed authentication: altered bytes, wrong key, "
                "or a frame from another session"
            ) from None
        expected = self._next_recv_seq
        if seq < expected:
            raise ReplayError(f"replayed or stale frame: seq {seq}, expected {expected}")
        if seq > expected:
            raise ReorderError(
                f"out-of-order frame: seq {seq}, expected {expected} "
                f"({seq - expected} frame(s) missing before it)"
            )
        return plaintext
