"""A device's own local state, which nothing the server sends can move: its identity key, the
keys it trusts, and the least privacy protection it accepts (its *floor*,
:mod:`edgefuse.privacy.floors`: ``floors.yaml`` here, then ``floor-*`` node_config keys).

Where it lives (the *device home*), in this order:

1. ``device-dir`` in the node's own ``node_config`` (``flower-supernode --node-config
   "partition-id=0 device-dir=/etc/edgefuse"``): what a deployed device uses;
2. else ``<keys root>/devices/partition-<pid>``, where the keys root is ``$EDGEFUSE_KEYS``,
   else ``<edgefuse cache>/identity`` (``$EDGEFUSE_CACHE``, else ``~/.cache/edgefuse``): what
   the one-machine simulation uses, filled by :func:`edgefuse.transport.identity.provision`
   (``edgefuse keys init``, and ``edgefuse run`` before it starts a federation).

The server's config (``cfg.paths.cache_dir`` included) never chooses it: a server that could
point a device at another folder could make it trust other keys.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from edgefuse.app import messages as M
from edgefuse.models import cache_dir
from edgefuse.privacy.floors import (FIELDS, FLOOR_FILE, FloorError, FloorViolation, PrivacyFloor, check,
                                     load as load_floor)
from edgefuse.transport.identity import (IDENTITY_FILE, TRUST_FILE, Identity, TrustStore,
                                         device_dir, load_identity)

NODE_CONFIG_KEY = "device-dir"

# Per message type: the floor fields its config is checked against, and the capabilities
# the message itself uses (whatever the config says). A type not listed: every field, both.
_DEBUG = ("debug_text",)
FLOOR_CHECKS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "train": (_DEBUG, ()),
    "evaluate": (_DEBUG, ()),
    M.query_type(M.FUSERS): (_DEBUG, ()),
    M.query_type(M.ANSWER): (_DEBUG, ()),
    M.query_type(M.PRIVACY): (_DEBUG, ()),  # the probe's canary measurements stay on the device
    M.query_type(M.SHARE): (("c2c_share", *_DEBUG), ("c2c_share",)),
    M.query_type(M.REFINE): (("c2c_share", *_DEBUG), ("c2c_share",)),
    # prompts and live canaries toward the cloud, under the cache authorization
    M.query_type(M.DECODE): (("protection", "cloud", "cloud_cache", *_DEBUG), ("cloud",)),
}


def keys_root() -> Path:
    """The operator's keys root on this machine: ``$EDGEFUSE_KEYS``, else ``<cache>/identity``."""
    env = os.environ.get("EDGEFUSE_KEYS")
    return Path(env).expanduser().resolve() if env else cache_dir() / "identity"


@dataclass(frozen=True)
class DeviceHome:
    """One device's local folder (see the module docstring for where it is)."""

    path: Path
    partition_id: int

    @classmethod
    def of(cls, node_config) -> DeviceHome:
        """The home of the node with this ``node_config`` (``partition-id``, optional ``device-dir``)."""
        pid = int(node_config["partition-id"])
        own = node_config.get(NODE_CONFIG_KEY) if hasattr(node_config, "get") else None
        path = Path(str(own)).expanduser().resolve() if own else device_dir(keys_root(), pid)
        return cls(path, pid)

    def identity(self) -> Identity:
        """This device's Ed25519 identity (created and saved on first use)."""
        return load_identity(self.path / IDENTITY_FILE, create=True)

    def trust(self) -> TrustStore:
        """The keys this device trusts (``trust.json``; empty if absent)."""
        return TrustStore.load(self.path / TRUST_FILE)

    def floor(self, node_config=None) -> PrivacyFloor:
        """This device's privacy floor: ``<home>/floors.yaml`` (defaults if absent), then the
        ``floor-*`` keys of its own ``node_config`` (:func:`edgefuse.privacy.floors.load`).

        Raises:
            edgefuse.privacy.floors.FloorError: a malformed file or key.
        """
        return load_floor(self.path / FLOOR_FILE, node_config)


def check_floor(cfg, entry, node_config, message_type: str) -> PrivacyFloor:
    """Refuse a message whose server config is looser than this device's floor, before any
    handler runs; the fields checked depend on ``message_type`` (:data:`FLOOR_CHECKS`).

    Args:
        cfg: the message's resolved config; entry: this node's ``federation.clients`` entry.
        node_config: the node's own config (its home and ``floor-*`` keys).
        message_type: Flower's message type (``train``, ``query.decode`` ...).

    Returns:
        The floor, when the config passes.

    Raises:
        FloorViolation: ``"<message type> refused: ..."`` naming each key, the server's value,
            the floor and where it came from; FloorError: the floor itself is malformed.
    """
    home = DeviceHome.of(node_config)
    try:
        floor = home.floor(node_config)
    except FloorError as e:
        raise FloorError(f"{message_type} refused: this device's privacy floor is unreadable: {e}") from None
    fields, requests = FLOOR_CHECKS.get(message_type, (FIELDS, ("cloud", "c2c_share")))
    try:
        check(cfg, entry, floor, fields, requests, entry_key=f"federation.clients.{home.partition_id}")
    except FloorViolation as e:
        raise FloorViolation(f"{message_type} refused: {e}") from None
    return floor
