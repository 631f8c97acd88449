"""The outbound payload audit: one choke point for everything that leaves a device.

Every outbound payload of a device passes :func:`outbound` *before* it is encrypted:

* Flower replies (adapter updates, metrics, relayed C2C frames) — through the ClientApp mod
  :func:`flower_mod`, which scans each reply's arrays and configs;
* cloud frames (OPEN / VERIFY / FUSE …) — :class:`edgefuse.cloud.link.CloudLink` calls it with each
  message's plaintext;
* C2C relays (KV caches, T2T answers) — :func:`edgefuse.c2c.peer.encode_payload` calls it with the
  plaintext it is about to seal.

The audit keeps, per payload type, the number of payloads and bytes seen and the number of
*canary hits*: a canary value (:mod:`edgefuse.privacy.canaries`) found in the payload as
UTF-8 text (ASCII case-insensitively; JSON ``\\u`` escapes in Flower config values
decoded first) or as the token ids of that text (int32 big-endian as on the cloud link,
int32/int64 little-endian as in numpy arrays) when they are two or more ids (a single id is
a common vocabulary item — " Lewis" is also a top-k prediction — and 4 bytes match by chance
inside any array, so one-token canaries are scanned as text only). Hits are counted, never stored with their
value, so the audit itself holds no private text.

The audit is per process. Canaries are registered by the device (:func:`watch`); a token
scan needs the device's tokenizer (:func:`use_tokenizer`).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

PAYLOADS = ("kv", "draft_tokens", "logits_topk", "hidden", "adapter", "prompt_text", "answer_text",
            "metadata", "control", "sealed")


@dataclass
class PayloadStats:
    """Per payload type: ``payloads`` seen, ``bytes`` (plaintext), ``canary_hits``
    (payloads × canaries found), and ``hit_kinds`` (how each hit was found: ``as_text`` /
    ``as_tokens``)."""
    payloads: int = 0
    bytes: int = 0
    canary_hits: int = 0
    hit_kinds: dict = field(default_factory=lambda: defaultdict(int))

    def to_dict(self) -> dict:
        return {"payloads": self.payloads, "bytes": self.bytes, "canary_hits": self.canary_hits,
                "hit_kinds": dict(self.hit_kinds)}


class OutboundAudit:
    """Counts and canary-scans outbound payloads (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._canaries: list[str] = []
        self._patterns: list[tuple[int, str, bytes]] = []  # (canary index, how, needle)
        self._tok = None
        self.stats: dict[str, PayloadStats] = defaultdict(PayloadStats)

    # -- configuration ----------------------------------------------------------------

    def watch(self, canaries: list[str]) -> None:
        """Scan for these private values from now on (adds to what is watched)."""
        with self._lock:
            new = [c for c in dict.fromkeys(canaries)  # shorter values would match inside words
                   if c and len(c) >= 4 and c not in self._canaries]
            if new:  # called with every message: re-tokenize only when something is added
                self._canaries.extend(new)
                self._rebuild()

    def use_tokenizer(self, tok) -> None:
        """Also scan for the canaries' token ids under ``tok`` (the device's tokenizer)."""
        with self._lock:
            if tok is self._tok:
                return
            self._tok = tok
            self._rebuild()

    def _rebuild(self) -> None:
        pats: list[tuple[int, str, bytes]] = []
        for n, c in enumerate(self._canaries):
            pats.append((n, "as_text", c.encode("utf-8").lower()))  # ASCII case-insensitive
            if self._tok is None:
                continue
            for variant in (c, " " + c):
                ids = self._tok.encode(variant, add_special_tokens=False)
                if len(ids) < 2:  # one id is a common vocabulary item (a top-k prediction,
                    continue      # 4 bytes inside any array): such a canary is scanned as text
                arr = np.asarray(ids)
                for dtype in (">i4", "<i4", "<i8"):
                    pats.append((n, "as_tokens", arr.astype(dtype).tobytes()))
        self._patterns = pats

    # -- scanning ---------------------------------------------------------------------

    def scan(self, data: bytes) -> dict[str, int]:
        """Canary hits in ``data``: ``{"as_text": n, "as_tokens": m}`` (a canary counts once per
        way it is found)."""
        with self._lock:
            patterns, canaries = list(self._patterns), len(self._canaries)
        if not canaries:
            return {}
        low = data.lower()  # ASCII letters only: enough for "KEIRA FORSTER"
        found: dict[str, set[int]] = defaultdict(set)
        for n, how, needle in patterns:
            if n not in found[how] and needle in (low if how == "as_text" else data):
                found[how].add(n)
        return {how: len(v) for how, v in found.items() if v}

    def outbound(self, payload: str, data: bytes | bytearray | memoryview) -> int:
        """Record one outbound payload of type ``payload`` (one of :data:`PAYLOADS`), given
        as the plaintext bytes about to be encrypted / sent. Returns its canary hits.

        Raises:
            ValueError: an unknown payload type.
        """
        if payload not in PAYLOADS:
            raise ValueError(f"unknown payload type {payload!r}; one of {PAYLOADS}")
        data = bytes(data)
        hits = self.scan(data)
        with self._lock:
            st = self.stats[payload]
            st.payloads += 1
            st.bytes += len(data)
            st.canary_hits += sum(hits.values())
            for how, n in hits.items():
                st.hit_kinds[how] += n
        return sum(hits.values())

    def snapshot(self, reset: bool = False) -> dict[str, dict]:
        """``{payload type: PayloadStats.to_dict()}``; ``reset`` starts counting afresh."""
        with self._lock:
            out = {k: v.to_dict() for k, v in self.stats.items()}
            if reset:
                self.stats = defaultdict(PayloadStats)
        return out


AUDIT = OutboundAudit()
"""The process-wide audit every choke point reports to."""


def outbound(payload: str, data) -> int:
    """Report an outbound plaintext payload to the process-wide audit (see
    :meth:`OutboundAudit.outbound`)."""
    return AUDIT.outbound(payload, data)


_CANARY_VALUES: dict[tuple, list[str]] = {}


def watch_canaries(cfg, tok) -> list[str]:
    """Make the process-wide audit scan for this run's canary values (the identities of the
    ``privacy.probe.canaries`` canary prompts drawn with ``cfg.seed``), as text and as ``tok``
    ids. Nothing when ``privacy.enabled`` is false. Returns the watched values."""
    priv = cfg.get("privacy")
    if not priv or not priv.enabled:
        return []
    key = (cfg.data.mirror, int(priv.probe.canaries), int(cfg.seed))
    if key not in _CANARY_VALUES:  # read the identities CSV once per process, not per message
        from .canaries import load_canary_prompts

        prompts = load_canary_prompts(*key)
        _CANARY_VALUES[key] = sorted({c for p in prompts for c in p.canaries})
    values = list(_CANARY_VALUES[key])
    AUDIT.watch(values)
    AUDIT.use_tokenizer(tok)
    return values


def merge(snapshots: list[dict[str, dict]]) -> dict[str, dict]:
    """Sum several :meth:`OutboundAudit.snapshot` dicts (e.g. from every client)."""
    out: dict[str, dict] = {}
    for snap in snapshots:
        for k, v in snap.items():
            o = out.setdefault(k, {"payloads": 0, "bytes": 0, "canary_hits": 0, "hit_kinds": {}})
            for f in ("payloads", "bytes", "canary_hits"):
                o[f] += int(v.get(f, 0))
            for how, n in v.get("hit_kinds", {}).items():
                o["hit_kinds"][how] = o["hit_kinds"].get(how, 0) + int(n)
    return out


def record_bytes(content) -> list[tuple[str, bytes]]:
    """The bytes of a Flower ``RecordDict`` reply, as ``(payload type, bytes)`` pairs:
    arrays of the ``adapter`` record count as ``adapter``, other arrays (C2C ``frames``,
    already sealed end to end: their plaintext was audited by ``edgefuse.c2c.peer``) as ``sealed``,
    config and metric values (strings, numbers) as ``metadata``."""
    from flwr.app import ArrayRecord, ConfigRecord, MetricRecord

    out = []
    for name, rec in content.items():
        if isinstance(rec, ArrayRecord):
            kind = "adapter" if name == "adapter" else "sealed"
            for arr in rec.values():
                out.append((kind, bytes(arr.data)))
        elif isinstance(rec, (ConfigRecord, MetricRecord)):
            parts = []
            for k, v in rec.items():
                vals = v if isinstance(v, list) else [v]
                parts.append(str(k) + "=" + " ".join(str(x) if not isinstance(x, bytes) else "" for x in vals))
                parts.extend(_json_unescaped(x) for x in vals if isinstance(x, str) and "\\u" in x)
                out.extend(("metadata", x) for x in vals if isinstance(x, bytes))
            out.append(("metadata", "\n".join(parts).encode("utf-8")))
    return out


def _json_unescaped(text: str) -> str:
    """A JSON string value with its ``\\uXXXX`` escapes decoded (``json.dumps`` escapes
    non-ASCII names), so the scan sees "Ødegård" as it was; ``""`` if it is not JSON."""
    import json

    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError:
        return ""


def flower_mod(msg, context, call_next):
    """ClientApp mod: every reply's content passes :func:`outbound` before Flower sends it;
    the reply gains a ``privacy_audit`` ConfigRecord with this handler's payload counts (the
    cloud frames and C2C relays it sent included), so the server can sum them."""
    import json

    from flwr.app import ConfigRecord

    AUDIT.snapshot(reset=True)
    reply = call_next(msg, context)
    if reply.has_content():
        for kind, data in record_bytes(reply.content):
            outbound(kind, data)
        reply.content["privacy_audit"] = ConfigRecord({"stats": json.dumps(AUDIT.snapshot(reset=True))})
    return reply
