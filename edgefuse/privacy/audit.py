"""The outbound payload audit: one choke point for everything that leaves a device.

Every outbound payload of a device passes :func:`outbound` *before* it is encrypted:

* Flower replies (adapter updates, metrics, relayed C2C frames) — through the ClientApp mod
  :func:`flower_mod`, which scans each reply's arrays and each config / metric value;
* cloud frames (OPEN / VERIFY / FUSE …) — :class:`edgefuse.cloud.link.CloudLink` calls it with each
  message's plaintext;
* C2C relays (KV caches, T2T answers) — :func:`edgefuse.c2c.peer.encode_payload` calls it with the
  plaintext it is about to seal.

The audit keeps, per payload type, the number of payloads and bytes seen and the number of
*canary hits*: a canary value (:mod:`edgefuse.privacy.canaries`) found in the payload

* as UTF-8 text, ASCII case-insensitively and as a whole word: the characters just before
  and after it are not letters or digits, so the first-name canary "Hanna" is not found in
  "Hannah" nor "6/7/1985" in "16/7/1985" (strings inside JSON config values are decoded
  first, so an escaped ``\\n`` or ``\\u00d8`` neither hides nor glues a canary);
* as the token ids of that text (int32 big-endian as on the cloud link, int32/int64
  little-endian as in numpy arrays) when they are two or more ids (a single id is a common
  vocabulary item — " Lewis" is also a top-k prediction — and 4 bytes match by chance inside
  any array, so one-token canaries are scanned as text only).

Each hit is recorded with where it was seen — payload type, Flower message type, the
canary's kind (``email``, ``last_name`` …), how it was found and the reply field — and never
with its value, so the audit itself holds no private text.

Known misses (by design: exact matching): a canary re-encoded — base64, UTF-16, another
tokenizer's ids, a one-token canary as ids, a non-ASCII letter in another case — is not
found.

The audit is per process. Canaries are registered by the device (:func:`watch`); a token
scan needs the device's tokenizer (:func:`use_tokenizer`).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

PAYLOADS = ("kv", "draft_tokens", "logits_topk", "hidden", "adapter", "prompt_text", "answer_text",
            "metadata", "control", "sealed", "split_acts", "split_head")
"""Outbound payload types (the live link audits split MID / HEAD frames as ``hidden``; the
privacy probe's split payloads are ``split_acts`` / ``split_head``)."""
HIT_FIELDS = ("message_type", "canary_kind", "how", "field")
"""What a recorded hit says (each a name, never the canary's value)."""


@dataclass
class PayloadStats:
    """Per payload type: ``payloads`` seen, ``bytes`` (plaintext), ``canary_hits``
    (payloads × canaries found), ``hit_kinds`` (how each hit was found: ``as_text`` /
    ``as_tokens``) and ``hits``: per (message type, canary kind, how, field) the number of
    hits."""
    payloads: int = 0
    bytes: int = 0
    canary_hits: int = 0
    hit_kinds: dict = field(default_factory=lambda: defaultdict(int))
    hits: dict = field(default_factory=lambda: defaultdict(int))

    def to_dict(self) -> dict:
        """JSON-ready: ``hits`` as a list of ``{message_type, canary_kind, how, field, n}``."""
        return {"payloads": self.payloads, "bytes": self.bytes, "canary_hits": self.canary_hits,
                "hit_kinds": dict(self.hit_kinds),
                "hits": [dict(zip(HIT_FIELDS, key), n=n) for key, n in sorted(self.hits.items())]}


def _is_word_char(data: bytes, start: int, end: int) -> bool:
    """Whether the UTF-8 character in ``data[start:end]`` is a letter or digit (undecodable
    bytes — inside a binary array — are not)."""
    return data[start:end].decode("utf-8", errors="ignore").isalnum()


def whole_word_in(needle: bytes, data: bytes) -> bool:
    """``needle`` occurs in ``data`` with no letter or digit right before or after it (the
    neighbouring UTF-8 character is decoded, so "é" counts as a letter). A needle that
    starts (ends) with a non-word character needs no boundary on that side."""
    start = data.find(needle)
    if start < 0:
        return False
    text = needle.decode("utf-8", errors="ignore")
    head, tail = text[:1].isalnum(), text[-1:].isalnum()
    while start >= 0:
        end = start + len(needle)
        before = start - 1
        while before > 0 and before > start - 4 and 0x80 <= data[before] < 0xC0:  # continuation bytes
            before -= 1
        after = end + 1
        while after < len(data) and after < end + 4 and 0x80 <= data[after] < 0xC0:
            after += 1
        escaped = before >= 1 and data[before - 1:before] == b"\\" and data[before:start] in b"nrtbf"  # "\\nKeira"
        ok_before = not head or start == 0 or escaped or not _is_word_char(data, before, start)
        ok_after = not tail or end == len(data) or not _is_word_char(data, end, after)
        if ok_before and ok_after:
            return True
        start = data.find(needle, start + 1)
    return False


class OutboundAudit:
    """Counts and canary-scans outbound payloads (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._canaries: list[str] = []
        self._kinds: list[str] = []
        self._patterns: list[tuple[int, str, bytes]] = []  # (canary index, how, needle)
        self._tok = None
        self.message_type = ""  # the Flower message being handled (set by flower_mod)
        self.stats: dict[str, PayloadStats] = defaultdict(PayloadStats)

    # -- configuration ----------------------------------------------------------------

    def watch(self, canaries: list[str], kinds: list[str] | None = None) -> None:
        """Scan for these private values from now on (adds to what is watched).

        Args:
            canaries: the values; empty, repeated and < 4-character ones are ignored
                (shorter values would match inside words).
            kinds: the kind of each value (``email``, ``last_name`` …), recorded with its
                hits; default ``canary``.

        Raises:
            ValueError: ``kinds`` of another length than ``canaries``.
        """
        kinds = list(kinds) if kinds is not None else ["canary"] * len(canaries)
        if len(kinds) != len(canaries):
            raise ValueError(f"{len(kinds)} kinds for {len(canaries)} canaries")
        with self._lock:
            new = [(c, k) for c, k in dict(zip(canaries, kinds)).items()
                   if c and len(c) >= 4 and c not in self._canaries]
            if new:  # called with every message: re-tokenize only when something is added
                self._canaries.extend(c for c, _ in new)
                self._kinds.extend(str(k) for _, k in new)
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

    def find(self, data: bytes) -> list[tuple[str, str]]:
        """Every (canary kind, how) found in ``data``, each canary once per way it is found."""
        with self._lock:
            patterns, kinds = list(self._patterns), list(self._kinds)
        if not kinds:
            return []
        low = data.lower()  # ASCII letters only: enough for "KEIRA FORSTER"
        found: set[tuple[int, str]] = set()
        for n, how, needle in patterns:
            if (n, how) in found:
                continue
            if (whole_word_in(needle, low) if how == "as_text" else needle in data):
                found.add((n, how))
        return [(kinds[n], how) for n, how in sorted(found)]

    def scan(self, data: bytes) -> dict[str, int]:
        """Canary hits in ``data``: ``{"as_text": n, "as_tokens": m}`` (a canary counts once per
        way it is found)."""
        out: dict[str, int] = defaultdict(int)
        for _, how in self.find(data):
            out[how] += 1
        return dict(out)

    def outbound(self, payload: str, data: bytes | bytearray | memoryview, where: str = "") -> int:
        """Record one outbound payload of type ``payload`` (one of :data:`PAYLOADS`), given
        as the plaintext bytes about to be encrypted / sent; ``where`` names the field it
        came from (e.g. ``decoding.records``). Returns its canary hits.

        Raises:
            ValueError: an unknown payload type.
        """
        if payload not in PAYLOADS:
            raise ValueError(f"unknown payload type {payload!r}; one of {PAYLOADS}")
        data = bytes(data)
        hits = self.find(data)
        with self._lock:
            st = self.stats[payload]
            st.payloads += 1
            st.bytes += len(data)
            st.canary_hits += len(hits)
            for kind, how in hits:
                st.hit_kinds[how] += 1
                st.hits[(self.message_type, kind, how, where)] += 1
        return len(hits)

    def snapshot(self, reset: bool = False) -> dict[str, dict]:
        """``{payload type: PayloadStats.to_dict()}``; ``reset`` starts counting afresh."""
        with self._lock:
            out = {k: v.to_dict() for k, v in self.stats.items()}
            if reset:
                self.stats = defaultdict(PayloadStats)
        return out


AUDIT = OutboundAudit()
"""The process-wide audit every choke point reports to."""


def outbound(payload: str, data, where: str = "") -> int:
    """Report an outbound plaintext payload to the process-wide audit (see
    :meth:`OutboundAudit.outbound`)."""
    return AUDIT.outbound(payload, data, where)


_CANARY_VALUES: dict[tuple, dict[str, str]] = {}


def canary_values(mirror, n: int, seed: int) -> dict[str, str]:
    """The canary values of ``n`` canary prompts drawn with ``seed``, each with its kind
    (the first kind it is drawn with), sorted by value; read once per process."""
    key = (str(mirror), int(n), int(seed))
    if key not in _CANARY_VALUES:  # read the identities CSV once per process, not per message
        from .canaries import load_canary_prompts

        kinds: dict[str, str] = {}
        for p in load_canary_prompts(mirror, int(n), int(seed)):
            for c, k in zip(p.canaries, p.kinds):
                kinds.setdefault(c, k)
        _CANARY_VALUES[key] = dict(sorted(kinds.items()))
    return dict(_CANARY_VALUES[key])


def watch_canaries(cfg, tok) -> list[str]:
    """Make the process-wide audit scan for this run's canary values (the identities of the
    ``privacy.probe.canaries`` canary prompts drawn with ``cfg.seed``), as text and as ``tok``
    ids. Nothing when ``privacy.enabled`` is false. Returns the watched values."""
    priv = cfg.get("privacy")
    if not priv or not priv.enabled:
        return []
    kinds = canary_values(cfg.data.mirror, int(priv.probe.canaries), int(cfg.seed))
    AUDIT.watch(list(kinds), list(kinds.values()))
    AUDIT.use_tokenizer(tok)
    return list(kinds)


def merge(snapshots: list[dict[str, dict]]) -> dict[str, dict]:
    """Sum several :meth:`OutboundAudit.snapshot` dicts (e.g. from every client); ``hits``
    entries with the same message type, canary kind, how and field add up."""
    out: dict[str, dict] = {}
    for snap in snapshots:
        for k, v in snap.items():
            o = out.setdefault(k, {"payloads": 0, "bytes": 0, "canary_hits": 0, "hit_kinds": {},
                                   "hits": []})
            for f in ("payloads", "bytes", "canary_hits"):
                o[f] += int(v.get(f, 0))
            for how, n in v.get("hit_kinds", {}).items():
                o["hit_kinds"][how] = o["hit_kinds"].get(how, 0) + int(n)
            for h in v.get("hits", []):
                same = [x for x in o["hits"] if all(x.get(f) == h.get(f) for f in HIT_FIELDS)]
                if same:
                    same[0]["n"] += int(h.get("n", 1))
                else:
                    o["hits"].append({**{f: h.get(f, "") for f in HIT_FIELDS}, "n": int(h.get("n", 1))})
    return out


def record_bytes(content) -> list[tuple[str, str, bytes]]:
    """The bytes of a Flower ``RecordDict`` reply, as ``(payload type, field, bytes)``:
    each array of the ``adapter`` record is an ``adapter`` payload, other arrays (C2C
    ``frames``, already sealed end to end: their plaintext was audited by
    ``edgefuse.c2c.peer``) are ``sealed``, and each config / metric value is a ``metadata``
    payload ``key=value`` (bytes values as they are; a JSON string value followed, one per
    line, by the strings it holds, decoded). ``field`` is ``record.key``."""
    from flwr.app import ArrayRecord, ConfigRecord, MetricRecord

    out = []
    for name, rec in content.items():
        if isinstance(rec, ArrayRecord):
            kind = "adapter" if name == "adapter" else "sealed"
            for key, arr in rec.items():
                out.append((kind, f"{name}.{key}", bytes(arr.data)))
        elif isinstance(rec, (ConfigRecord, MetricRecord)):
            for k, v in rec.items():
                vals = v if isinstance(v, list) else [v]
                if any(isinstance(x, bytes) for x in vals):
                    out.extend(("metadata", f"{name}.{k}", x) for x in vals if isinstance(x, bytes))
                    continue
                parts = [str(k) + "=" + " ".join(map(str, vals))]
                parts.extend(s for x in vals if isinstance(x, str) for s in json_strings(x))
                out.append(("metadata", f"{name}.{k}", "\n".join(parts).encode("utf-8")))
    return out


def json_strings(text: str) -> list[str]:
    """The strings (keys and values, JSON strings nested in them too) of a JSON object or
    array given as text, decoded; ``[]`` when ``text`` is not one. ``json.dumps`` escapes
    newlines and non-ASCII names ("\\u00d8degård"), which would hide a canary or glue it to
    an escape letter."""
    import json

    s = text.lstrip()
    if not s.startswith(("{", "[")):
        return []
    try:
        tree = json.loads(s)
    except ValueError:
        return []
    out: list[str] = []

    def walk(x) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                out.append(str(k))
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
        elif isinstance(x, str):
            out.append(x)
            out.extend(json_strings(x))

    walk(tree)
    return out


def flower_mod(msg, context, call_next):
    """ClientApp mod: every reply's content passes :func:`outbound` before Flower sends it;
    the reply gains a ``privacy_audit`` ConfigRecord with this handler's payload counts (the
    cloud frames and C2C relays it sent included, their hits recorded under this message's
    type), so the server can sum them."""
    import json

    from flwr.app import ConfigRecord

    AUDIT.snapshot(reset=True)
    AUDIT.message_type = str(msg.metadata.message_type)
    try:
        reply = call_next(msg, context)
        if reply.has_content():
            for kind, where, data in record_bytes(reply.content):
                outbound(kind, data, where)
            reply.content["privacy_audit"] = ConfigRecord({"stats": json.dumps(AUDIT.snapshot(reset=True))})
    finally:
        AUDIT.message_type = ""
    return reply
