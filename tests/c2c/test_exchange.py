"""KV cache wire codec (edgefuse.c2c.exchange): round trips, error bound, fuser equivalence,
tampering, size, and the blob sealed end to end.

Tiny random-weight llama / qwen2 / gemma3_text (3 / 2 / 6 layers); gemma3's sliding window
is 16, so after a 24-token prompt its five sliding layers hold 15 tokens, the full one 24.
"""

import struct

import numpy as np
import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from edgefuse.models import tiny_model
from edgefuse.transport import quant
from edgefuse.transport.crypto import (
    HEADER_BYTES,
    TamperedFrameError,
    derive_session,
    generate_keypair,
    new_session_id,
)
from edgefuse.c2c import (
    C2CFuser,
    FuserConfig,
    KVPayloadError,
    copy_cache,
    decode_kv_cache,
    encode_kv_cache,
    fused_forward,
    kv_spec_from_config,
)

ARCHS = ("llama", "qwen2", "gemma3_text")
PROMPT_LEN = 24  # > gemma3's window of 16


@pytest.fixture(scope="module")
def tiny():
    """{arch: (model, cache of a random 24-token prompt, batch 2)}."""
    out = {}
    g = torch.Generator().manual_seed(0)
    for i, arch in enumerate(ARCHS):
        model, tok = tiny_model(arch, seed=i)
        model.requires_grad_(False)
        ids = torch.randint(10, len(tok), (2, PROMPT_LEN), generator=g)
        with torch.no_grad():
            out[arch] = (model, model(ids, use_cache=True).cache)
    return out


def float32_bytes(cache):
    return sum(4 * (layer.keys.numel() + layer.values.numel()) for layer in cache.layers)


def assert_within_bound(orig: torch.Tensor, got: torch.Tensor):
    """|x - x̂| <= scale/2 per element, scale the stored float16 row scale, and
    scale <= max|row|/127 * (1 + 2^-9) + 2^-23 (the bound stated in edgefuse.c2c.exchange)."""
    x = orig.detach().float().numpy().astype(np.float64)
    scale = quant.quantize_int8_rows(orig.detach().float()).scales.astype(np.float64).reshape(x.shape[:-1] + (1,))
    err = np.abs(x - got.numpy().astype(np.float64))
    assert np.all(err <= scale / 2 * (1 + 1e-12)), float((err - scale / 2).max())
    amax = np.abs(x).max(axis=-1, keepdims=True)
    assert np.all(scale <= amax / 127 * (1 + 2**-9) + 2**-23)
    assert np.all(err <= (amax / 127 * (1 + 2**-9) + 2**-23) / 2 * (1 + 1e-12))


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_shapes_lengths_and_error_bound(tiny, arch):
    _, cache = tiny[arch]
    blob = encode_kv_cache(cache)
    got = decode_kv_cache(blob)
    assert len(got.layers) == len(cache.layers)
    for a, b in zip(cache.layers, got.layers):
        assert type(b) is type(a)
        assert b.keys.shape == a.keys.shape and b.values.shape == a.values.shape
        assert b.keys.dtype == torch.float32
        assert b.get_seq_length() == a.get_seq_length() == PROMPT_LEN
        assert getattr(b, "sliding_window", None) == getattr(a, "sliding_window", None)
        assert_within_bound(a.keys, b.keys)
        assert_within_bound(a.values, b.values)
    lengths = [layer.keys.shape[2] for layer in got.layers]
    assert lengths == ([15] * 5 + [24] if arch == "gemma3_text" else [24] * len(lengths))
    assert len(blob) <= 0.30 * float32_bytes(cache)


def test_bfloat16_cache_and_output_dtype(tiny):
    _, cache = tiny["gemma3_text"]
    bf = copy_cache(cache)
    for layer in bf.layers:
        layer.keys, layer.values = layer.keys.bfloat16(), layer.values.bfloat16()
    blob = encode_kv_cache(bf)
    got = decode_kv_cache(blob)
    for a, b in zip(bf.layers, got.layers):
        assert_within_bound(a.keys.float(), b.keys)  # bf16 -> float32 is exact
        assert_within_bound(a.values.float(), b.values)
    narrow = decode_kv_cache(blob, dtype=torch.bfloat16)
    assert all(layer.keys.dtype == torch.bfloat16 for layer in narrow.layers)
    assert torch.equal(narrow.layers[0].keys, got.layers[0].keys.bfloat16())
    with pytest.raises(TypeError, match="floating"):
        decode_kv_cache(blob, dtype=torch.int32)


def zeroed(cache):
    """A copy of ``cache`` with every key and value set to 0 (same layers, shapes, lengths)."""
    out = copy_cache(cache)
    for layer in out.layers:
        layer.keys, layer.values = torch.zeros_like(layer.keys), torch.zeros_like(layer.values)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_decoding_continues_from_a_decoded_cache(tiny, arch):
    """The int8 round trip costs the continuation's logits at most a tenth of what losing the
    cache costs: err(decoded) < 0.1 x err(zeroed cache) and < 0.1 x err(another prompt's cache),
    each the largest |logit difference| from decoding with the original cache."""
    model, cache = tiny[arch]
    got = decode_kv_cache(encode_kv_cache(cache))
    ids = torch.randint(10, model.config.vocab_size, (2, PROMPT_LEN), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        other = model(ids, use_cache=True).cache  # same shapes, another prompt
    cont = torch.tensor([[11, 12, 13], [14, 15, 16]])
    with torch.no_grad():
        want = fused_forward(model, cache, cont)
        err = {name: float((fused_forward(model, c, cont) - want).abs().max())
               for name, c in (("decoded", got), ("zeroed", zeroed(cache)), ("other", other))}
    print(arch, err)
    assert err["decoded"] < 0.1 * err["zeroed"], err
    assert err["decoded"] < 0.1 * err["other"], err
    assert got.get_seq_length() == PROMPT_LEN  # fused_forward appended to a copy


@pytest.mark.parametrize("recv,share", [("llama", "gemma3_text"), ("gemma3_text", "qwen2"), ("qwen2", "llama")])
def test_fuser_output_from_decoded_sharer_cache(tiny, recv, share):
    (r_model, r_cache), (s_model, s_cache) = tiny[recv], tiny[share]
    torch.manual_seed(0)
    fuser = C2CFuser(kv_spec_from_config(r_model.config), kv_spec_from_config(s_model.config),
                     FuserConfig(bottleneck=16, gate_init=1.0))  # hard gates on in eval
    with torch.no_grad():
        for layer in fuser.layers.values():
            for branch in (layer.key, layer.value):
                branch.up.weight.normal_(0, 0.5)
                branch.up.bias.normal_(0, 0.5)
    fuser.eval()
    sent = decode_kv_cache(encode_kv_cache(s_cache))
    with torch.no_grad():
        want, have = fuser(r_cache, s_cache), fuser(r_cache, sent)
        for i, (a, b, r) in enumerate(zip(want.layers, have.layers, r_cache.layers)):
            for name in ("keys", "values"):
                delta = (getattr(a, name) - getattr(r, name)).abs().max()
                diff = (getattr(a, name) - getattr(b, name)).abs().max()
                assert diff <= 0.02 * max(float(delta), 1e-6), (i, name, float(diff), float(delta))
        cont = torch.tensor([[11, 12], [13, 14]])
        lw, lh = fused_forward(r_model, want, cont), fused_forward(r_model, have, cont)
    assert (lw - lh).abs().max() < 0.02 * lw.abs().max()


def test_size_of_a_realistic_cache():
    """SmolLM2-135M shape: 30 layers, 3 KV heads of 64, 128 prompt tokens: ~0.258x float32."""
    g = torch.Generator().manual_seed(0)
    cache = DynamicCache()
    for i in range(30):
        cache.update(torch.randn(1, 3, 128, 64, generator=g), torch.randn(1, 3, 128, 64, generator=g), i)
    blob = encode_kv_cache(cache)
    ratio = len(blob) / float32_bytes(cache)
    assert 0.25 < ratio <= 0.26
    got = decode_kv_cache(blob)
    assert all(type(layer) is DynamicLayer and layer.get_seq_length() == 128 for layer in got.layers)
    assert_within_bound(cache.layers[7].values, got.layers[7].values)


def test_encode_rejects_bad_caches():
    with pytest.raises(ValueError, match="0 layers"):
        encode_kv_cache(DynamicCache())
    cache = DynamicCache()
    cache.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), 0)
    cache.layers.append(DynamicLayer())
    with pytest.raises(ValueError, match="layer 1 is empty"):
        encode_kv_cache(cache)
    cache.layers[1].update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 5))
    with pytest.raises(ValueError, match="equal"):
        encode_kv_cache(cache)
    nan = DynamicCache()
    nan.update(torch.full((1, 1, 2, 4), float("nan")), torch.zeros(1, 1, 2, 4), 0)
    with pytest.raises(ValueError, match="NaN"):
        encode_kv_cache(nan)


# ---------------------------------------------------------------- tampering


def craft(layers, magic=b"EKV1", version=1, count=None):
    """A blob laid out by hand from the documented wire format."""
    out = struct.pack("<4sBH", magic, version, len(layers) if count is None else count)
    for kind, window, seen, k_payload, v_payload in layers:
        out += struct.pack("<BII", kind, window, seen)
        out += struct.pack("<Q", len(k_payload)) + k_payload + struct.pack("<Q", len(v_payload)) + v_payload
    return out


def q(shape, seed=0):
    return quant.encode(quant.quantize_int8_rows(torch.randn(*shape, generator=torch.Generator().manual_seed(seed))))


def test_crafted_blob_matches_the_documented_format():
    k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    cache = DynamicCache()
    cache.update(k, v, 0)
    layer = DynamicSlidingWindowLayer(sliding_window=4)
    layer.update(k, v)  # keeps the last 3 of 5
    cache.layers.append(layer)
    blob = encode_kv_cache(cache)
    enc = lambda t: quant.encode(quant.quantize_int8_rows(t))  # noqa: E731
    assert blob == craft([(0, 0, 5, enc(k), enc(v)), (1, 4, 5, enc(k[:, :, 2:]), enc(v[:, :, 2:]))])
    got = decode_kv_cache(blob)
    assert type(got.layers[1]) is DynamicSlidingWindowLayer
    assert got.layers[1].get_seq_length() == 5 and got.layers[1].keys.shape[2] == 3


def test_tampered_blobs_raise(tiny):
    blob = encode_kv_cache(tiny["llama"][1])
    cases = {
        "bad magic": bytes([blob[0] ^ 1]) + blob[1:],
        "version": blob[:4] + b"\x02" + blob[5:],
        "layer count 0": blob[:5] + b"\x00\x00" + blob[7:],
        "layer count 65535": blob[:5] + b"\xff\xff" + blob[7:],
        "1000 layers need": blob[:5] + struct.pack("<H", 1000) + blob[7:],
        "unknown kind": blob[:7] + b"\x07" + blob[8:],
        "claims 25 seen": blob[:12] + struct.pack("<I", 25) + blob[16:],
        "keys: bad magic": blob[:24] + b"X" + blob[25:],
        "trailing": blob + b"\x00",
        "keys claims": blob[:16] + struct.pack("<Q", 2**60) + blob[24:],
    }
    for what, bad in cases.items():
        with pytest.raises(KVPayloadError, match=what):
            decode_kv_cache(bad)
    for cut in (0, 3, 6, 7, 10, 20, 30, 500, len(blob) // 2, len(blob) - 1):
        with pytest.raises(KVPayloadError, match="truncated|shorter"):
            decode_kv_cache(blob[:cut])
    with pytest.raises(KVPayloadError, match="must be bytes"):
        decode_kv_cache("EKV1")
    assert issubclass(KVPayloadError, ValueError)


def test_inconsistent_crafted_layers_raise():
    shape = (1, 2, 4, 8)
    ok = (0, 0, 4, q(shape), q(shape, 1))
    assert decode_kv_cache(craft([ok])).get_seq_length() == 4
    bad = {
        "differ in shape": [(0, 0, 4, q(shape), q((1, 2, 3, 8)))],
        "batch 2": [ok, (0, 0, 4, q((2, 2, 4, 8)), q((2, 2, 4, 8)))],
        "expected 4-d int8": [(0, 0, 4, q((2, 4, 8)), q((2, 4, 8)))],
        "QuantizedTensor|ndarray": [(0, 0, 4, quant.encode(torch.zeros(shape)), q(shape))],
        "window >= 2": [(1, 1, 4, q(shape), q(shape))],
        "min\\(seen, window - 1\\)": [(1, 16, 9, q(shape), q(shape))],
        "empty": [(0, 0, 0, q((1, 2, 0, 8)), q((1, 2, 0, 8)))],
    }
    for what, layers in bad.items():
        with pytest.raises(KVPayloadError, match=what):
            decode_kv_cache(craft(layers))


# ---------------------------------------------------------------- sealed end to end


def test_sealed_end_to_end(tiny):
    _, cache = tiny["gemma3_text"]
    sharer, receiver = generate_keypair(), generate_keypair()
    sid = new_session_id()
    tx = derive_session(sharer, receiver.public_bytes(), sid, initiator=True)
    rx = derive_session(receiver, sharer.public_bytes(), sid, initiator=False)
    blob = encode_kv_cache(cache)
    frame = tx.seal(blob)
    tampered = bytearray(frame)
    tampered[HEADER_BYTES + len(blob) // 2] ^= 0x01
    with pytest.raises(TamperedFrameError):
        rx.open(bytes(tampered))
    got = decode_kv_cache(rx.open(frame))  # the genuine frame still opens
    for a, b in zip(cache.layers, got.layers):
        assert b.keys.shape == a.keys.shape and b.get_seq_length() == a.get_seq_length()
        assert_within_bound(a.keys, b.keys)
