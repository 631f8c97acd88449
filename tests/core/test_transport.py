"""Transport core: encrypted frames, tensor payloads, emulated WAN link."""

import asyncio
import math
import struct
import time

import numpy as np
import pytest
import torch

from edgefuse.transport import (
    FRAME_OVERHEAD,
    PRESETS,
    FrameError,
    HandshakeError,
    PayloadError,
    QuantizedTensor,
    ReorderError,
    ReplayError,
    SparseTensor,
    TamperedFrameError,
    TruncatedFrameError,
    WanLink,
    WanProfile,
    decode,
    densify,
    dequantize,
    derive_session,
    encode,
    generate_keypair,
    new_session_id,
    payload_nbytes,
    quantize_int8_rows,
    topk_sparse,
)
from edgefuse.transport.quant import MAGIC

SID = b"session-0123456789"


def _pair(sid=SID, ka=None, kb=None):
    ka = ka or generate_keypair()
    kb = kb or generate_keypair()
    a = derive_session(ka, kb.public_bytes(), sid, initiator=True)
    b = derive_session(kb, ka.public_bytes(), sid, initiator=False)
    return a, b, ka, kb


def _flip(frame: bytes, pos: int, bit: int = 0) -> bytes:
    out = bytearray(frame)
    out[pos] ^= 1 << bit
    return bytes(out)


# --------------------------------------------------------------------------- crypto


def test_frame_overhead_constant():
    assert FRAME_OVERHEAD == 1 + 1 + 8 + 16


def test_keypair_public_bytes_is_32_raw_bytes():
    kp = generate_keypair()
    assert isinstance(kp.public_bytes(), bytes) and len(kp.public_bytes()) == 32
    assert kp.public_bytes() != generate_keypair().public_bytes()
    assert len(new_session_id()) == 16


def test_round_trip_both_directions():
    a, b, _, _ = _pair()
    for i in range(5):
        msg = f"device->cloud {i}".encode() * (i + 1)
        assert b.open(a.seal(msg)) == msg
        reply = f"cloud->device {i}".encode()
        assert a.open(b.seal(reply)) == reply
    assert a.frames_sent == b.frames_received == 5
    assert b.frames_sent == a.frames_received == 5
    assert a.next_send_seq == b.next_recv_seq == 5


def test_empty_plaintext_round_trip():
    a, b, _, _ = _pair()
    frame = a.seal(b"")
    assert len(frame) == FRAME_OVERHEAD
    assert b.open(frame) == b""


def test_header_layout():
    a, b, _, _ = _pair()
    a.seal(b"x")
    frame = a.seal(b"hello")
    version, direction, seq = struct.unpack(">BBQ", frame[:10])
    assert (version, direction, seq) == (1, 0, 1)
    assert struct.unpack(">BBQ", b.seal(b"y")[:10]) == (1, 1, 0)


def test_direction_binding():
    a, b, _, _ = _pair()
    frame = a.seal(b"to responder")
    # A reflected frame: the sender's own receiver refuses it by its direction byte ...
    with pytest.raises(FrameError, match="direction"):
        a.open(frame)
    # ... and, with the byte rewritten, by the key (each direction has its own key).
    with pytest.raises(TamperedFrameError):
        a.open(_flip(frame, 1))
    # Same for the responder's frames at the responder.
    back = b.seal(b"to initiator")
    with pytest.raises(FrameError, match="direction"):
        b.open(back)
    with pytest.raises(TamperedFrameError):
        b.open(_flip(back, 1))
    # Both ends claiming "initiator" cannot talk.
    ka, kb = generate_keypair(), generate_keypair()
    x = derive_session(ka, kb.public_bytes(), SID, initiator=True)
    y = derive_session(kb, ka.public_bytes(), SID, initiator=True)
    with pytest.raises(FrameError):
        y.open(x.seal(b"m"))
    # The genuine sessions are unaffected.
    assert b.open(frame) == b"to responder"
    assert a.open(back) == b"to initiator"


def test_replay_rejected_and_session_survives():
    a, b, _, _ = _pair()
    f0, f1 = a.seal(b"zero"), a.seal(b"one")
    assert b.open(f0) == b"zero"
    before = (b.next_recv_seq, b.bytes_received, b.frames_received)
    with pytest.raises(ReplayError, match="seq 0, expected 1"):
        b.open(f0)
    assert (b.next_recv_seq, b.bytes_received, b.frames_received) == before
    assert b.frames_rejected == 1
    assert b.open(f1) == b"one"
    with pytest.raises(ReplayError, match="seq 1, expected 2"):
        b.open(f1)


def test_reorder_rejected_then_in_order_works():
    a, b, _, _ = _pair()
    f0, f1, f2 = a.seal(b"0"), a.seal(b"1"), a.seal(b"2")
    with pytest.raises(ReorderError, match="seq 1, expected 0"):
        b.open(f1)
    with pytest.raises(ReorderError, match="seq 2, expected 0"):
        b.open(f2)
    assert b.next_recv_seq == 0 and b.frames_received == 0 and b.bytes_received == 0
    assert [b.open(f) for f in (f0, f1, f2)] == [b"0", b"1", b"2"]
    assert b.frames_rejected == 2


def test_every_flipped_bit_is_rejected_and_session_survives():
    a, b, _, _ = _pair()
    frame = a.seal(b"the KV cache of layer 3")
    for pos in range(len(frame)):
        for bit in (0, 7):
            bad = _flip(frame, pos, bit)
            if pos in (0, 1):  # version / direction bytes
                with pytest.raises(FrameError):
                    b.open(bad)
            else:  # sequence number, ciphertext and tag are all authenticated
                with pytest.raises(TamperedFrameError):
                    b.open(bad)
    assert b.next_recv_seq == 0 and b.frames_received == 0
    assert b.frames_rejected == 2 * len(frame)
    assert b.open(frame) == b"the KV cache of layer 3"
    assert b.open(a.seal(b"next")) == b"next"


def test_version_byte_error_names_version():
    a, b, _, _ = _pair()
    frame = a.seal(b"m")
    with pytest.raises(FrameError, match="version 3"):
        b.open(_flip(frame, 0, 1))


def test_truncated_frames():
    a, b, _, _ = _pair()
    frame = a.seal(b"payload")
    for cut in (0, 1, 10, FRAME_OVERHEAD - 1):
        with pytest.raises(TruncatedFrameError, match=f"{cut} bytes"):
            b.open(frame[:cut])
    # Long enough to parse, but bytes are missing: the tag fails.
    with pytest.raises(TamperedFrameError):
        b.open(frame[:-1])
    assert b.open(frame) == b"payload"


def test_frame_from_another_session_is_rejected():
    ka, kb = generate_keypair(), generate_keypair()
    a, b, _, _ = _pair(SID, ka, kb)
    other, _, _, _ = _pair(b"another-session-id", ka, kb)  # same key pairs, other session id
    with pytest.raises(TamperedFrameError):
        b.open(other.seal(b"cross-session"))
    assert b.open(a.seal(b"ok")) == b"ok"


def test_bad_peer_keys_raise_handshake_error():
    kp = generate_keypair()
    with pytest.raises(HandshakeError, match="32 bytes, got 31"):
        derive_session(kp, b"\x01" * 31, SID, True)
    with pytest.raises(HandshakeError, match="32 bytes, got 33"):
        derive_session(kp, b"\x01" * 33, SID, True)
    with pytest.raises(HandshakeError, match="must be bytes"):
        derive_session(kp, "not bytes", SID, True)
    # Low-order points give an all-zero shared secret.
    for low_order in (bytes(32), (1).to_bytes(32, "little")):
        with pytest.raises(HandshakeError, match="low-order"):
            derive_session(kp, low_order, SID, True)
    with pytest.raises(HandshakeError, match="reflected"):
        derive_session(kp, kp.public_bytes(), SID, True)
    with pytest.raises(HandshakeError, match="session_id"):
        derive_session(kp, generate_keypair().public_bytes(), b"", True)
    assert issubclass(HandshakeError, ValueError)


def test_error_hierarchy():
    for cls in (TruncatedFrameError, ReplayError, ReorderError, TamperedFrameError):
        assert issubclass(cls, FrameError)
    assert issubclass(FrameError, ValueError)


def test_exact_byte_accounting():
    a, b, _, _ = _pair()
    sizes = [0, 1, 100, 4096]
    total = 0
    for n in sizes:
        frame = a.seal(bytes(n))
        assert len(frame) == n + FRAME_OVERHEAD
        total += len(frame)
        b.open(frame)
    assert a.bytes_sent == b.bytes_received == sum(sizes) + len(sizes) * FRAME_OVERHEAD == total
    assert a.frames_sent == b.frames_received == len(sizes)
    assert a.bytes_received == b.bytes_sent == 0
    # A rejected frame is not counted as received.
    with pytest.raises(ReplayError):
        b.open(frame)
    assert b.bytes_received == total and b.frames_received == len(sizes)


# --------------------------------------------------------------------------- quant


def test_int8_error_bound_per_row():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 7, 33)).astype(np.float32)
    x *= (10.0 ** rng.uniform(-4, 4, size=(5, 7, 1))).astype(np.float32)
    q = quantize_int8_rows(x)
    assert q.data.dtype == np.int8 and q.data.shape == x.shape
    assert q.scales.dtype == np.float16 and q.scales.shape == (35,)
    assert int(q.data.min()) >= -127 and int(q.data.max()) <= 127
    rows = x.reshape(35, 33).astype(np.float64)
    s = q.scales.astype(np.float64)
    amax = np.abs(rows).max(axis=1)
    assert np.all(s * 127 >= amax)  # scale never clips
    # ... and is max|row|/127 to within one float16 ulp (2^-24 absolute in the subnormal range).
    assert np.all(s <= amax / 127 * (1 + 2.0**-10) + 2.0**-24)
    deq = dequantize(q)
    assert deq.dtype == np.float32 and deq.shape == x.shape
    err = np.abs(deq.reshape(35, 33).astype(np.float64) - rows).max(axis=1)
    assert np.all(err <= s / 2)


def test_int8_zero_row_and_torch_input():
    x = torch.tensor([[0.0, 0.0, 0.0], [1.0, -2.0, 0.5]], dtype=torch.bfloat16)
    q = quantize_int8_rows(x)
    assert float(q.scales[0]) == 0.0
    assert np.all(q.data[0] == 0)
    deq = dequantize(q)
    assert not np.any(np.isnan(deq))
    assert np.all(deq[0] == 0)
    s1 = float(q.scales[1])
    assert s1 * 127 >= 2.0 and q.data[1, 1] == -127  # the row max maps to ±127
    assert q.data[1].tolist() == [round(1.0 / s1), -127, round(0.5 / s1)]
    assert np.allclose(deq[1], [1.0, -2.0, 0.5], atol=float(q.scales[1]) / 2)


def test_int8_rejects_nonfinite_and_ints():
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_int8_rows(np.array([[1.0, np.nan]], dtype=np.float32))
    with pytest.raises(TypeError):
        quantize_int8_rows(np.array([[1, 2]], dtype=np.int64))


def test_topk_hand_example():
    x = np.array([[1.0, -5.0, 3.0, 0.5], [4.0, 0.0, -0.25, -6.0]], dtype=np.float32)
    s = topk_sparse(x, 2)
    assert s.shape == (2, 4) and s.k == 2
    assert s.indices.dtype == np.uint32 and s.values.dtype == np.float16
    assert s.indices.tolist() == [[1, 2], [0, 3]]
    assert s.values.tolist() == [[-5.0, 3.0], [4.0, -6.0]]
    assert densify(s).tolist() == [[0.0, -5.0, 3.0, 0.0], [4.0, 0.0, 0.0, -6.0]]
    # Ties go to the lower column index.
    assert topk_sparse(np.array([1.0, -1.0, 1.0, 0.0]), 2).indices.tolist() == [[0, 1]]
    with pytest.raises(ValueError, match="k must be"):
        topk_sparse(x, 5)


def test_topk_keeps_largest_magnitudes_random():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 4, 50)).astype(np.float32)
    s = topk_sparse(torch.from_numpy(x), 7)
    rows = x.reshape(12, 50)
    for r in range(12):
        kept = set(s.indices[r].tolist())
        assert kept == set(np.argsort(-np.abs(rows[r]))[:7].tolist())
    d = densify(s)
    assert d.shape == x.shape and np.count_nonzero(d) == 12 * 7


def test_encode_decode_round_trips():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3, 16)).astype(np.float32)
    q = quantize_int8_rows(x)
    q2 = decode(encode(q))
    assert isinstance(q2, QuantizedTensor)
    assert q2.data.tobytes() == q.data.tobytes() and q2.data.shape == q.data.shape
    assert q2.scales.tobytes() == q.scales.tobytes()

    s = topk_sparse(x, 4)
    s2 = decode(encode(s))
    assert isinstance(s2, SparseTensor) and s2.shape == s.shape
    assert np.array_equal(s2.indices, s.indices) and s2.values.tobytes() == s.values.tobytes()
    assert np.array_equal(densify(s2), densify(s))

    f = np.array([[1.5, -np.inf, np.nan, 3e38]], dtype=np.float32)
    f2 = decode(encode(f))
    assert f2.dtype == np.float32 and f2.shape == f.shape and f2.tobytes() == f.tobytes()

    for ids in (
        np.array([0, 1, 151_935, 2**31 - 1], dtype=np.int64),
        np.array([[5, 7, 9]], dtype=np.int32),
        np.array(42, dtype=np.int64),
    ):
        back = decode(encode(ids))
        assert back.dtype == ids.dtype and back.shape == ids.shape and np.array_equal(back, ids)
    t = decode(encode(torch.tensor([[3, 1, 4]], dtype=torch.long)))
    assert t.dtype == np.int64 and t.tolist() == [[3, 1, 4]]


def test_int8_kv_payload_size_formula():
    kv = np.random.default_rng(3).standard_normal((2, 8, 64, 64)).astype(np.float32)
    numel, rows = 2 * 8 * 64 * 64, 2 * 8 * 64
    header = 4 + 1 + 1 + 1 + 4 * 4
    assert payload_nbytes(kv) == header + 4 * numel == len(encode(kv))
    assert payload_nbytes(quantize_int8_rows(kv)) == header + numel + 2 * rows == 67_607
    assert 0.25 < payload_nbytes(quantize_int8_rows(kv)) / kv.nbytes < 0.26
    s = topk_sparse(kv, 8)
    assert payload_nbytes(s) == header + 4 + rows * 8 * (4 + 2)


def _header(kind, code, shape, extra=b""):
    return MAGIC + bytes([kind, code, len(shape)]) + struct.pack(f"<{len(shape)}I", *shape) + extra


def test_malformed_payloads():
    good = encode(quantize_int8_rows(np.ones((2, 8), dtype=np.float32)))
    cases = {
        "bad magic": b"XXXX" + good[4:],
        "shorter than": good[:5],
        "truncated": good[:-1],
        "trailing": good + b"\x00",
        "unknown payload kind": good[:4] + b"\x09" + good[5:],
        "not allowed": good[:5] + b"\x01" + good[6:],  # float32 dtype code on an int8 payload
    }
    for msg, data in cases.items():
        with pytest.raises(PayloadError, match=msg):
            decode(data)
    # Shape in the header not matching the body: one row more / one row less.
    body = good[7 + 8 :]
    with pytest.raises(PayloadError, match="truncated"):
        decode(_header(2, 3, (3, 8)) + body)
    with pytest.raises(PayloadError, match="trailing"):
        decode(_header(2, 3, (1, 8)) + body)
    with pytest.raises(PayloadError, match="ndim"):
        decode(_header(1, 1, (1,) * 9))
    with pytest.raises(PayloadError, match="too short"):
        decode(MAGIC + bytes([1, 1, 3]) + b"\x01\x00")
    with pytest.raises(PayloadError, match="bytes"):
        decode("not bytes")


def test_absurd_shape_fails_fast_without_allocating():
    import tracemalloc

    data = _header(1, 1, (0xFFFFFFFF,) * 8) + b"\x00" * 16
    tracemalloc.start()
    try:
        with pytest.raises(PayloadError, match="truncated"):
            decode(data)
        with pytest.raises(PayloadError, match="truncated"):
            decode(_header(3, 2, (0xFFFFFFFF, 0xFFFFFFFF), struct.pack("<I", 0xFFFFFFFF)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # refused from the header: nothing of the declared size allocated


def test_malformed_content():
    q = quantize_int8_rows(np.ones((1, 4), dtype=np.float32))
    raw = bytearray(encode(q))
    raw[7 + 8] = 0x80  # int8 -128
    with pytest.raises(PayloadError, match="-128"):
        decode(bytes(raw))
    raw = bytearray(encode(q))
    raw[-2:] = np.array([-1.0], dtype=np.float16).tobytes()
    with pytest.raises(PayloadError, match="scales"):
        decode(bytes(raw))
    raw[-2:] = np.array([np.nan], dtype=np.float16).tobytes()
    with pytest.raises(PayloadError, match="scales"):
        decode(bytes(raw))

    def sparse(cols, k, idx, vals):
        return (
            _header(3, 2, (1, cols), struct.pack("<I", k))
            + np.array(idx, dtype="<u4").tobytes()
            + np.array(vals, dtype="<f2").tobytes()
        )

    assert densify(decode(sparse(4, 2, [0, 3], [1.0, 2.0]))).tolist() == [[1.0, 0, 0, 2.0]]
    with pytest.raises(PayloadError, match="out of range"):
        decode(sparse(4, 2, [0, 4], [1.0, 2.0]))
    with pytest.raises(PayloadError, match="increasing"):
        decode(sparse(4, 2, [3, 0], [1.0, 2.0]))
    with pytest.raises(PayloadError, match="increasing"):
        decode(sparse(4, 2, [1, 1], [1.0, 2.0]))
    with pytest.raises(PayloadError, match="exceeds"):
        decode(sparse(2, 3, [0, 1, 2], [1.0, 2.0, 3.0]))
    with pytest.raises(PayloadError, match="finite"):
        decode(sparse(4, 2, [0, 1], [np.inf, 2.0]))


# --------------------------------------------------------------------------- wan


def test_wan_delay_formula():
    link = WanLink(WanProfile(rtt_ms=20.0, bandwidth_mbps=100.0))
    # 10 ms one-way + 1500 B · 8 / 100e6 bit/s = 0.010 + 0.00012 s
    assert link.delay_s(1500) == pytest.approx(0.01012, abs=1e-12)
    assert link.delay_s(0) == pytest.approx(0.010, abs=1e-12)
    assert link.bytes == 1500 and link.frames == 2
    assert link.delay_s_total == pytest.approx(0.02012, abs=1e-12)
    assert WanLink(PRESETS["none"]).delay_s(10**9) == 0.0


def test_wan_seeded_jitter_and_loss_reproducible():
    prof = WanProfile(rtt_ms=20.0, bandwidth_mbps=100.0, jitter_ms=3.0, loss=0.3, seed=7)
    d1 = [WanLink(prof).delay_s(1000) for _ in range(1)]
    a, b = WanLink(prof), WanLink(prof)
    da = [a.delay_s(1000) for _ in range(200)]
    db = [b.delay_s(1000) for _ in range(200)]
    assert da == db and da[0] == d1[0]
    assert a.retransmissions == b.retransmissions > 0
    c = WanLink(WanProfile(20.0, 100.0, jitter_ms=3.0, loss=0.3, seed=8))
    assert [c.delay_s(1000) for _ in range(200)] != da
    assert len(set(da)) > 100  # jitter varies


def test_wan_loss_adds_whole_rtts():
    link = WanLink(WanProfile(rtt_ms=10.0, bandwidth_mbps=100.0, loss=0.5, seed=1))
    base = 0.005 + 1000 * 8 / 100e6
    extra = [(link.delay_s(1000) - base) / 0.010 for _ in range(100)]
    assert all(abs(e - round(e)) < 1e-9 and e >= -1e-9 for e in extra)
    assert round(sum(extra)) == link.retransmissions > 0


def test_wan_jitter_clipped_at_zero():
    link = WanLink(WanProfile(rtt_ms=0.0, bandwidth_mbps=math.inf, jitter_ms=5.0, seed=3))
    ds = [link.delay_s(100) for _ in range(100)]
    assert min(ds) == 0.0 and all(d >= 0 for d in ds)


def test_wan_presets_and_from_name():
    assert set(PRESETS) >= {"lan", "wan20", "wan80", "none"}
    assert WanProfile.from_name("wan20") == WanProfile(20.0, 100.0)
    assert WanProfile.from_name("wan80") == WanProfile(80.0, 100.0)
    assert WanProfile.from_name("none").rtt_ms == 0.0
    with pytest.raises(ValueError, match="wan20"):
        WanProfile.from_name("mars")
    for bad in (dict(rtt_ms=-1, bandwidth_mbps=1), dict(rtt_ms=1, bandwidth_mbps=0),
                dict(rtt_ms=1, bandwidth_mbps=1, loss=1.0), dict(rtt_ms=1, bandwidth_mbps=1, jitter_ms=-1)):
        with pytest.raises(ValueError):
            WanProfile(**bad)


def test_wan_send_delay_sleeps():
    link = WanLink(WanProfile(rtt_ms=20.0, bandwidth_mbps=100.0))
    t0 = time.perf_counter()
    d = link.send_delay(125_000)  # 10 ms + 10 ms
    assert d == pytest.approx(0.020)
    assert time.perf_counter() - t0 >= 0.019
    t0 = time.perf_counter()
    d = asyncio.run(link.asend_delay(0))
    assert d == pytest.approx(0.010)
    assert time.perf_counter() - t0 >= 0.009
    assert link.frames == 2 and link.bytes == 125_000
