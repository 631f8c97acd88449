"""Authenticated keys for one Cache-to-Cache exchange relayed by an untrusted server.

The pattern is the *signed prekey* of Signal's X3DH, simplified to one signed ephemeral key
per side (no one-time prekeys, no identity-key Diffie-Hellman):

- **Signed prekey** (:func:`sign_prekey`): each device makes a fresh X25519 key per run, kept
  in memory only; its Ed25519 identity (:mod:`edgefuse.transport.identity`) signs
  ``PREKEY_DOMAIN ‖ name ‖ prekey ‖ run id``. The server relays the public key, the
  identity key and the signature (``query.info``).
- **Sharer** (:func:`seal_for`): checks that the identity forwarded for the receiver is the
  one pinned for the receiver's name in the sharer's *own* trust store and that the prekey
  signature verifies for this run; makes a fresh ephemeral X25519 key ``E``; derives the
  session from ``X25519(E, prekey)``; signs ``SHARE_DOMAIN ‖ E ‖ prekey ‖ session id ‖ both
  names``; and drops ``E``'s private part before returning. ``E`` and the signature
  (:data:`HANDSHAKE_BYTES` = 96 bytes, :class:`Handshake`) travel with the sealed frames.
- **Receiver** (:func:`open_from`): checks the sharer's forwarded identity against its pin
  and the signature over ``E`` with the *pinned* key, then derives the same session with
  its prekey's private part.

Session keys: HKDF-SHA256 (RFC 5869), ``salt`` = session id, ``info`` = ``SESSION_INFO ‖
direction ‖ E ‖ prekey ‖ sharer identity ‖ receiver identity ‖ names ‖ session id``
(length-prefixed), one AES-256-GCM key per direction for
:class:`edgefuse.transport.crypto.SecureSession`; the sharer is the initiator. Frames then
carry the session's own replay, reorder and tamper checks.

What it gives: a relay that swaps a prekey, an identity or an ephemeral key is refused
(:class:`~edgefuse.transport.identity.UntrustedPeerError`, naming the peer and both
fingerprints); it cannot open a payload (it holds no private key of the exchange) nor
re-seal an altered one (it cannot sign for the sharer). Forward secrecy: once the sharer
dropped ``E`` and the receiver dropped its prekey (at the end of the run's C2C phase), a
recording cannot be opened even with both devices' identity keys, which only ever sign.
What it does not give: the relay still picks who talks to whom and may drop or delay
payloads. (A replay of a recorded exchange is refused by the receiving device, which opens
each signed ephemeral key once: :mod:`edgefuse.app.handlers.c2c`.)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from edgefuse.transport.crypto import (DIR_INITIATOR_TO_RESPONDER, DIR_RESPONDER_TO_INITIATOR,
                                       MAX_SESSION_ID_BYTES, HandshakeError, KeyPair,
                                       SecureSession, generate_keypair)
from edgefuse.transport.identity import (PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Identity,
                                         IdentityError, TrustStore, UntrustedPeerError,
                                         check_device_name, check_name, fingerprint,
                                         verify_signature)

PREKEY_DOMAIN = b"edgefuse-c2c-prekey-v1"
SHARE_DOMAIN = b"edgefuse-c2c-share-v1"
SESSION_INFO = b"edgefuse-c2c-session-v1"
HANDSHAKE_BYTES = PUBLIC_KEY_BYTES + SIGNATURE_BYTES  # what a sharer adds to its frames: 96
_KEY_BYTES = 32
_DIRS = {DIR_INITIATOR_TO_RESPONDER: b"sharer->receiver", DIR_RESPONDER_TO_INITIATOR: b"receiver->sharer"}


def _lp(data: bytes) -> bytes:
    """``data`` with a 2-byte big-endian length in front (fields never run into each other)."""
    return struct.pack(">H", len(data)) + data


def _key(value, what: str, size: int = PUBLIC_KEY_BYTES) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)) or len(value) != size:
        got = len(value) if isinstance(value, (bytes, bytearray, memoryview)) else type(value).__name__
        raise UntrustedPeerError(f"{what} must be {size} bytes, got {got}")
    return bytes(value)


def _sid(session_id) -> bytes:
    if not isinstance(session_id, (bytes, bytearray)) or not 1 <= len(session_id) <= MAX_SESSION_ID_BYTES:
        raise HandshakeError(f"a session id is 1..{MAX_SESSION_ID_BYTES} bytes")
    return bytes(session_id)


def prekey_message(name: str, prekey: bytes, run_id: int) -> bytes:
    """What a device's identity signs for its run prekey: ``PREKEY_DOMAIN ‖ name ‖ prekey ‖
    run id`` (names length-prefixed, run id unsigned 64-bit)."""
    return (PREKEY_DOMAIN + _lp(check_name(name).encode()) + _key(prekey, "a prekey")
            + struct.pack(">Q", int(run_id) & (2**64 - 1)))


def sign_prekey(identity: Identity, name: str, prekey: bytes, run_id: int) -> bytes:
    """The 64-byte signature by ``identity`` of :func:`prekey_message`."""
    return identity.sign(prekey_message(name, prekey, run_id))


def share_message(ephemeral: bytes, prekey: bytes, session_id: bytes, sharer: str, receiver: str) -> bytes:
    """What a sharer's identity signs for one exchange: ``SHARE_DOMAIN ‖ ephemeral ‖ receiver
    prekey ‖ session id ‖ sharer name ‖ receiver name`` (variable fields length-prefixed)."""
    return (SHARE_DOMAIN + _key(ephemeral, "an ephemeral key") + _key(prekey, "a prekey")
            + _lp(_sid(session_id)) + _lp(check_name(sharer).encode()) + _lp(check_name(receiver).encode()))


@dataclass(frozen=True)
class PeerPrekey:
    """A peer's signed prekey as the relay forwarded it (nothing in it is trusted yet).

    Attributes:
        name: the peer's trust-store name (``device-<pid>``).
        identity: the Ed25519 identity key the relay says is the peer's (32 bytes).
        prekey: the peer's X25519 prekey for this run (32 bytes).
        signature: the identity's signature of :func:`prekey_message` (64 bytes).
    """

    name: str
    identity: bytes
    prekey: bytes
    signature: bytes


@dataclass(frozen=True)
class Handshake:
    """What a sharer sends beside its sealed frames (:data:`HANDSHAKE_BYTES` on the wire):
    its ephemeral X25519 public key (32 bytes) and its identity's signature of
    :func:`share_message` (64 bytes)."""

    ephemeral: bytes
    signature: bytes

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: 96."""
        return len(self.ephemeral) + len(self.signature)


def check_identity(trust: TrustStore, name: str, presented: bytes) -> bytes:
    """The key pinned for ``name`` once ``presented`` (the key the relay forwarded) is it.

    Raises:
        UntrustedPeerError: ``name`` is not a device's (``device-<pid>``: the ``cloud`` pin is
            never a peer), no pin for it, or ``presented`` is another key (the message names
            the peer, the presented and the pinned fingerprints).
    """
    pinned = trust.get(check_device_name(name))
    presented = _key(presented, f"the identity key forwarded for {name!r}")
    if presented != pinned:
        raise UntrustedPeerError(
            f"{name!r}: the relay forwarded identity {fingerprint(presented)}, but "
            f"{fingerprint(pinned)} is pinned for it: refusing the exchange (a swapped key)")
    return pinned


def check_prekey(trust: TrustStore, peer: PeerPrekey, run_id: int) -> None:
    """Refuse ``peer``'s prekey unless its identity is the pinned one and the pinned key
    signed this prekey for ``peer.name`` in run ``run_id``.

    Raises:
        UntrustedPeerError: unpinned or swapped identity (:func:`check_identity`), a
            malformed key or signature, or a signature that does not verify (a swapped
            prekey, or one of another run); the message names the peer and the fingerprints.
    """
    pinned = check_identity(trust, peer.name, peer.identity)
    prekey = _key(peer.prekey, f"the prekey forwarded for {peer.name!r}")
    signature = _key(peer.signature, f"the prekey signature of {peer.name!r}", SIGNATURE_BYTES)
    try:
        verify_signature(pinned, signature, prekey_message(peer.name, prekey, run_id))
    except IdentityError:
        raise UntrustedPeerError(
            f"{peer.name!r}: prekey {fingerprint(prekey)} is not signed for run {run_id} by its "
            f"pinned identity {fingerprint(pinned)} (forwarded identity "
            f"{fingerprint(peer.identity)}): refusing the exchange (a swapped or stale prekey)") from None


def _derive(shared: bytes, session_id: bytes, ephemeral: bytes, prekey: bytes, sharer_id: bytes,
            receiver_id: bytes, sharer: str, receiver: str, initiator: bool) -> SecureSession:
    bound = (ephemeral + prekey + sharer_id + receiver_id + _lp(sharer.encode())
             + _lp(receiver.encode()) + _lp(session_id))
    keys = {d: HKDF(algorithm=hashes.SHA256(), length=_KEY_BYTES, salt=session_id,
                    info=SESSION_INFO + _lp(label) + bound).derive(shared)
            for d, label in _DIRS.items()}
    send = DIR_INITIATOR_TO_RESPONDER if initiator else DIR_RESPONDER_TO_INITIATOR
    return SecureSession(session_id, initiator, send_key=keys[send], recv_key=keys[1 - send])


def seal_for(own: Identity, own_name: str, trust: TrustStore, peer: PeerPrekey,
             session_id: bytes, run_id: int) -> tuple[SecureSession, Handshake]:
    """Sharer side: check ``peer`` (:func:`check_prekey`), then open a fresh session to it.

    Args:
        own: this device's identity; ``own_name``: its trust-store name.
        trust: this device's own trust store (never one from the network).
        peer: the receiver's signed prekey as relayed.
        session_id: 1–255 bytes chosen by the relay (bound into the keys and the signature).
        run_id: this device's run id (the prekey must be signed for it).

    Returns:
        ``(session, handshake)``: seal the payloads with ``session`` (this end is the
        initiator) and send ``handshake`` with them. The ephemeral private key is gone
        when this returns.

    Raises:
        UntrustedPeerError: see :func:`check_prekey`.
        HandshakeError: a bad session id, or a degenerate (low-order) prekey.
    """
    session_id = _sid(session_id)
    check_prekey(trust, peer, run_id)
    ephemeral = generate_keypair()
    try:
        shared = ephemeral.exchange(peer.prekey)
        e_pub = ephemeral.public_bytes()
    finally:
        del ephemeral  # forward secrecy: drop the one reference to the private key
    session = _derive(shared, session_id, e_pub, bytes(peer.prekey), own.public_bytes(),
                      bytes(peer.identity), check_name(own_name), peer.name, initiator=True)
    signature = own.sign(share_message(e_pub, peer.prekey, session_id, own_name, peer.name))
    return session, Handshake(e_pub, signature)


def open_from(own: Identity, own_name: str, prekey: KeyPair, trust: TrustStore, sharer: str,
              sharer_identity: bytes, handshake: Handshake, session_id: bytes) -> SecureSession:
    """Receiver side: check the sharer's handshake, then derive the session its frames are
    sealed under.

    Args:
        own, own_name: this device's identity and name.
        prekey: this device's prekey for the run (its private part).
        trust: this device's own trust store.
        sharer: the sharer's name; ``sharer_identity``: the identity key the relay forwarded
            for it (compared with the pin, only to name both fingerprints on refusal).
        handshake: the sharer's ephemeral key and signature, as relayed.
        session_id: the session id the relay says the frames use.

    Returns:
        The session (this end is the responder): open the frames with it.

    Raises:
        UntrustedPeerError: the forwarded identity is not the pinned one, the ephemeral key
            or signature is malformed, or the signature does not verify with the pinned key
            (a swapped ephemeral key, session id, or prekey).
        HandshakeError: a bad session id or a degenerate ephemeral key.
    """
    session_id = _sid(session_id)
    pinned = check_identity(trust, sharer, sharer_identity)
    e_pub = _key(handshake.ephemeral, f"the ephemeral key forwarded for {sharer!r}")
    sig = _key(handshake.signature, f"the exchange signature of {sharer!r}", SIGNATURE_BYTES)
    try:
        verify_signature(pinned, sig, share_message(e_pub, prekey.public_bytes(), session_id,
                                                    sharer, own_name))
    except IdentityError:
        raise UntrustedPeerError(
            f"{sharer!r}: ephemeral key {fingerprint(e_pub)} is not signed for this exchange by "
            f"its pinned identity {fingerprint(pinned)} (forwarded identity "
            f"{fingerprint(sharer_identity)}): refusing to open its payloads (a swapped key "
            "or a re-sealed payload)") from None
    shared = prekey.exchange(e_pub)
    return _derive(shared, session_id, e_pub, prekey.public_bytes(), pinned, own.public_bytes(),
                   sharer, check_name(own_name), initiator=False)


__all__ = ["PREKEY_DOMAIN", "SHARE_DOMAIN", "SESSION_INFO", "HANDSHAKE_BYTES", "PeerPrekey",
           "Handshake", "prekey_message", "sign_prekey", "share_message", "check_identity",
           "check_prekey", "seal_for", "open_from"]
