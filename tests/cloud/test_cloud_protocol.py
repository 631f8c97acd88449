"""The decoding protocol's messages: exact round trips, byte sizes, and refusals."""

from __future__ import annotations

import numpy as np
import pytest

import edgefuse.cloud.protocol as P


def _same(a, b):
    assert type(a) is type(b)
    for k, v in vars(a).items():
        w = getattr(b, k)
        if isinstance(v, np.ndarray) or isinstance(w, np.ndarray):
            np.testing.assert_array_equal(np.asarray(v), np.asarray(w))
        else:
            assert v == w, k


@pytest.mark.parametrize("msg", [
    P.Open([1, 2, 151935], "0123abcd", 0.7, 40, 3, 64),
    P.Verify(7, 12, []),
    P.Verify(8, 12, [5, 6, 7]),
    P.Verify(9, 3, [5, 6], np.array([[5, 1], [6, 2]]), np.array([[0.75, 0.25], [0.5, 0.5]])),
    P.Fuse(10, 20, [4, 5], 16),
    P.Fuse(11, 20, [], 1),
    P.Close(),
    P.Opened("qwen2.5-coder-1.5b", "abcd", 2048),
    P.Verified(12, 3, 151000),
    P.TopK(13, np.array([9, 151935]), np.array([0, 255], np.uint8), -0.5, 0.03125, -4.0),
    P.Error("sync", "request assumes 5 committed tokens"),
])
def test_round_trip(msg):
    _same(msg, P.decode(P.encode(msg)))


HEAD = 4 + 4 + 5 + 4  # req, base_len, cache tuple (u8 flag ‖ u32 l_cache), context count


def test_sizes_are_what_the_layout_says():
    assert len(P.encode(P.Verify(1, 2, [3, 4, 5]))) == 1 + HEAD + 1 + 3 * 4 + 1  # γ int32 ids, no q
    assert len(P.encode(P.Verify(1, 2, [3], context=[7, 8]))) == 1 + HEAD + 2 * 4 + 1 + 4 + 1
    assert len(P.encode(P.Verified(1, 2, 3))) == 1 + 9
    k = 16
    top = P.TopK(1, np.arange(k), np.zeros(k, np.uint8), 0.0, 0.1, -3.0)
    assert len(P.encode(top)) == 1 + 6 + 4 * k + k + 6  # int32 ids, uint8 values, 3 float16
    assert len(P.encode(P.Fuse(1, 2, [3], k))) == 1 + HEAD + 1 + 4 + 2
    assert len(P.encode(P.Auth(P.CloudAuth(True, 5)))) == 1 + 5
    assert len(P.encode(P.Authed(5))) == 1 + 4


def test_topk_dequantizes_below_the_top():
    top = P.TopK(1, np.array([3, 4, 5]), np.array([0, 10, 255], np.uint8), -0.25, 0.02, -6.0)
    np.testing.assert_allclose(top.logprobs(), [-0.25, -0.45, -0.25 - 5.1], atol=1e-6)


def _open_header(fields, raw: bytes | None = None) -> bytes:
    """An OPEN whose JSON header is a valid one with ``fields`` changed (or ``raw`` bytes)."""
    import json
    import struct

    h = {"offset": 0, "fingerprint": "f", "temperature": 0.0, "top_k": 0, "seed": 0, "max_new": 4,
         "flag_cache": 1, "l_cache": 0xFFFFFFFF, **(fields or {})}
    body = raw if raw is not None else json.dumps(h).encode()
    return bytes([P.OPEN]) + struct.pack(">H", len(body)) + body


@pytest.mark.parametrize("data, match", [
    (b"", "empty"),
    (bytes([99]), "unknown message type"),
    (bytes([P.VERIFY]) + b"\x00\x00", "truncated"),
    (P.encode(P.Verified(1, 2, 3)) + b"x", "trailing"),
    (P.encode(P.Verify(1, 2, [3, 4]))[:-3], "truncated"),
    (bytes([P.OPEN]) + b"\x00\x02{}", "bad field"),
    (bytes([P.OPEN]) + b"\x00\x03{x}", "does not parse"),
    (_open_header({"top_k": 1e400}), "bad field"),  # int(inf): OverflowError
    (_open_header(None, raw=b"[" * 30000 + b"]" * 30000), "does not parse"),  # a nesting bomb
])
def test_malformed_messages_are_refused(data, match):
    with pytest.raises(P.ProtocolError, match=match):
        P.decode(data)


def test_encoder_refuses_out_of_range_fields():
    with pytest.raises(P.ProtocolError):
        P.encode(P.Verify(1, 2, list(range(256))))
    with pytest.raises(P.ProtocolError):
        P.encode(P.Fuse(1, 2, [], 0))
    with pytest.raises(P.ProtocolError):
        P.encode(P.Verify(1, 2, [3, 4], np.zeros((3, 2)), np.zeros((3, 2))))
