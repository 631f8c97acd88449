"""Long-term identities and pinned trust: who an end is, and which ends it believes.

Every device and the cloud service hold one **Ed25519** identity key (RFC 8032, from
``cryptography``). It never encrypts anything: it only signs the *ephemeral* X25519 keys of a
handshake or exchange, so a recorded session stays sealed even if the identity key is stolen
later (forward secrecy comes from the ephemeral keys, authenticity from the signatures).

An end believes another only through its :class:`TrustStore`: a local JSON file of pinned
public keys by name (``cloud``, ``device-0``, …) written by the operator (:func:`provision`)
or by the end itself on first use. Nothing that arrives from the network adds a pin.

Names: :data:`CLOUD` for the cloud service, :func:`device_name` for a device by partition id.
Operators compare keys out of band by :func:`fingerprint` (one key) or :func:`safety_number`
(a pair of ends: the same number on both sides means neither key was swapped; the shape of
Signal's safety numbers: 60 digits, 12 groups of 5).

Layout written by :func:`provision` under one root::

    <root>/cloud/identity.key                 the service's Ed25519 private key (PEM, 0600)
    <root>/cloud/authorized_devices.json      trust store: the devices it serves
    <root>/devices/partition-<pid>/identity.key  (or identity.pub: a key made on the device)
    <root>/devices/partition-<pid>/trust.json trust store: the cloud and the other devices

A device may make its own key (:func:`load_identity` with ``create=True`` in its own folder,
``edgefuse keys new``) and hand the operator only the public part (:func:`register_public`,
``edgefuse keys register``): then no private key of that device ever exists on the
operator's machine.

Nothing in this module logs; ``repr`` of an :class:`Identity` shows its fingerprint only.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from edgefuse.io import atomic_write_bytes, atomic_write_json

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
CLOUD = "cloud"
IDENTITY_FILE = "identity.key"
PUBLIC_FILE = "identity.pub"
TRUST_FILE = "trust.json"
AUTHORIZED_FILE = "authorized_devices.json"
MAX_PINS = 4096
MAX_TRUST_FILE_BYTES = 1 << 20
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_TRUST_VERSION = 1


class IdentityError(ValueError):
    """A key, signature or trust file is malformed, or a signature does not verify."""


class UntrustedPeerError(IdentityError):
    """The peer's identity is not the one pinned for its name (or no key is pinned)."""


def device_name(partition_id: int) -> str:
    """The trust-store name of the device with this partition id: ``device-<pid>``."""
    pid = int(partition_id)
    if pid < 0:
        raise IdentityError(f"a partition id is >= 0, got {pid}")
    return f"device-{pid}"


_DEVICE_NAME = re.compile(r"^device-(0|[1-9][0-9]{0,8})$")


def check_device_name(name: str) -> str:
    """``name`` if it names a device (``device-<pid>``, as :func:`device_name` writes it);
    raises :class:`UntrustedPeerError` for anything else, the ``cloud`` pin included: a trust
    store pins the cloud and the devices side by side, and a device exchange must never be
    keyed by the cloud's (operator-held) identity."""
    if not isinstance(name, str) or not _DEVICE_NAME.match(name):
        raise UntrustedPeerError(f"{name!r:.80} does not name a device (device-<partition id>): "
                                 "refusing it as a peer")
    return name


def check_name(name: str) -> str:
    """``name`` if it is a valid trust-store name (1–64 of ``A-Za-z0-9._-``, not starting
    with a dot or dash); raises :class:`IdentityError` otherwise."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise IdentityError(f"bad identity name {name!r:.80}: 1-64 characters of A-Za-z0-9._-")
    return name


def _public(public: bytes) -> bytes:
    if not isinstance(public, (bytes, bytearray, memoryview)) or len(public) != PUBLIC_KEY_BYTES:
        raise IdentityError(f"an Ed25519 public key is {PUBLIC_KEY_BYTES} bytes, got "
                            f"{len(public) if isinstance(public, (bytes, bytearray, memoryview)) else type(public).__name__}")
    return bytes(public)


def public_from_hex(text: str) -> bytes:
    """A raw Ed25519 public key from its 64 hex characters (as ``keys new`` and a signed
    export print it). Raises :class:`IdentityError` for anything else."""
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raise IdentityError("the public key must be 64 hex characters") from None
    return _public(raw)


def fingerprint(public: bytes) -> str:
    """A key's fingerprint to read aloud: the first 16 bytes of SHA-256 of the raw 32-byte
    public key, hex in 8 groups of 4 (e.g. ``"3f2a 9c01 …"``)."""
    h = hashlib.sha256(b"edgefuse-identity-v1" + _public(public)).hexdigest()[:32]
    return " ".join(h[i:i + 4] for i in range(0, 32, 4))


def safety_number(public_a: bytes, public_b: bytes) -> str:
    """The safety number of two ends: 60 digits in 12 groups of 5, the same whichever end
    computes it. Each key gives 30 digits (six 5-byte chunks of SHA-512 of the key, each
    mod 100000); the halves are ordered so the number does not depend on who asks."""
    def half(pub: bytes) -> str:
        digest = hashlib.sha512(b"edgefuse-safety-v1" + _public(pub)).digest()
        return "".join(f"{int.from_bytes(digest[i:i + 5], 'big') % 100000:05d}"
                       for i in range(0, 30, 5))

    a, b = sorted([half(public_a), half(public_b)])
    digits = a + b
    return " ".join(digits[i:i + 5] for i in range(0, 60, 5))


def verify_signature(public: bytes, signature: bytes, message: bytes) -> None:
    """Check an Ed25519 ``signature`` (64 bytes) of ``message`` by ``public`` (32 bytes).

    Raises :class:`IdentityError` for a malformed key or signature, or one that does not
    verify."""
    if not isinstance(signature, (bytes, bytearray)) or len(signature) != SIGNATURE_BYTES:
        raise IdentityError(f"an Ed25519 signature is {SIGNATURE_BYTES} bytes")
    try:
        Ed25519PublicKey.from_public_bytes(_public(public)).verify(bytes(signature), bytes(message))
    except InvalidSignature:
        raise IdentityError("signature does not verify") from None
    except ValueError as exc:
        raise IdentityError(f"bad Ed25519 public key: {exc}") from None


class Identity:
    """An Ed25519 identity key pair. Build with :meth:`generate` or :func:`load_identity`."""

    def __init__(self, private_key: Ed25519PrivateKey):
        self._private = private_key
        self._public = private_key.public_key().public_bytes(serialization.Encoding.Raw,
                                                             serialization.PublicFormat.Raw)

    @classmethod
    def generate(cls) -> Identity:
        """A fresh random identity (kept in memory; :meth:`save` writes it)."""
        return cls(Ed25519PrivateKey.generate())

    def public_bytes(self) -> bytes:
        """The raw 32-byte public key."""
        return self._public

    @property
    def fingerprint(self) -> str:
        """:func:`fingerprint` of the public key."""
        return fingerprint(self._public)

    def sign(self, message: bytes) -> bytes:
        """The 64-byte Ed25519 signature of ``message``."""
        return self._private.sign(bytes(message))

    def save(self, path: str | os.PathLike) -> Path:
        """Write the private key as unencrypted PKCS#8 PEM, atomically, mode 0600."""
        pem = self._private.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption())
        return atomic_write_bytes(path, pem, mode=0o600)

    def __repr__(self) -> str:
        return f"Identity(fingerprint={self.fingerprint!r})"

    __str__ = __repr__


def load_identity(path: str | os.PathLike, create: bool = False) -> Identity:
    """The identity stored at ``path`` (PKCS#8 PEM, as :meth:`Identity.save` writes).

    ``create``: make and save a new one when the file does not exist.
    Raises :class:`IdentityError` if the file is missing (and not ``create``), is not an
    Ed25519 private key, or is readable by group or others (a key file is 0600)."""
    path = Path(path)
    if not path.exists():
        if not create:
            raise IdentityError(f"no identity key at {path}")
        ident = Identity.generate()
        ident.save(path)
        return ident
    if os.name == "posix" and path.stat().st_mode & 0o077:
        raise IdentityError(f"identity key {path} is readable by others "
                            f"(mode {path.stat().st_mode & 0o777:o}); chmod 600 it")
    try:
        key = serialization.load_pem_private_key(path.read_bytes()[:MAX_TRUST_FILE_BYTES],
                                                 password=None)
    except (ValueError, TypeError) as exc:
        raise IdentityError(f"identity key {path} does not parse: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise IdentityError(f"identity key {path} is not an Ed25519 key")
    return Identity(key)


class TrustStore:
    """Pinned Ed25519 public keys by name, kept in one JSON file.

    File format: ``{"version": 1, "pins": {"<name>": "<64 hex>", ...}}``. A missing file is
    an empty store. :meth:`pin` refuses to change an existing pin unless ``replace=True``
    (an operator's decision, never the network's).
    """

    def __init__(self, pins: dict[str, bytes] | None = None, path: Path | None = None):
        self._pins = dict(pins or {})
        self.path = path

    @classmethod
    def load(cls, path: str | os.PathLike) -> TrustStore:
        """The store at ``path`` (empty if absent). Raises :class:`IdentityError` for a
        file that is too large, not this format, or holds a bad name or key."""
        path = Path(path)
        if not path.exists():
            return cls({}, path)
        raw = path.read_bytes()
        if len(raw) > MAX_TRUST_FILE_BYTES:
            raise IdentityError(f"trust store {path} is over {MAX_TRUST_FILE_BYTES} bytes")
        try:
            doc = json.loads(raw)
            if doc.get("version") != _TRUST_VERSION or not isinstance(doc.get("pins"), dict):
                raise ValueError(f"expected version {_TRUST_VERSION} with a 'pins' object")
            if len(doc["pins"]) > MAX_PINS:
                raise ValueError(f"more than {MAX_PINS} pins")
            pins = {check_name(k): _public(bytes.fromhex(v)) for k, v in doc["pins"].items()}
        except (ValueError, TypeError, AttributeError, IdentityError) as exc:
            raise IdentityError(f"trust store {path} is malformed: {exc}") from None
        return cls(pins, path)

    def names(self) -> list[str]:
        """The pinned names, sorted."""
        return sorted(self._pins)

    def get(self, name: str) -> bytes:
        """The key pinned for ``name``; raises :class:`UntrustedPeerError` if none is."""
        check_name(name)
        if name not in self._pins:
            where = f" in {self.path}" if self.path else ""
            raise UntrustedPeerError(f"no key is pinned for {name!r}{where}")
        return self._pins[name]

    def check(self, name: str, public: bytes) -> None:
        """Raise :class:`UntrustedPeerError` unless ``public`` is the key pinned for ``name``."""
        pinned = self.get(name)
        if _public(public) != pinned:
            raise UntrustedPeerError(
                f"{name!r} presented key {fingerprint(public)}, but {fingerprint(pinned)} is "
                "pinned for it: refusing (a relay or man-in-the-middle may have swapped it)")

    def find(self, public: bytes) -> str | None:
        """The name ``public`` is pinned under, or None."""
        public = _public(public)
        return next((n for n, k in self._pins.items() if k == public), None)

    def pin(self, name: str, public: bytes, replace: bool = False) -> None:
        """Pin ``public`` for ``name`` (in memory; :meth:`save` writes it). Raises
        :class:`UntrustedPeerError` if another key is pinned for it and not ``replace``."""
        check_name(name)
        public = _public(public)
        if not replace and self._pins.get(name, public) != public:
            raise UntrustedPeerError(f"{name!r} is already pinned to {fingerprint(self._pins[name])}")
        if name not in self._pins and len(self._pins) >= MAX_PINS:
            raise IdentityError(f"a trust store holds at most {MAX_PINS} pins")
        self._pins[name] = public

    def save(self, path: str | os.PathLike | None = None) -> Path:
        """Write the store atomically to ``path`` (default: where it was loaded from)."""
        path = Path(path) if path is not None else self.path
        if path is None:
            raise IdentityError("this trust store has no path to save to")
        self.path = path
        return atomic_write_json(path, {"version": _TRUST_VERSION,
                                        "pins": {k: v.hex() for k, v in sorted(self._pins.items())}})


MAX_DEVICES = 4096  # partition ids 0 .. MAX_DEVICES - 1 (as many as `edgefuse deploy` makes)


def device_dir(root: str | os.PathLike, partition_id: int) -> Path:
    """Where :func:`provision` keeps the device ``partition_id``'s identity and trust store.
    Raises :class:`IdentityError` for an id outside 0 .. ``MAX_DEVICES`` - 1."""
    if not 0 <= int(partition_id) < MAX_DEVICES:
        raise IdentityError(f"partition id must be in 0..{MAX_DEVICES - 1}, got {partition_id}")
    return Path(root) / "devices" / f"partition-{int(partition_id)}"


def cloud_dir(root: str | os.PathLike) -> Path:
    """Where :func:`provision` keeps the cloud service's identity and authorized devices."""
    return Path(root) / "cloud"


def register_public(root: str | os.PathLike, partition_id: int, public: bytes) -> Path:
    """Record a key the device made itself: ``<root>/devices/partition-<pid>/identity.pub``
    (64 hex + newline); :func:`provision` then pins it instead of making a key for it.

    Raises :class:`IdentityError` for a malformed key, or if the operator already holds a
    private key for that device (``identity.key``) with another public key."""
    public = _public(public)
    folder = device_dir(root, partition_id)
    key_file = folder / IDENTITY_FILE
    if key_file.exists() and load_identity(key_file).public_bytes() != public:
        raise IdentityError(f"{key_file} holds another key for {device_name(partition_id)}; "
                            "remove it first to register the device's own key")
    return atomic_write_bytes(folder / PUBLIC_FILE, public.hex().encode() + b"\n", mode=0o644)


def read_public(folder: str | os.PathLike) -> bytes:
    """The public key of the identity kept in ``folder``: its ``identity.key``, else its
    registered ``identity.pub``. Raises :class:`IdentityError` if neither is there or the
    one there is malformed."""
    folder = Path(folder)
    if (folder / IDENTITY_FILE).exists():
        return load_identity(folder / IDENTITY_FILE).public_bytes()
    pub_file = folder / PUBLIC_FILE
    if not pub_file.exists():
        raise IdentityError(f"no identity in {folder} ({IDENTITY_FILE} or {PUBLIC_FILE})")
    try:
        return _public(bytes.fromhex(pub_file.read_bytes()[:200].decode().strip()))
    except (ValueError, UnicodeDecodeError) as exc:
        raise IdentityError(f"{pub_file} is not a 64-hex Ed25519 public key: {exc}") from None


def _device_public(root: Path, partition_id: int) -> bytes:
    """The device's registered public key, else its (kept or new) operator-made identity's."""
    folder = device_dir(root, partition_id)
    if (folder / PUBLIC_FILE).exists() or (folder / IDENTITY_FILE).exists():
        return read_public(folder)
    return load_identity(folder / IDENTITY_FILE, create=True).public_bytes()


def provision(root: str | os.PathLike, num_partitions: int) -> dict[str, str]:
    """The operator's step: make (or keep) the cloud's and every device's identity under
    ``root`` and write the trust stores that pin them (layout in the module docstring).

    Existing identities are kept, so running it again changes nothing; a device whose own
    public key was registered (:func:`register_public`) gets no key made for it. A device's
    trust store is rewritten with the current keys of the cloud and of every other device
    (pins of other names it holds are kept). Returns ``{name: fingerprint}``.
    Raises :class:`IdentityError` for ``num_partitions`` outside 1 .. ``MAX_DEVICES`` or a
    bad existing key file.
    """
    if not 1 <= int(num_partitions) <= MAX_DEVICES:
        raise IdentityError(f"num_partitions must be in 1..{MAX_DEVICES}, got {num_partitions}")
    root = Path(root)
    cloud = load_identity(cloud_dir(root) / IDENTITY_FILE, create=True)
    devices = {device_name(p): _device_public(root, p) for p in range(int(num_partitions))}
    authorized = TrustStore.load(cloud_dir(root) / AUTHORIZED_FILE)
    for name, public in devices.items():
        authorized.pin(name, public, replace=True)
    authorized.save()
    for pid in range(int(num_partitions)):
        store = TrustStore.load(device_dir(root, pid) / TRUST_FILE)
        store.pin(CLOUD, cloud.public_bytes(), replace=True)
        for name, public in devices.items():
            store.pin(name, public, replace=True)
        store.save()
    return {CLOUD: cloud.fingerprint, **{n: fingerprint(p) for n, p in devices.items()}}
