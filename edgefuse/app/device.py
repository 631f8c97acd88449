"""A device's own local state, which nothing the server sends can move: its identity key, the
keys it trusts, and (later) the least protection it accepts.

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

from edgefuse.models import cache_dir
from edgefuse.transport.identity import (IDENTITY_FILE, TRUST_FILE, Identity, TrustStore,
                                         device_dir, load_identity)

NODE_CONFIG_KEY = "device-dir"


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
