"""The server-hosted fuser registry: versioned C2C fusers saved as safetensors + JSON.

A fuser reads KV caches, and a model's KV cache depends on its base weights *and* its LoRA
adapter, so a fuser is only valid for the exact models it was trained against. A fuser
version is therefore the triple

    (sharer spec + adapter hash, receiver spec + adapter hash, fuser config hash)

(:class:`FuserVersion`; ``adapter_hash(None) == "base"`` for a model without adapter). Three
separate things are saved per version, in formats other tools read::

    root/<sharer>__to__<receiver>/
        latest                    the current version id of the pair (one line, replaced atomically)
        <version id>/
            fuser.safetensors     the weights (float32, torch state-dict keys)
            config.json           the fuser config the weights belong to (its hash is in the id)
            card.json             the fuser card: version, sizes, data, steps, scores, sha256s

Spec names are percent-encoded in folder names (``HuggingFaceTB/SmolLM2-135M`` ->
``HuggingFaceTB%2FSmolLM2-135M``). A version is built in a hidden temporary sibling folder and
renamed into place, so a reader never sees half of one; folders starting with ``.`` are not
versions.

Refusals: a client asks for the fuser of its pair with its own :class:`ModelVersion`\\ s
(:meth:`FuserRegistry.load_for`). When the registered fuser was trained for another spec or
another adapter, :class:`FuserVersionError` says which side (sharer / receiver) and what
(spec / adapter hash), expected vs got, and nothing is loaded. A weights file that does not
match the sha256 the card recorded at save time, or does not parse, raises
:class:`FuserIntegrityError` (a :class:`FuserVersionError`): catching ``FuserVersionError``
catches every "do not apply this fuser".

Import / export: :meth:`FuserRegistry.export` writes one version as a POSIX ustar archive of
its three files, plus ``signature.json`` when it is given a signing identity: an Ed25519
signature (:mod:`edgefuse.transport.identity`) by a named exporter over the sha256 of each
of the three files (:func:`archive_message`). :meth:`FuserRegistry.import_` registers such an
archive (e.g. a fuser trained on a GPU machine) only after checking the signature against
the exporter's key pinned in a :class:`~edgefuse.transport.identity.TrustStore` (an
unsigned archive only when explicitly allowed), the archive's structure and sizes, the
card, the config and the weights against a reference fuser built from the card's model
specs; an imported version whose models and config are a run's is then served as
``cached`` (:mod:`edgefuse.c2c.hub`). Refusals raise :class:`FuserArchiveError`. The
signature is checked at import and not kept: the registry folder itself is trusted.

Retraining rule (:func:`needs_retrain`): retrain a pair's fuser when the relative change of
the adapters' effective update ``ΔW = B A``, over all modules together, exceeds a threshold
(default 5 %), or when an adapter appears, disappears or changes structure. Why: the fuser
learned a projection between the two models' KV spaces; an adapter that moves ``ΔW`` a little
moves the caches a little and the learned projection stays valid (the fuser's own gates and
residual form absorb small shifts), while retraining every round for every pair would cost
the server ``O(pairs)`` trainings per round for no measurable gain. A large change (or a new
adapter on a base model) moves the caches out of what the fuser saw.

For the wire (Flower's ``ArrayRecord`` sends every array separately), :func:`pack_state`
packs a fuser state dict into one flat float32 array plus a JSON index. It does not reuse
:func:`edgefuse.lora.pack_adapter`: that one validates keys as ``lora_A``/``lora_B``
weights, and a fuser's keys are ``layers.0.key.down.weight`` and the like.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import quote

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from edgefuse import packing
from edgefuse.io import atomic_write_dir
from edgefuse.aggregation import module_shapes, split_key
from edgefuse.lora import adapter_hash, state_digest  # noqa: F401  (re-exported)
from edgefuse.transport.identity import (Identity, IdentityError, TrustStore, UntrustedPeerError,
                                         check_name, fingerprint, verify_signature)

__all__ = [
    "ARCHIVE_MEMBERS", "DEFAULT_SIGNER", "FORMAT_VERSION", "MAX_SIGNATURE_BYTES",
    "MAX_WEIGHTS_BYTES", "PACK_PART", "SIGNATURE", "FuserArchiveError", "FuserCard",
    "FuserIntegrityError", "FuserRegistry", "FuserVersion", "FuserVersionError", "ModelVersion",
    "adapter_change", "adapter_hash", "archive_message", "check_received", "config_hash",
    "needs_retrain", "pack_state", "state_digest", "trained_on", "unpack_state",
]

FORMAT_VERSION = 2       # of the saved folder; a card from a newer edgefuse is refused
# Format history: 1 = the first cards; 2 adds ``trained_on`` (a format-1 card loads with it
# empty). Every other field and the folder layout are unchanged.
PACK_PART = "fuser"      # name of the one flat array pack_state returns
WEIGHTS, CONFIG, CARD, LATEST = "fuser.safetensors", "config.json", "card.json", "latest"
_ID = re.compile(r"^[0-9a-f]{16}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_EPS = 1e-12
ARCHIVE_MEMBERS = (CARD, CONFIG, WEIGHTS)  # the members of an exported fuser, in this order
MAX_CARD_BYTES = 64 * 1024
MAX_CONFIG_BYTES = 64 * 1024
MAX_WEIGHTS_BYTES = 2 * 1024 ** 3  # default cap on an imported weights file (≈ 500 M params)
SIGNATURE = "signature.json"       # the optional 4th member of an archive: the exporter's signature
MAX_SIGNATURE_BYTES = 4 * 1024
SIGNATURE_FORMAT = 1
DEFAULT_SIGNER = "exporter"        # the signer name of a signed export when none is given
_SIGNED_PREFIX = b"edgefuse fuser archive v1\x00"  # domain separation of the signed message
_HEX64, _HEX128 = re.compile(r"^[0-9a-f]{64}$"), re.compile(r"^[0-9a-f]{128}$")
_SAFETENSORS_SLACK = 16 * 1024      # header allowance above 4 bytes per parameter (+256 per tensor)


class FuserVersionError(ValueError):
    """A fuser that must not be applied: wrong versions for the client's models, or (as
    :class:`FuserIntegrityError`) corrupted files. The message says why."""


class FuserIntegrityError(FuserVersionError):
    """A saved fuser whose files are corrupted or tampered with (sha256, parse, consistency)."""


# ------------------------------------------------------------------------- hashing


def _canonical_json(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def config_hash(fuser_config: dict) -> str:
    """sha256 (hex, first 12) of the config as canonical JSON (sorted keys, no spaces), so
    key order does not matter.

    Raises:
        ValueError: the config is not JSON-serialisable (or holds NaN/Inf).
    """
    try:
        text = _canonical_json(fuser_config)
    except (TypeError, ValueError) as e:
        raise ValueError(f"fuser config is not JSON-serialisable: {e}") from None
    return hashlib.sha256(text.encode()).hexdigest()[:12]


# ------------------------------------------------------------------------- versions and cards


@dataclass(frozen=True)
class ModelVersion:
    """One side of a pair: the model spec (registry name, hub id or folder) and the hash of
    its LoRA adapter (:func:`adapter_hash`, ``"base"`` without adapter)."""

    spec: str
    adapter_hash: str

    def __post_init__(self):
        for name in ("spec", "adapter_hash"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"ModelVersion.{name} must be a non-empty string, "
                                 f"got {getattr(self, name)!r}")


@dataclass(frozen=True)
class FuserVersion:
    """What a fuser was trained for: sharer, receiver and the fuser config's hash."""

    sharer: ModelVersion
    receiver: ModelVersion
    config_hash: str

    @property
    def id(self) -> str:
        """16 hex chars: sha256 of the canonical JSON of :meth:`to_dict` (stable across runs)."""
        return hashlib.sha256(_canonical_json(self.to_dict()).encode()).hexdigest()[:16]

    def to_dict(self) -> dict:
        return {"sharer": dataclasses.asdict(self.sharer),
                "receiver": dataclasses.asdict(self.receiver), "config_hash": self.config_hash}

    @classmethod
    def from_dict(cls, d: dict) -> FuserVersion:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: missing or unknown keys, or empty strings.
        """
        try:
            if set(d) != {"sharer", "receiver", "config_hash"}:
                raise ValueError(f"keys {sorted(d)}")
            return cls(ModelVersion(**d["sharer"]), ModelVersion(**d["receiver"]),
                       d["config_hash"])
        except (TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"malformed fuser version {d!r}: {e}") from None


@dataclass
class FuserCard:
    """What is known about one saved fuser (``card.json``); JSON-serialisable.

    Made with :meth:`for_version` by the trainer; :meth:`FuserRegistry.save` fills ``params``,
    ``bytes``, ``weights_sha256``, ``state_sha256`` and ``created`` (when empty).

    Attributes:
        sharer_spec, sharer_adapter_hash, receiver_spec, receiver_adapter_hash, config_hash:
            the :class:`FuserVersion` (see :attr:`version`).
        version_id: ``FuserVersion.id``.
        pair: ``"<sharer>__to__<receiver>"`` (the pair's folder name).
        train_steps, train_examples: optimizer steps and distinct training prompts.
        data: free-text description of the training data (public set, split, size).
        scores: evaluation scores by name (e.g. ``{"val_loss": 2.1, "base_val_loss": 2.4}``).
        params: parameter count; bytes: the weights as float32 (the download size).
        weights_sha256: sha256 of ``fuser.safetensors`` at save time.
        state_sha256: :func:`state_digest` of the weights (checks a state received by wire).
        created: ISO-8601 UTC time of the save.
        trained_on: where the weights were trained, as short strings: ``host``, ``device``
            (``cpu``, ``cuda:0 (NVIDIA H200)``...), ``torch`` (version) and ``dtype`` (of the
            weights while training; they are saved as float32). Filled by
            :meth:`FuserRegistry.save` when empty; ``{}`` on a format-1 card.
        format_version: :data:`FORMAT_VERSION` of the writer.
    """

    sharer_spec: str
    sharer_adapter_hash: str
    receiver_spec: str
    receiver_adapter_hash: str
    config_hash: str
    version_id: str
    pair: str
    train_steps: int = 0
    train_examples: int = 0
    data: str = ""
    scores: dict[str, float | None] = field(default_factory=dict)
    params: int = 0
    bytes: int = 0
    weights_sha256: str = ""
    state_sha256: str = ""
    created: str = ""
    trained_on: dict[str, str] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    @classmethod
    def for_version(cls, version: FuserVersion, *, train_steps: int = 0, train_examples: int = 0,
                    data: str = "", scores: dict | None = None,
                    trained_on: dict[str, str] | None = None) -> FuserCard:
        return cls(sharer_spec=version.sharer.spec, sharer_adapter_hash=version.sharer.adapter_hash,
                   receiver_spec=version.receiver.spec,
                   receiver_adapter_hash=version.receiver.adapter_hash,
                   config_hash=version.config_hash, version_id=version.id,
                   pair=pair_name(version.sharer.spec, version.receiver.spec),
                   train_steps=train_steps, train_examples=train_examples, data=data,
                   scores=dict(scores or {}), trained_on=dict(trained_on or {}))

    @property
    def version(self) -> FuserVersion:
        return FuserVersion(ModelVersion(self.sharer_spec, self.sharer_adapter_hash),
                            ModelVersion(self.receiver_spec, self.receiver_adapter_hash),
                            self.config_hash)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """Indented JSON. Raises ``ValueError`` for NaN/Inf scores or non-JSON values."""
        try:
            return json.dumps(self.to_dict(), indent=2, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"fuser card is not JSON-serialisable (NaN/Inf score or a "
                             f"non-JSON value): {e}") from None

    @classmethod
    def from_dict(cls, d: dict) -> FuserCard:
        """Build and check a card: unknown or missing keys, a card from a newer format, or
        fields that disagree with each other (``version_id`` vs the version fields, ``pair``)
        raise :class:`FuserIntegrityError`, and so does a ``trained_on`` that is not at most
        16 string entries of at most 200 characters each."""
        if not isinstance(d, dict):
            raise FuserIntegrityError(f"fuser card must be a JSON object, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        if set(d) - known:
            raise FuserIntegrityError(f"fuser card has unknown keys {sorted(set(d) - known)}")
        fmt = d.get("format_version", FORMAT_VERSION)
        if not isinstance(fmt, int) or fmt > FORMAT_VERSION:
            raise FuserIntegrityError(f"fuser card has format_version {fmt!r}; this edgefuse "
                                      f"reads up to {FORMAT_VERSION}: upgrade edgefuse")
        try:
            card = cls(**d)
            version = card.version
        except (TypeError, ValueError) as e:
            raise FuserIntegrityError(f"malformed fuser card: {e}") from None
        _check_trained_on(card.trained_on)
        if card.version_id != version.id:
            raise FuserIntegrityError(f"fuser card says version {card.version_id}, its version "
                                      f"fields give {version.id}: card edited or corrupted")
        if card.pair != pair_name(card.sharer_spec, card.receiver_spec):
            raise FuserIntegrityError(f"fuser card pair {card.pair!r} does not match its specs")
        return card

    @classmethod
    def from_json(cls, text: str) -> FuserCard:
        try:
            d = json.loads(text)
        except (TypeError, ValueError) as e:
            raise FuserIntegrityError(f"fuser card is not valid JSON: {e}") from None
        return cls.from_dict(d)


def _check_trained_on(value) -> None:
    if not (isinstance(value, dict) and len(value) <= 16
            and all(isinstance(k, str) and isinstance(v, str) and 0 < len(k) <= 200
                    and len(v) <= 200 for k, v in value.items())):
        raise FuserIntegrityError("fuser card trained_on must map at most 16 names to strings "
                                  "of at most 200 characters")


def trained_on(fuser_or_state) -> dict[str, str]:
    """Where ``fuser_or_state`` (a module or a state dict) lives now, for a card's
    ``trained_on``: ``host``, ``device`` (with the GPU's name on CUDA), ``torch``, ``dtype``."""
    import socket

    tensors = (list(fuser_or_state.parameters()) if isinstance(fuser_or_state, torch.nn.Module)
               else [torch.as_tensor(v) for v in fuser_or_state.values()])
    device = tensors[0].device if tensors else torch.device("cpu")
    name = str(device)
    if device.type == "cuda":
        name += f" ({torch.cuda.get_device_name(device)})"
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors}) or ["float32"]
    return {"host": socket.gethostname()[:200], "device": name[:200],
            "torch": torch.__version__[:200], "dtype": "+".join(dtypes)[:200]}


def _safe_name(spec: str) -> str:
    # Percent-encoding is injective; a leading "." is encoded too (hidden/".." folders).
    name = quote(spec, safe="")
    return "%2E" + name[1:] if name.startswith(".") else name


def pair_name(sharer_spec: str, receiver_spec: str) -> str:
    """Folder name of a pair: ``<sharer>__to__<receiver>``, specs percent-encoded."""
    return f"{_safe_name(sharer_spec)}__to__{_safe_name(receiver_spec)}"


# ------------------------------------------------------------------------- the registry


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open a directory
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _float32_state(fuser_or_state) -> dict[str, torch.Tensor]:
    state = fuser_or_state
    if isinstance(state, torch.nn.Module):
        state = state.state_dict()
    out = {}
    for key, value in state.items():
        t = torch.as_tensor(value)
        if not t.is_floating_point():
            raise ValueError(f"fuser state {key!r} has dtype {t.dtype}: only float weights are saved")
        out[key] = t.detach().to("cpu", torch.float32).contiguous().clone()
    return out


class FuserRegistry:
    """Versioned fusers under ``root`` (layout in the module docstring). Server side."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser().resolve()

    def pair_dir(self, sharer_spec: str, receiver_spec: str) -> Path:
        return self.root / pair_name(sharer_spec, receiver_spec)

    def path(self, version: FuserVersion) -> Path:
        """The folder of ``version`` (whether or not it exists)."""
        return self.pair_dir(version.sharer.spec, version.receiver.spec) / version.id

    def save(self, fuser: torch.nn.Module, config: dict, version: FuserVersion,
             card: FuserCard, make_latest: bool = True) -> Path:
        """Save ``fuser``'s weights (as float32), ``config`` and the completed ``card`` as
        ``version``, and (``make_latest``) make it the pair's latest: a control fuser
        (``sharer_control`` zero / shuffled) is saved without. Returns the version folder.

        The folder is built in a hidden temporary sibling and renamed into place; on any
        error the temporary folder is removed and the registry is as before. Saving a version
        id that exists (same models and config, retrained) replaces it.

        Raises:
            ValueError: ``config_hash(config) != version.config_hash``, a card for another
                version, a non-float weight, or a card/config that is not JSON-serialisable.
        """
        if config_hash(config) != version.config_hash:
            raise ValueError(f"config hashes to {config_hash(config)}, the version says "
                             f"{version.config_hash}: build the version from this config")
        if card.version != version or card.version_id != version.id:
            raise ValueError(f"the card is for version {card.version_id} "
                             f"({card.version}), not {version.id} ({version})")
        where = card.trained_on or trained_on(fuser)
        _check_trained_on(where)
        state = _float32_state(fuser)
        blob = st_save(state, metadata={"format": "pt", "edgefuse_fuser_version": version.id})
        params = sum(t.numel() for t in state.values())
        card = dataclasses.replace(
            card, scores=dict(card.scores), params=params, bytes=4 * params,
            weights_sha256=hashlib.sha256(blob).hexdigest(), state_sha256=state_digest(state),
            created=card.created or datetime.now(timezone.utc).isoformat(timespec="seconds"),
            trained_on=dict(where), format_version=FORMAT_VERSION)
        card_json, config_json = card.to_json(), json.dumps(config, indent=2, sort_keys=True)

        out = self.path(version)
        out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write_dir(out) as tmp:
            _write(tmp / WEIGHTS, blob)
            _write(tmp / CONFIG, config_json.encode())
            _write(tmp / CARD, card_json.encode())
        _fsync_dir(out.parent)
        if make_latest:
            self._set_latest(out.parent, version.id)
        return out

    @staticmethod
    def _set_latest(pair_dir: Path, version_id: str) -> None:
        fd, tmp = tempfile.mkstemp(prefix=f".{LATEST}.tmp-", dir=pair_dir)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(f"{version_id}\n".encode())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, pair_dir / LATEST)
            _fsync_dir(pair_dir)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _read_card(self, folder: Path) -> FuserCard:
        try:
            text = (folder / CARD).read_text()
        except OSError as e:
            raise FuserIntegrityError(f"cannot read the fuser card {folder / CARD}: {e}") from None
        card = FuserCard.from_json(text)
        if card.version_id != folder.name:
            raise FuserIntegrityError(f"{folder / CARD} is the card of version {card.version_id}, "
                                      f"not of its folder {folder.name}")
        return card

    def latest(self, sharer_spec: str, receiver_spec: str) -> FuserVersion | None:
        """The pair's latest version, ``None`` when the pair has none.

        Raises:
            FuserIntegrityError: a ``latest`` pointer that is malformed or names a missing
                version, or a corrupted card.
        """
        pair = self.pair_dir(sharer_spec, receiver_spec)
        try:
            vid = (pair / LATEST).read_text().strip()
        except FileNotFoundError:
            return None
        if not _ID.match(vid):
            raise FuserIntegrityError(f"{pair / LATEST} holds {vid[:40]!r}, not a version id")
        if not (pair / vid).is_dir():
            raise FuserIntegrityError(f"{pair / LATEST} names version {vid}, which is not in "
                                      "the registry")
        card = self._read_card(pair / vid)
        if (card.sharer_spec, card.receiver_spec) != (sharer_spec, receiver_spec):
            raise FuserIntegrityError(f"the latest fuser of {pair.name} is for the pair "
                                      f"{card.sharer_spec!r} -> {card.receiver_spec!r}")
        return card.version

    def load_state(self, version: FuserVersion) -> tuple[dict[str, torch.Tensor], dict, FuserCard]:
        """``(state_dict, config, card)`` of ``version``, checked before anything is returned:
        the card describes ``version``, the config hashes to ``version.config_hash``, the
        weights file has the sha256 the card recorded and parses as safetensors, and the
        parsed state matches the card's digest and size.

        Raises:
            FuserVersionError: ``version`` is not in the registry.
            FuserIntegrityError: any check above fails (the message says which).
        """
        folder = self.path(version)
        if not folder.is_dir():
            raise FuserVersionError(f"no fuser version {version.id} in {folder.parent} "
                                    f"({version})")
        card = self._read_card(folder)
        if card.version != version:
            raise FuserIntegrityError(f"{folder / CARD} describes {card.version}, not {version}")
        try:
            config = json.loads((folder / CONFIG).read_text())
        except (OSError, ValueError) as e:
            raise FuserIntegrityError(f"cannot read {folder / CONFIG}: {e}") from None
        if config_hash(config) != version.config_hash:
            raise FuserIntegrityError(f"{folder / CONFIG} hashes to {config_hash(config)}, the "
                                      f"version says {version.config_hash}: config edited")
        try:
            blob = (folder / WEIGHTS).read_bytes()
        except OSError as e:
            raise FuserIntegrityError(f"cannot read {folder / WEIGHTS}: {e}") from None
        sha = hashlib.sha256(blob).hexdigest()
        if sha != card.weights_sha256:
            raise FuserIntegrityError(f"{folder / WEIGHTS} has sha256 {sha[:16]}..., the card "
                                      f"recorded {card.weights_sha256[:16]}... at save time: the "
                                      "weights are corrupted or tampered with; refusing to load")
        try:
            state = st_load(blob)
        except Exception as e:  # safetensors raises its own error types
            raise FuserIntegrityError(f"{folder / WEIGHTS} is not a valid safetensors file: "
                                      f"{e}") from None
        check_state(state, card)
        return state, config, card

    def load_for(self, sharer: ModelVersion,
                 receiver: ModelVersion) -> tuple[dict[str, torch.Tensor], dict, FuserCard]:
        """The latest fuser of the pair ``sharer -> receiver``, refused unless it was trained
        for exactly these model versions.

        Raises:
            FuserVersionError: no fuser for the pair, or the latest one is for another spec or
                adapter (see :meth:`check_compatible`); its integrity subclass for corrupted files.
        """
        version = self.latest(sharer.spec, receiver.spec)
        if version is None:
            raise FuserVersionError(f"no fuser registered for {sharer.spec!r} -> "
                                    f"{receiver.spec!r} in {self.root}")
        self.check_compatible(version, sharer, receiver)
        return self.load_state(version)

    @staticmethod
    def check_compatible(version: FuserVersion, sharer: ModelVersion,
                         receiver: ModelVersion) -> None:
        """Raise :class:`FuserVersionError` naming every mismatch (side, spec or adapter hash,
        expected by the fuser vs got from the client); return ``None`` when all match."""
        problems = []
        for side, want, got in (("sharer", version.sharer, sharer),
                                ("receiver", version.receiver, receiver)):
            if want.spec != got.spec:
                problems.append(f"{side} spec: fuser expects {want.spec!r}, got {got.spec!r}")
            if want.adapter_hash != got.adapter_hash:
                problems.append(f"{side} adapter hash: fuser expects {want.adapter_hash}, got "
                                f"{got.adapter_hash} (the adapter differs from the one the "
                                "fuser was trained with)")
        if problems:
            raise FuserVersionError(f"fuser {version.id} does not match the client's models, "
                                    "refusing to apply it: " + "; ".join(problems))

    def list(self) -> list[FuserCard]:
        """Cards of every saved version, sorted by pair then creation time.

        Raises:
            FuserIntegrityError: a corrupted card (its path is in the message).
        """
        cards = []
        if not self.root.is_dir():
            return cards
        for pair in sorted(p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")):
            for folder in sorted(pair.iterdir()):
                if folder.is_dir() and _ID.match(folder.name):
                    cards.append(self._read_card(folder))
        return sorted(cards, key=lambda c: (c.pair, c.created, c.version_id))

    def find(self, version_id: str) -> FuserVersion:
        """The version whose id is ``version_id``, from its card (only that card is read).

        Raises:
            FuserVersionError: not a 16-hex id, or no such version in the registry.
            FuserIntegrityError: its card is corrupted.
        """
        if not isinstance(version_id, str) or not _ID.match(version_id):
            raise FuserVersionError(f"{str(version_id)[:40]!r} is not a fuser version id "
                                    "(16 hex characters)")
        if self.root.is_dir():
            for pair in sorted(self.root.iterdir()):
                if not pair.name.startswith(".") and (pair / version_id).is_dir():
                    return self._read_card(pair / version_id).version
        raise FuserVersionError(f"no fuser version {version_id} in {self.root}")

    # -- import / export ------------------------------------------------------------
    def export(self, version: FuserVersion, path: str | os.PathLike, signer: Identity | None = None,
               signer_name: str | None = None) -> Path:
        """Write ``version`` as one archive file at ``path`` (replaced atomically): a POSIX
        ustar tar holding ``card.json``, ``config.json`` and ``fuser.safetensors``, the
        registry's own bytes (so an import is bit-identical). Every check of
        :meth:`load_state` runs first: a corrupted version is never exported.

        With ``signer``, a fourth member ``signature.json`` follows:
        ``{"format": 1, "signer": <name>, "public_key": <64 hex>, "signature": <128 hex>}``,
        the Ed25519 signature of :func:`archive_message` (the signer name and the sha256 of
        each of the three files), which :meth:`import_` checks against the key its trust store
        pins for that name. ``signer_name`` defaults to :data:`DEFAULT_SIGNER` (``exporter``).
        Ed25519 signatures are deterministic: the same version, key and name give the same
        archive bytes.

        Returns the archive's path.

        Raises:
            FuserVersionError: ``version`` is not in the registry.
            FuserIntegrityError: its files fail :meth:`load_state`'s checks.
            IdentityError: ``signer_name`` is not a valid trust-store name.
            ValueError: ``signer_name`` without ``signer``.
            OSError: ``path`` cannot be written (nothing is left half-written).
        """
        import io
        import tarfile

        from edgefuse.io import atomic_write_bytes

        if signer is None and signer_name is not None:
            raise ValueError("a signer name needs a signer (the identity to sign with)")
        name = check_name(signer_name or DEFAULT_SIGNER) if signer is not None else None
        _, _, card = self.load_state(version)
        folder = self.path(version)
        files = {name: (folder / name).read_bytes() for name in ARCHIVE_MEMBERS}
        if hashlib.sha256(files[WEIGHTS]).hexdigest() != card.weights_sha256:
            raise FuserIntegrityError(f"{folder / WEIGHTS} changed while it was exported")
        names = list(ARCHIVE_MEMBERS)
        if signer is not None:
            doc = {"format": SIGNATURE_FORMAT, "signer": name,
                   "public_key": signer.public_bytes().hex(),
                   "signature": signer.sign(archive_message(name, files)).hex()}
            files[SIGNATURE] = (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()
            names.append(SIGNATURE)
        try:
            mtime = int(datetime.fromisoformat(card.created).timestamp())
        except (TypeError, ValueError):
            mtime = 0
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for member in names:
                info = tarfile.TarInfo(member)
                info.size, info.mode, info.mtime = len(files[member]), 0o644, max(mtime, 0)
                tar.addfile(info, io.BytesIO(files[member]))
        return atomic_write_bytes(path, buf.getvalue())

    def import_(self, path: str | os.PathLike, *, kv_spec_of=None, cache_dir=None,
                max_weights_bytes: int = MAX_WEIGHTS_BYTES, make_latest: bool = True,
                trust: TrustStore | None = None, allow_unsigned: bool = False) -> FuserVersion:
        """Register the fuser version in the archive at ``path`` (written by :meth:`export`,
        possibly on another machine) and return it. Everything is checked before anything is
        written into the registry:

        1. the archive: a regular file of bounded size, POSIX ustar with valid header
           checksums, exactly the members ``card.json``, ``config.json`` and
           ``fuser.safetensors`` and optionally ``signature.json`` as regular files (no
           links, folders, extension headers, absolute or ``..`` names, duplicates or
           extras), each member's declared size under its cap *before* it is read
           (:class:`_ArchiveReader`);
        2. the exporter, before any other member is read: a signed archive needs ``trust``;
           its ``signature.json`` is well-formed (format 1, a valid signer name, 64-hex key,
           128-hex signature) and its key is the one ``trust`` pins for the signer's name. An
           unsigned archive is refused unless ``allow_unsigned`` (a signed one is checked all
           the same: ``allow_unsigned`` never excuses a bad or unverifiable signature, and a
           signed archive without ``trust`` is refused rather than read as unsigned);
        3. the card: a self-consistent registry card with a save record (sha256s, size,
           creation time);
        4. the config: hashes to the card's ``config_hash`` and is a valid
           :class:`edgefuse.c2c.fuser.FuserConfig`;
        5. the shapes: a :class:`edgefuse.c2c.fuser.C2CFuser` for the card's receiver and
           sharer specs (their KV shapes from ``kv_spec_of``) and this config is
           constructible (built on the meta device: no memory), its parameter count is the
           card's, and the weights member is no larger than those parameters as float32
           plus a small header allowance;
        6. the signature (signed archives): it verifies over :func:`archive_message` of the
           three members' bytes as read (the bytes then written), so any altered, swapped or
           re-signed member is refused;
        7. the weights: their sha256 is the card's, they parse as safetensors, every tensor
           is float32 with exactly the reference fuser's names and shapes, all values are
           finite, and the state digest is the card's (:func:`check_state`).

        A version already in the registry with the same three files is a no-op (returns the
        version, writes nothing); with different files the import is refused (a version is
        never overwritten). The version folder is built in a hidden sibling and renamed into
        place (a rename that fails if the folder appeared meanwhile); then, with
        ``make_latest`` and unless it is a control fuser, it becomes the pair's ``latest``.

        Args:
            path: the archive file.
            kv_spec_of: ``spec -> KVSpec`` of a model spec (default: from the model's config
                as this machine holds it under ``cache_dir``; nothing is ever fetched).
            cache_dir: the model cache for the default ``kv_spec_of``.
            max_weights_bytes: cap on the weights member, whatever the card says.
            make_latest: point the pair's ``latest`` at the imported version (never for a
                control fuser, ``sharer_control`` zero / shuffled, as :meth:`save` in the hub).
            trust: the pinned exporters whose signatures are accepted.
            allow_unsigned: also accept an archive without ``signature.json`` (its digests are
                still checked, but nothing says who made it).

        Raises:
            FuserArchiveError: the archive or its contents fail a check above (one line
                naming the archive and the check), among them: unsigned and not allowed,
                signed without a trust store, signed by a name not pinned in ``trust`` or
                with a key other than the pinned one, a malformed ``signature.json``, a
                signature that does not verify (a member altered after signing).
            FuserIntegrityError: the weights do not match the card's digest (as today).
            FuserVersionError: another version with this id is already in the registry.
        """
        from .fuser import C2CFuser, FuserConfig, kv_spec_from_config

        path = Path(path)
        where = path.name
        if kv_spec_of is None:
            def kv_spec_of(spec):
                return kv_spec_from_config(_local_model_config(spec, cache_dir))

        with _ArchiveReader(path, max_weights_bytes) as archive:
            signed = _check_exporter(archive, where, trust, allow_unsigned)
            card_bytes, config_bytes = archive.read(CARD), archive.read(CONFIG)  # read once each
            card = _parse_card(card_bytes, where)
            config = _parse_json(config_bytes, f"{where}: {CONFIG}")
            if not isinstance(config, dict):
                raise FuserArchiveError(f"{where}: {CONFIG} is not a JSON object")
            try:
                got = config_hash(config)
            except ValueError as e:
                raise FuserArchiveError(f"{where}: {CONFIG}: {e}") from None
            if got != card.config_hash:
                raise FuserArchiveError(f"{where}: {CONFIG} hashes to {got}, the card says "
                                        f"{card.config_hash}: config altered")
            try:
                fcfg = FuserConfig.from_dict(config)
            except (TypeError, ValueError) as e:
                raise FuserArchiveError(f"{where}: {CONFIG} is not a fuser config: "
                                        f"{_line(e)}") from None
            kv = {}
            for side, spec in (("receiver", card.receiver_spec), ("sharer", card.sharer_spec)):
                try:
                    kv[side] = kv_spec_of(spec)
                except Exception as e:  # unknown spec, unfetched model, odd config
                    raise FuserArchiveError(f"{where}: cannot get the KV shapes of the {side} "
                                            f"model {spec!r}: {_line(e)}") from None
            try:
                with torch.device("meta"):  # shapes only: nothing allocated
                    ref = C2CFuser(kv["receiver"], kv["sharer"], fcfg)
            except Exception as e:
                raise FuserArchiveError(f"{where}: no fuser can be built for {card.sharer_spec!r}"
                                        f" -> {card.receiver_spec!r} with this config: "
                                        f"{_line(e)}") from None
            shapes = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
            params = sum(math.prod(s) for s in shapes.values())
            if card.params != params or card.bytes != 4 * params:
                raise FuserArchiveError(f"{where}: the card says {card.params} parameters "
                                        f"({card.bytes} bytes), a fuser of this pair and config "
                                        f"has {params} ({4 * params} bytes)")
            cap = min(max_weights_bytes, 4 * params + _SAFETENSORS_SLACK + 256 * len(shapes))
            blob = archive.read(WEIGHTS, cap=cap)
        files = {CARD: card_bytes, CONFIG: config_bytes, WEIGHTS: blob}
        if signed is not None:
            signer, public, signature = signed
            try:
                verify_signature(public, signature, archive_message(signer, files))
            except IdentityError as e:
                raise FuserArchiveError(f"{where}: bad signature by {signer!r} ({_line(e)}): a "
                                        "member was altered after signing, or the signature is "
                                        "another archive's; refusing to import") from None
        sha = hashlib.sha256(blob).hexdigest()
        if sha != card.weights_sha256:
            raise FuserIntegrityError(f"{where}: {WEIGHTS} has sha256 {sha[:16]}..., the card "
                                      f"recorded {card.weights_sha256[:16]}...: the weights are "
                                      "corrupted or tampered with; refusing to import")
        try:
            state = st_load(blob)
        except Exception as e:  # safetensors raises its own error types
            raise FuserArchiveError(f"{where}: {WEIGHTS} is not a valid safetensors file: "
                                    f"{_line(e)}") from None
        _check_reference(state, shapes, where)
        check_state(state, card)

        version = card.version
        out = self.path(version)
        if out.exists():
            return self._same_or_refuse(out, files, version, where)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{version.id}.import-", dir=out.parent))
        try:
            for name, data in files.items():
                _write(tmp / name, data)
            _fsync_dir(tmp)
            os.rename(tmp, out)  # fails if a non-empty version folder appeared meanwhile
        except OSError:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
            if out.exists():
                return self._same_or_refuse(out, files, version, where)
            raise
        _fsync_dir(out.parent)
        if make_latest and fcfg.sharer_control == "none":  # a control is never the pair's fuser
            self._set_latest(out.parent, version.id)
        return version

    @staticmethod
    def _same_or_refuse(out: Path, files: dict[str, bytes], version: FuserVersion,
                        where: str) -> FuserVersion:
        for name, data in files.items():
            try:
                same = (out / name).read_bytes() == data
            except OSError:
                same = False
            if not same:
                raise FuserVersionError(f"{where}: version {version.id} is already in the "
                                        f"registry ({out}) with a different {name}; a version is "
                                        "never overwritten (remove that folder to replace it)")
        return version


def check_state(state: dict, card: FuserCard) -> None:
    """Check a loaded or received fuser state against its card (digest and parameter count).

    Raises:
        FuserIntegrityError: the state is not the one the card describes.
    """
    params = sum(int(np.prod(tuple(v.shape))) for v in state.values())
    if params != card.params:
        raise FuserIntegrityError(f"fuser state has {params} parameters, the card says {card.params}")
    digest = state_digest(state)
    if digest != card.state_sha256:
        raise FuserIntegrityError(f"fuser state digest {digest[:16]}... differs from the card's "
                                  f"{card.state_sha256[:16]}...: corrupted or tampered; refusing it")


def check_received(card: FuserCard, state: dict, config: dict, sharer_spec: str) -> None:
    """Check a fuser received by wire (or rebuilt from a client's store) before it is used:
    it must come from a registry save and be exactly what its card describes.

    Checked: the card is a saved registry card (``weights_sha256`` and ``state_sha256`` are
    64-hex sha256s, ``params > 0``, ``created`` set: :meth:`FuserRegistry.save` fills them, a
    hand-made or foreign card has none); the card is for ``sharer_spec`` (the sharer the
    message names, so a fuser cannot be installed for another sharer); ``config`` hashes to
    the card's ``config_hash``; and the state's parameter count and digest equal the card's
    (:func:`check_state`).

    Raises:
        FuserIntegrityError: the first failed check (the message says which).
    """
    if not (_SHA256.match(card.weights_sha256 or "") and _SHA256.match(card.state_sha256 or "")
            and card.params > 0 and card.created):
        raise FuserIntegrityError(f"fuser {card.version_id} has no registry save record "
                                  "(sha256s, size, creation time): unknown source, refusing it")
    if card.sharer_spec != sharer_spec:
        raise FuserIntegrityError(f"fuser {card.version_id} is for sharer {card.sharer_spec!r} "
                                  f"but was sent as the fuser of {sharer_spec!r}; refusing it")
    try:
        got = config_hash(config)
    except ValueError as e:
        raise FuserIntegrityError(f"fuser {card.version_id}: {e}") from None
    if got != card.config_hash:
        raise FuserIntegrityError(f"fuser {card.version_id}: its config hashes to {got}, the "
                                  f"card says {card.config_hash}: config altered; refusing it")
    check_state(state, card)


# ------------------------------------------------------------------------- archives

_BLOCK = 512
_OCTAL = re.compile(rb"^[0-7]+$")
_TAR_TYPES = {b"1": "a hard link", b"2": "a symbolic link", b"3": "a character device",
              b"4": "a block device", b"5": "a folder", b"6": "a FIFO", b"7": "a contiguous file",
              b"x": "a pax extended header", b"g": "a pax global header",
              b"L": "a GNU long name", b"K": "a GNU long link name"}


class FuserArchiveError(FuserIntegrityError):
    """An archive handed to :meth:`FuserRegistry.import_` that is malformed, oversized, or
    whose contents fail a check; nothing was written."""


def _local_model_config(name: str, cache_dir=None):
    """The transformers config of model spec ``name`` from this machine only: a tiny spec's,
    a fetched embedded model's, a local folder's, or a hub id already in the local hub
    cache. Never fetches: an imported card must not make the server download anything.

    Raises:
        ModelSpecError, ModelFetchError, OSError: unknown, not fetched, or not cached here.
    """
    from transformers import AutoConfig

    from edgefuse.models import get_spec, model_config, resolve_path

    spec = get_spec(name)
    if spec.tiny:
        return model_config(name)
    return AutoConfig.from_pretrained(resolve_path(spec, cache_dir, allow_fetch=False),
                                      local_files_only=True)


def _line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


def _parse_json(data: bytes, what: str):
    try:
        return json.loads(data.decode("utf-8"),
                          parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FuserArchiveError(f"{what} is not strict UTF-8 JSON: {_line(e)}") from None


def _parse_card(data: bytes, where: str) -> FuserCard:
    d = _parse_json(data, f"{where}: {CARD}")
    try:
        card = FuserCard.from_dict(d)
    except FuserIntegrityError as e:
        raise FuserArchiveError(f"{where}: {_line(e)}") from None
    if not (isinstance(card.weights_sha256, str) and _SHA256.match(card.weights_sha256)
            and isinstance(card.state_sha256, str) and _SHA256.match(card.state_sha256)
            and isinstance(card.params, int) and card.params > 0
            and isinstance(card.bytes, int) and card.created):
        raise FuserArchiveError(f"{where}: the card has no registry save record (sha256s, size, "
                                "creation time): not an exported registry version")
    return card


def _check_reference(state: dict, shapes: dict[str, tuple], where: str) -> None:
    """``state`` has exactly the reference names and shapes, float32, finite values."""
    missing, extra = sorted(set(shapes) - set(state)), sorted(set(state) - set(shapes))
    if missing or extra:
        raise FuserArchiveError(f"{where}: the weights are not those of this pair's fuser: "
                                f"missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
                                f"unexpected {extra[:3]}{'...' if len(extra) > 3 else ''}")
    for key in sorted(state):
        t = state[key]
        if t.dtype != torch.float32:
            raise FuserArchiveError(f"{where}: weight {key!r} has dtype "
                                    f"{str(t.dtype).removeprefix('torch.')}; a registry fuser is "
                                    "float32")
        if tuple(t.shape) != shapes[key]:
            raise FuserArchiveError(f"{where}: weight {key!r} has shape {tuple(t.shape)}, this "
                                    f"pair's fuser has {shapes[key]}")
        if not bool(torch.isfinite(t).all()):
            raise FuserArchiveError(f"{where}: weight {key!r} holds NaN or Inf values")


def archive_message(signer: str, files: dict[str, bytes]) -> bytes:
    """The message an archive's ``signature.json`` signs: the ASCII prefix
    ``edgefuse fuser archive v1`` and a NUL byte, the signer's name and a NUL byte (a name
    holds no NUL, so the encoding is unambiguous), then the 32-byte SHA-256 of each of
    ``files[card.json]``, ``files[config.json]`` and ``files[fuser.safetensors]`` in
    :data:`ARCHIVE_MEMBERS` order. Card, config, weights and the name are all bound.

    Raises:
        IdentityError: ``signer`` is not a valid trust-store name.
        KeyError: a member is missing from ``files``.
    """
    head = _SIGNED_PREFIX + check_name(signer).encode("ascii") + b"\x00"
    return head + b"".join(hashlib.sha256(files[name]).digest() for name in ARCHIVE_MEMBERS)


def _parse_signature(data: bytes, where: str) -> tuple[str, bytes, bytes]:
    """``(signer, public key, signature)`` of a ``signature.json``; each malformation is one
    :class:`FuserArchiveError` line."""
    d = _parse_json(data, f"{where}: {SIGNATURE}")
    keys = ("format", "signer", "public_key", "signature")
    if not isinstance(d, dict) or set(d) != set(keys):
        got = sorted(d)[:6] if isinstance(d, dict) else type(d).__name__
        raise FuserArchiveError(f"{where}: {SIGNATURE} must be an object with exactly the keys "
                                f"{', '.join(keys)}; got {got}")
    fmt = d["format"]
    if type(fmt) is not int or fmt != SIGNATURE_FORMAT:
        raise FuserArchiveError(f"{where}: {SIGNATURE} has format {str(fmt)[:20]!r}; this edgefuse "
                                f"reads format {SIGNATURE_FORMAT}")
    try:
        signer = check_name(d["signer"])
    except IdentityError as e:
        raise FuserArchiveError(f"{where}: {SIGNATURE}: {_line(e)}") from None
    for key, pattern, size in (("public_key", _HEX64, 64), ("signature", _HEX128, 128)):
        if not (isinstance(d[key], str) and pattern.match(d[key])):
            raise FuserArchiveError(f"{where}: {SIGNATURE}: {key} must be {size} lowercase hex "
                                    "characters")
    return signer, bytes.fromhex(d["public_key"]), bytes.fromhex(d["signature"])


def _check_exporter(archive: _ArchiveReader, where: str, trust: TrustStore | None,
                    allow_unsigned: bool) -> tuple[str, bytes, bytes] | None:
    """Who signed ``archive``, checked against ``trust`` before any other member is read:
    ``(signer, public key, signature)``, or ``None`` for an allowed unsigned archive. The
    signature itself is verified once the members have been read (:meth:`FuserRegistry.import_`)."""
    if SIGNATURE not in archive.members:
        if not allow_unsigned:
            raise FuserArchiveError(f"{where}: the archive is not signed (no {SIGNATURE}); "
                                    "unsigned archives are refused unless explicitly allowed "
                                    "(allow_unsigned, --allow-unsigned)")
        return None
    signer, public, signature = _parse_signature(archive.read(SIGNATURE), where)
    if trust is None:
        raise FuserArchiveError(f"{where}: the archive is signed by {signer!r} but no trust store "
                                "was given, so the signature cannot be checked; refusing (pass "
                                f"the trust store that pins {signer!r})")
    pinned = f"pinned in {trust.path}" if trust.path else "pinned"
    if signer not in trust.names():
        raise FuserArchiveError(f"{where}: signed by {signer!r}, which has no key {pinned}; "
                                "refusing (pin the exporter's key first)")
    try:
        trust.check(signer, public)
    except UntrustedPeerError:
        raise FuserArchiveError(f"{where}: signed by {signer!r} with key {fingerprint(public)}, "
                                f"but {fingerprint(trust.get(signer))} is {pinned} for "
                                f"{signer!r}; refusing") from None
    return signer, public, signature


class _ArchiveReader:
    """A fuser archive opened for :meth:`FuserRegistry.import_`, its headers parsed by hand.

    The archive is POSIX ustar (what :meth:`FuserRegistry.export` writes with
    ``tarfile.USTAR_FORMAT``): the :data:`ARCHIVE_MEMBERS` and, when signed, ``signature.json``
    (at most :data:`MAX_SIGNATURE_BYTES`). Headers are parsed here rather than by ``tarfile`` so that
    nothing but the 512-byte headers is read before each member's declared size has been
    checked against its cap: an extension header (pax, GNU long name) that ``tarfile`` would
    read into memory is refused, as is every non-regular member. Members are read with
    :meth:`read` (seek + read of the declared size, never more).
    """

    def __init__(self, path: Path, max_weights_bytes: int):
        self.path, self.where = path, path.name
        self.caps = {CARD: MAX_CARD_BYTES, CONFIG: MAX_CONFIG_BYTES, WEIGHTS: int(max_weights_bytes),
                     SIGNATURE: MAX_SIGNATURE_BYTES}
        self.members: dict[str, tuple[int, int]] = {}
        self.f = None

    def __enter__(self):
        import stat

        try:
            st = self.path.stat()
        except OSError as e:
            raise FuserArchiveError(f"cannot read the fuser archive {self.path}: "
                                    f"{e.strerror or e}") from None
        if not stat.S_ISREG(st.st_mode):
            raise FuserArchiveError(f"{self.path} is not a regular file")
        limit = sum(self.caps.values()) + len(self.caps) * _BLOCK + 20 * 1024  # + headers, padding, end
        if st.st_size > limit:
            raise FuserArchiveError(f"{self.where}: the archive is {st.st_size} bytes, more than "
                                    f"a fuser archive may be ({limit})")
        self.size = st.st_size
        try:
            self.f = open(self.path, "rb")
            self._scan()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        if self.f is not None:
            self.f.close()
            self.f = None

    def _scan(self) -> None:
        w, pos = self.where, 0
        while True:
            if pos + _BLOCK > self.size:
                raise FuserArchiveError(f"{w}: truncated archive (no end-of-archive block)")
            self.f.seek(pos)
            hdr = self.f.read(_BLOCK)
            if hdr == bytes(_BLOCK):
                break
            if hdr[257:265] != b"ustar\x0000":
                raise FuserArchiveError(f"{w}: not a POSIX ustar archive (header at byte {pos})")
            chk = hdr[148:156].rstrip(b"\x00 ")
            if not _OCTAL.match(chk) or int(chk, 8) != sum(hdr[:148]) + 256 + sum(hdr[156:]):
                raise FuserArchiveError(f"{w}: bad header checksum at byte {pos}")
            try:
                name = hdr[0:100].split(b"\x00", 1)[0].decode("ascii")
                prefix = hdr[345:500].split(b"\x00", 1)[0].decode("ascii")
            except UnicodeDecodeError:
                raise FuserArchiveError(f"{w}: a member name is not ASCII") from None
            name = f"{prefix}/{name}" if prefix else name
            if name.startswith("/") or ".." in name.split("/"):
                raise FuserArchiveError(f"{w}: member {name[:100]!r} is an absolute or parent "
                                        "path (path traversal); refused")
            kind = hdr[156:157]
            if kind not in (b"0", b"\x00"):
                what = _TAR_TYPES.get(kind, f"of type {kind!r}")
                raise FuserArchiveError(f"{w}: member {name[:100]!r} is {what}, not a regular "
                                        "file; refused")
            if name not in self.caps:
                raise FuserArchiveError(f"{w}: unexpected member {name[:100]!r}: a fuser archive "
                                        f"holds exactly {', '.join(ARCHIVE_MEMBERS)} (and "
                                        f"{SIGNATURE} when signed)")
            if name in self.members:
                raise FuserArchiveError(f"{w}: member {name!r} appears twice")
            raw = hdr[124:136].rstrip(b"\x00 ").lstrip(b" ")
            if not _OCTAL.match(raw):
                raise FuserArchiveError(f"{w}: member {name!r} has a malformed size field")
            size = int(raw, 8)
            if size > self.caps[name]:
                raise FuserArchiveError(f"{w}: member {name!r} declares {size} bytes, more than "
                                        f"the {self.caps[name]} allowed; refused before reading")
            start = pos + _BLOCK
            if start + size > self.size:
                raise FuserArchiveError(f"{w}: member {name!r} is truncated")
            self.members[name] = (start, size)
            pos = start + -(-size // _BLOCK) * _BLOCK
        missing = [n for n in ARCHIVE_MEMBERS if n not in self.members]
        if missing:
            raise FuserArchiveError(f"{w}: the archive lacks {', '.join(missing)}")
        self.f.seek(pos)
        while chunk := self.f.read(64 * 1024):  # bounded: the file size was capped
            if chunk.strip(b"\x00"):
                raise FuserArchiveError(f"{w}: data after the end-of-archive block")

    def read(self, name: str, cap: int | None = None) -> bytes:
        """The bytes of member ``name``; refused when its declared size exceeds ``cap``."""
        start, size = self.members[name]
        if cap is not None and size > cap:
            raise FuserArchiveError(f"{self.where}: member {name!r} declares {size} bytes, more "
                                    f"than the {cap} its card's fuser needs; refused before "
                                    "reading")
        self.f.seek(start)
        data = self.f.read(size)
        if len(data) != size:
            raise FuserArchiveError(f"{self.where}: member {name!r} is truncated")
        return data


# ------------------------------------------------------------------------- wire packing


def pack_state(state: dict) -> tuple[dict[str, np.ndarray], str]:
    """Pack a state dict (torch tensors or numpy arrays, float) into one flat float32 array.

    Returns:
        ``({PACK_PART: flat}, index_json)``: the tensors concatenated in sorted key order; the
        index is as in :mod:`edgefuse.packing`.

    Raises:
        ValueError: a non-float value.
    """
    return packing.pack(state, lambda key: PACK_PART, (PACK_PART,))


def unpack_state(arrays: dict[str, np.ndarray], index_json: str) -> dict[str, np.ndarray]:
    """Inverse of :func:`pack_state`; float32 copies. Other arrays are ignored.

    Raises:
        ValueError: an index that is not a JSON list of well-formed entries, a missing or
            non-1-D-float flat array, an empty or repeated key, a bad shape, a size that is not
            the product of the shape, an entry out of bounds, entries that do not tile the
            flat array exactly (gap, overlap, or sizes that do not add up), or NaN/Inf values.
    """
    return packing.unpack(arrays, index_json, (PACK_PART,), require_finite=True)


def adapter_change(old: dict[str, np.ndarray] | None, new: dict[str, np.ndarray] | None) -> float:
    """Relative change of an adapter's effective update, all modules together::

        change = sqrt(Σ_m ||B_new,m A_new,m − B_old,m A_old,m||²_F)
                 / max(sqrt(Σ_m ||B_old,m A_old,m||²_F), eps)

    i.e. the Frobenius norm of the difference over the norm of the old update, with the
    squared norms summed over modules (so the value does not grow with the number of
    modules, and one module with a tiny old update cannot dominate). ``alpha / r`` is left
    out: it is the same on both sides when the rank is.

    Returns ``0.0`` for ``None``/``None``, ``inf`` when exactly one side is ``None`` (an
    adapter appeared or was dropped) or when the structure differs (other modules, shapes or
    a changed rank, whose scaling then differs too). Against an all-zero old adapter
    (``B = 0`` at init) any non-zero update is a huge change.

    Raises:
        ValueError: (``MalformedUpdateError``) a key that is not a LoRA A/B weight, or a
            module with only one of A and B.
    """
    if old is None and new is None:
        return 0.0
    if old is None or new is None:
        return math.inf
    if module_shapes(old) != module_shapes(new):
        return math.inf

    def parts(state):
        out: dict[str, dict[str, np.ndarray]] = {}
        for key, value in state.items():
            module, part = split_key(key)
            out.setdefault(module, {})[part] = np.asarray(value, dtype=np.float64)
        return out

    po, pn = parts(old), parts(new)
    diff2 = base2 = 0.0
    for module in po:
        if po[module]["lora_A"].shape != pn[module]["lora_A"].shape:
            return math.inf  # rank changed
        dw_old = po[module]["lora_B"] @ po[module]["lora_A"]
        dw_new = pn[module]["lora_B"] @ pn[module]["lora_A"]
        diff2 += float(np.sum((dw_new - dw_old) ** 2))
        base2 += float(np.sum(dw_old ** 2))
    return math.sqrt(diff2) / max(math.sqrt(base2), _EPS)


def needs_retrain(old: dict[str, np.ndarray] | None, new: dict[str, np.ndarray] | None,
                  threshold: float = 0.05) -> bool:
    """Whether a fuser trained with adapter ``old`` on one side must be retrained now that the
    side's adapter is ``new``: ``adapter_change(old, new) > threshold`` (see
    :func:`adapter_change` and the module docstring for the rule and why). Call it per side;
    retrain the pair when either side says so.

    Raises:
        ValueError: ``threshold < 0``, or malformed adapter states.
    """
    if not threshold >= 0:
        raise ValueError(f"threshold must be >= 0, got {threshold}")
    return adapter_change(old, new) > threshold
