"""The split-inference messages of edgefuse.cloud.protocol: every codec round trip, every
malformed or oversized field refused (crafted bytes, not just the encoder's own checks), and
the row ledger both ends share (rollback bounds, re-sent windows, eviction)."""

from __future__ import annotations

import json
import struct

import pytest

from edgefuse.cloud import protocol as P

AUTHS = [P.CloudAuth(), P.CloudAuth(False, None), P.CloudAuth(True, 7), P.REVOKE]


def _open_bytes(head: dict, ids: bytes = b"") -> bytes:
    raw = json.dumps(head).encode()
    return bytes([P.OPEN]) + struct.pack(">H", len(raw)) + raw + ids


BASE_HEAD = {"fingerprint": "f" * 16, "temperature": 0.0, "top_k": 0, "seed": 0, "max_new": 8,
             "flag_cache": True, "l_cache": None, "offset": 0}


@pytest.mark.parametrize("msg", [
    P.Open([], "abc", split=P.SplitRequest(2, 1)),
    P.Open([], "abc", auth=P.CloudAuth(False, 9), offset=12,
           split=P.SplitRequest(1, 0, 33, "float16", "explicit")),
    P.Opened("m", "fp", 2048, P.SplitRequest(3, 2, None, "int8", None)),
    P.Opened("m", "fp", 2048),
    P.Mid(1, 0, 0, 3, bytes(range(30))),
    P.Mid(0xFFFFFFFF, 5, 2, 1, b"", P.CloudAuth(True, 4)),
    P.MidOut(7, 2, b"\x00" * 9),
    P.Head(3, 4, 0, b"\x01\x02"),
    P.Head(3, 4, 0xFFFF, b""),
    P.Logits(9, b"payload"),
    P.Logits(9, b""),
    P.Mask(b"\xff\x01"),
    P.Masked(123456),
])
def test_split_messages_round_trip(msg):
    data = P.encode(msg)
    assert P.decode(data) == msg
    assert P.message_type(data) == P.TYPE_NAMES[data[0]]


@pytest.mark.parametrize("auth", AUTHS)
def test_mid_layout_is_exact(auth):
    acts = bytes(range(17))
    data = P.encode(P.Mid(0x01020304, 9, 2, 3, acts, auth))
    lc = P.L_UNLIMITED if auth.l_cache is None else auth.l_cache
    assert data == (bytes([P.MID]) + struct.pack(">IIBIII", 0x01020304, 9, int(auth.flag_cache),
                                                 lc, 2, 3) + acts)
    assert len(data) == P.MID_HEADER_BYTES + len(acts)
    assert P.encode(P.MidOut(5, 2, b"xy")) == bytes([P.MIDOUT]) + struct.pack(">II", 5, 2) + b"xy"
    assert P.encode(P.Head(5, 2, 7, b"z")) == bytes([P.HEAD]) + struct.pack(">IIH", 5, 2, 7) + b"z"
    assert P.encode(P.Masked(3)) == bytes([P.MASKED]) + struct.pack(">I", 3)


def test_split_open_with_prompt_ids_is_refused_both_ways():
    with pytest.raises(P.ProtocolError, match="no prompt ids"):
        P.encode(P.Open([1, 2], "abc", split=P.SplitRequest(1, 0)))
    head = {**BASE_HEAD, "split": {"k": 1, "m": 0}}
    assert P.decode(_open_bytes(head)).split == P.SplitRequest(1, 0)
    with pytest.raises(P.ProtocolError, match="no prompt ids, this one has 2"):
        P.decode(_open_bytes(head, struct.pack(">ii", 5, 6)))


@pytest.mark.parametrize("split, match", [
    ([1, 0], "JSON object"),
    ({"k": 1}, "needs k and m"),
    ({"m": 1}, "needs k and m"),
    ({"k": 1, "m": 0, "extra": 1}, "unknown keys"),
    ({"k": True, "m": 0}, "k must be an int"),
    ({"k": 1.0, "m": 0}, "k must be an int"),
    ({"k": -1, "m": 0}, "k must be an int"),
    ({"k": 1, "m": P.MAX_SPLIT_INT + 1}, "m must be an int"),
    ({"k": 1, "m": 0, "head_split": "8"}, "head_split must be an int"),
    ({"k": 1, "m": 0, "act": "int4"}, "act must be one of"),
    ({"k": 1, "m": 0, "act": 8}, "act must be one of"),
    ({"k": 1, "m": 0, "mask": ""}, "mask must be null or a name"),
    ({"k": 1, "m": 0, "mask": "x" * (P.MAX_MASK_NAME + 1)}, "mask must be null or a name"),
    ({"k": 1, "m": 0, "mask": ["ascii"]}, "mask must be null or a name"),
])
def test_malformed_split_field_is_refused(split, match):
    with pytest.raises(P.ProtocolError, match=match):
        P.decode(_open_bytes({**BASE_HEAD, "split": split}))
    # the OPENED echo is parsed by the same rule
    raw = json.dumps({"model": "m", "fingerprint": "f", "context_len": 1, "split": split}).encode()
    with pytest.raises(P.ProtocolError):
        P.decode(bytes([P.OPENED]) + struct.pack(">H", len(raw)) + raw)


@pytest.mark.parametrize("data, match", [
    (bytes([P.MID]) + struct.pack(">II", 1, 2), "truncated"),  # no AUTH5
    (bytes([P.MID]) + struct.pack(">IIBI", 1, 2, 1, 5) + struct.pack(">I", 3), "truncated"),  # no n
    (bytes([P.MID]) + struct.pack(">IIBIII", 1, 2, 2, 5, 0, 1), "flag_cache byte is 2"),
    (bytes([P.MIDOUT]) + struct.pack(">I", 1), "truncated"),
    (bytes([P.HEAD]) + struct.pack(">II", 1, 2) + b"\x00", "truncated"),  # k cut short
    (bytes([P.LOGITS]) + b"\x00\x00", "truncated"),
    (bytes([P.MASKED]) + struct.pack(">I", 1) + b"\x00", "trailing"),
    (bytes([P.MASKED]), "truncated"),
])
def test_malformed_split_messages_are_refused(data, match):
    with pytest.raises(P.ProtocolError, match=match):
        P.decode(data)


@pytest.mark.parametrize("msg, match", [
    (P.Mid(-1, 0, 0, 1, b""), "req must be"),
    (P.Mid(0, 1 << 32, 0, 1, b""), "base_len must be"),
    (P.Mid(0, 0, True, 1, b""), "c must be"),
    (P.Mid(0, 0, 0, -3, b""), "n must be"),
    (P.MidOut(0, 1 << 32, b""), "n must be"),
    (P.Head(0, 1, 1 << 16, b""), "k 65536 out of range"),
    (P.Head(0, 1, -1, b""), "out of range"),
    (P.Masked(-1), "count must be"),
    (P.Open([], "a", split={"k": 1, "m": 0}), "SplitRequest"),
])
def test_out_of_range_fields_are_refused_by_the_encoder(msg, match):
    with pytest.raises(P.ProtocolError, match=match):
        P.encode(msg)


def test_split_request_refuses_bad_values_directly():
    with pytest.raises(P.ProtocolError):
        P.SplitRequest(1, 0, act="bf16")
    with pytest.raises(P.ProtocolError):
        P.SplitRequest(1, 0, head_split=0.5)
    assert P.SplitRequest.from_dict({"k": 2, "m": 1, "act": "float16"}).to_dict() == \
        {"k": 2, "m": 1, "head_split": None, "act": "float16", "mask": None}


# ------------------------------------------------------------------------------ ledger

def test_ledger_rollback_bounds():
    led = P.SplitLedger()
    led.commit(P.CloudAuth(), 0, 5)  # the prompt: 5 rows pending
    for bad in (-1, 6, 100):
        with pytest.raises(P.SyncError, match="outside 0..5"):
            led.check(bad)
    for ok in range(6):
        led.check(ok)
    led.commit(P.CloudAuth(), 5, 4)  # a draft block of 4 on 5 committed rows
    with pytest.raises(P.SyncError):
        led.check(4)  # below committed: the cloud never un-commits
    with pytest.raises(P.SyncError):
        led.check(10)
    assert led.resend(P.CloudAuth(), 7) == 0  # 2 of 4 accepted: all held, nothing re-sent
    assert led.held_at(7) == 7


def test_ledger_resend_mirrors_the_verify_rule():
    keep_none = P.CloudAuth(False, None)
    led = P.SplitLedger()
    led.commit(keep_none, 0, 6)
    assert (led.held, led.pending_held) == (0, 0)
    assert led.resend(keep_none, 6) == 6  # flag_cache off: the whole window each time
    win = P.CloudAuth(True, 4)
    led = P.SplitLedger()
    led.commit(win, 0, 6)
    assert (led.held, led.pending_held) == (0, 6)
    assert led.resend(win, 6) == 0 and led.held_at(6) == 6  # holds 6, the window needs 4
    led.commit(win, 6, 1)
    assert led.held == 4 and led.resend(win, 7) == 0
    # a shrink takes effect first: l_cache 2 keeps 2 committed rows and the pending one
    assert led.apply(P.CloudAuth(True, 2)) == 2
    assert (led.held, led.pending_held) == (2, 1)
    # revocation drops everything, and the next MID re-sends its window
    assert led.apply(P.REVOKE) == 3
    assert (led.held, led.pending_held) == (0, 0)
    assert led.resend(win, 7) == 4
    # a grow never adds rows the cloud does not hold
    led = P.SplitLedger()
    led.commit(P.CloudAuth(True, 2), 0, 5)
    led.commit(P.CloudAuth(True, 2), 5, 1)
    assert led.held == 2 and led.apply(P.CloudAuth()) == 0
    assert led.resend(P.CloudAuth(), 6) == 3  # the window is 6: 2 held + the pending row
