"""The wire codec of a prompt KV cache for C2C exchange between devices.

A *sharer* device prefills a prompt and sends its transformers ``DynamicCache`` to a
*receiver* device, which fuses it into its own cache (:class:`edgefuse.c2c.fuser.C2CFuser`).
:func:`encode_kv_cache` turns the cache into one bytes blob (the caller then seals it
with :meth:`edgefuse.transport.crypto.SecureSession.seal`); :func:`decode_kv_cache`
rebuilds the cache on the other side. Keys and values travel as symmetric per-row int8
(:func:`edgefuse.transport.quant.quantize_int8_rows`, rows = all dims but ``head_dim``),
each tensor as one :func:`edgefuse.transport.quant.encode` payload.

Wire format (little-endian)::

    offset  size  field
    0       4     magic b"EKV1"
    4       1     version (1)
    5       2     number of layers L, uint16, 1..MAX_LAYERS
    then L times:
            1     layer kind: 0 = full attention, 1 = sliding window
            4     sliding window, uint32 (0 for a full layer)
            4     prompt tokens the layer has seen, uint32 (its ``get_seq_length()``)
            8     key payload length n_k, uint64
            n_k   keys: quant int8 payload of shape [batch, kv_heads, T_i, head_dim]
            8     value payload length n_v, uint64
            n_v   values: quant int8 payload, same shape as the keys

``T_i`` is the number of cached tokens of layer ``i``: the seen count for a full layer,
``min(seen, window - 1)`` for a transformers ``DynamicSlidingWindowLayer`` (Gemma 3).
Decoding rebuilds the same layer types with the same lengths and seen counts, so the
fuser's and the model's length bookkeeping (``get_seq_length``, sliding masks) is intact.

**Error bound.** ``quantize_int8_rows`` stores per row ``scale`` = ``max|row| / 127``
rounded to float16 and stepped *up* one float16 ulp when rounding went below, then
``q = rint(x / scale)``; the float32 dequantization ``q * scale`` is exact. So for every
element ``|x - x̂| ≤ scale / 2``, with ``scale ≤ (max|row| / 127) * (1 + 2**-9) + 2**-23``
(the two terms: 1.5 float16 ulps for a normal scale, for a subnormal one). Bfloat16 and
float16 inputs are converted to float32 exactly first, so the bound is against them.
Decoding to a narrower ``dtype`` adds that dtype's rounding on top.

Size: ``T_i·H·D`` int8 bytes plus 2 bytes of scale per ``D`` values, i.e. ``(1 + 2/D) / 4``
of float32 (0.28× at ``head_dim`` 16, 0.26× at 64) plus 71 bytes of headers per layer.
"""

from __future__ import annotations

import struct

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from edgefuse.transport.quant import (
    PayloadError,
    QuantizedTensor,
    decode,
    dequantize,
    encode,
    quantize_int8_rows,
)

MAGIC = b"EKV1"
VERSION = 1
MAX_LAYERS = 1024
KIND_FULL = 0
KIND_SLIDING = 1
_HEADER = struct.Struct("<4sBH")  # magic, version, layers
_LAYER = struct.Struct("<BII")  # kind, sliding window, seen tokens
_LEN = struct.Struct("<Q")  # payload length
# A layer needs at least its header, two lengths and two payloads; an int8 payload of a
# 4-d tensor is at least 7 + 16 header bytes.
_MIN_LAYER_BYTES = _LAYER.size + 2 * (_LEN.size + 23)


class KVPayloadError(ValueError):
    """A malformed or untrusted KV cache blob; the message says what was wrong."""


def _layer_tensors(layer, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    keys, values = layer.keys, layer.values
    if keys is None or values is None or keys.numel() == 0:
        raise ValueError(f"cache layer {i} is empty: prefill the prompt before encoding")
    if keys.dim() != 4 or values.shape != keys.shape:
        raise ValueError(f"cache layer {i} has keys {tuple(keys.shape)} and values {tuple(values.shape)}: "
                         "expected equal [batch, kv_heads, T, head_dim] shapes")
    return keys, values


def encode_kv_cache(cache: DynamicCache) -> bytes:
    """Serialize a prefilled ``DynamicCache`` as int8 per-row payloads (see module docstring).

    Args:
        cache: every layer filled, keys and values ``[batch, kv_heads, T_i, head_dim]``
            (float32, bfloat16 or float16, any device; converted to float32 first).
            Layers are full (``DynamicLayer``) or ``DynamicSlidingWindowLayer``.

    Returns:
        The blob: about ``(1 + 2/head_dim) / 4`` of the float32 bytes of the cache.

    Raises:
        ValueError: no layers or more than ``MAX_LAYERS``; an empty layer; keys and values
            of different shapes or not 4-d; a full layer whose length differs from its
            ``get_seq_length()``; a sliding layer not holding ``min(seen, window - 1)``
            tokens (e.g. one recording its past); NaN/inf or values beyond float16 scale
            range (from ``quantize_int8_rows``).
    """
    layers = list(cache.layers)
    if not 1 <= len(layers) <= MAX_LAYERS:
        raise ValueError(f"cannot encode a cache of {len(layers)} layers (1..{MAX_LAYERS})")
    parts = [_HEADER.pack(MAGIC, VERSION, len(layers))]
    for i, layer in enumerate(layers):
        keys, values = _layer_tensors(layer, i)
        t, seen = keys.shape[2], int(layer.get_seq_length())
        if getattr(layer, "is_sliding", False):
            window = int(getattr(layer, "sliding_window", 0) or 0)
            if window < 2 or t != min(seen, window - 1):
                raise ValueError(f"sliding cache layer {i} holds {t} tokens after {seen} seen with window "
                                 f"{window}: expected min(seen, window - 1)")
            kind = KIND_SLIDING
        else:
            if t != seen:
                raise ValueError(f"cache layer {i} holds {t} tokens but reports {seen}")
            kind, window = KIND_FULL, 0
        parts.append(_LAYER.pack(kind, window, seen))
        for tensor in (keys, values):
            payload = encode(quantize_int8_rows(tensor.detach().float()))
            parts += [_LEN.pack(len(payload)), payload]
    return b"".join(parts)


def _payload(buf: memoryview, off: int, i: int, what: str) -> tuple[QuantizedTensor, int]:
    """Read one length-prefixed int8 payload at ``off``; return it and the next offset."""
    if len(buf) - off < _LEN.size:
        raise KVPayloadError(f"truncated blob: layer {i} {what} length missing")
    (n,) = _LEN.unpack_from(buf, off)
    off += _LEN.size
    if n > len(buf) - off:
        raise KVPayloadError(f"truncated blob: layer {i} {what} claims {n} bytes, {len(buf) - off} left")
    try:
        q = decode(buf[off:off + n])
    except PayloadError as exc:
        raise KVPayloadError(f"layer {i} {what}: {exc}") from None
    if not isinstance(q, QuantizedTensor) or q.data.ndim != 4:
        kind = type(q).__name__ if not isinstance(q, QuantizedTensor) else f"{q.data.ndim}-d int8"
        raise KVPayloadError(f"layer {i} {what} is a {kind} payload, expected 4-d int8 rows")
    return q, off + n


def decode_kv_cache(data: bytes, device=None, dtype: torch.dtype = torch.float32) -> DynamicCache:
    """Rebuild the cache that :func:`encode_kv_cache` serialized.

    Args:
        data: the blob (bytes, bytearray or memoryview), e.g. from ``SecureSession.open``.
        device: where the tensors go (default CPU).
        dtype: floating dtype of the dequantized keys and values (default float32).

    Returns:
        A ``DynamicCache`` whose layer ``i`` is a ``DynamicLayer`` or a
        ``DynamicSlidingWindowLayer`` (same window and ``get_seq_length()`` as encoded)
        holding keys and values ``[batch, kv_heads, T_i, head_dim]``, each element within
        ``scale / 2`` of the original (module docstring).

    Raises:
        KVPayloadError: not bytes; bad magic or version; 0 or more than ``MAX_LAYERS``
            layers, or more than the blob can hold; truncated data or trailing bytes;
            an unknown layer kind; a malformed tensor payload (``quant.PayloadError``
            wrapped) or one that is not 4-d int8; keys and values of different shapes;
            batch sizes that differ across layers; a full layer whose length differs from
            its seen count; a sliding layer with window < 2 or not holding
            ``min(seen, window - 1)`` tokens.
        TypeError: ``dtype`` is not a floating dtype.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise KVPayloadError(f"KV blob must be bytes, got {type(data).__name__}")
    if not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating dtype, got {dtype}")
    buf = memoryview(data).cast("B")
    if len(buf) < _HEADER.size:
        raise KVPayloadError(f"blob is {len(buf)} bytes, shorter than the {_HEADER.size}-byte header")
    magic, version, n_layers = _HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise KVPayloadError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r})")
    if version != VERSION:
        raise KVPayloadError(f"unsupported KV blob version {version} (expected {VERSION})")
    if not 1 <= n_layers <= MAX_LAYERS:
        raise KVPayloadError(f"layer count {n_layers} out of range 1..{MAX_LAYERS}")
    off = _HEADER.size
    if n_layers * _MIN_LAYER_BYTES > len(buf) - off:
        raise KVPayloadError(f"truncated blob: {n_layers} layers need at least {n_layers * _MIN_LAYER_BYTES} "
                             f"bytes, {len(buf) - off} left")
    layers, batch = [], None
    for i in range(n_layers):
        if len(buf) - off < _LAYER.size:
            raise KVPayloadError(f"truncated blob: layer {i} header missing")
        kind, window, seen = _LAYER.unpack_from(buf, off)
        off += _LAYER.size
        if kind not in (KIND_FULL, KIND_SLIDING):
            raise KVPayloadError(f"layer {i} has unknown kind {kind}")
        kq, off = _payload(buf, off, i, "keys")
        vq, off = _payload(buf, off, i, "values")
        if kq.shape != vq.shape:
            raise KVPayloadError(f"layer {i} keys {kq.shape} and values {vq.shape} differ in shape")
        b, _, t, _ = kq.shape
        if 0 in kq.shape:
            raise KVPayloadError(f"layer {i} is empty: shape {kq.shape}")
        if batch is not None and b != batch:
            raise KVPayloadError(f"layer {i} has batch {b}, earlier layers {batch}")
        batch = b
        if kind == KIND_FULL and t != seen:
            raise KVPayloadError(f"full layer {i} holds {t} tokens but claims {seen} seen")
        if kind == KIND_SLIDING and (window < 2 or t != min(seen, window - 1)):
            raise KVPayloadError(f"sliding layer {i} holds {t} tokens after {seen} seen with window {window}: "
                                 "expected window >= 2 and min(seen, window - 1) tokens")
        layer = DynamicSlidingWindowLayer(sliding_window=window) if kind == KIND_SLIDING else DynamicLayer()
        keys = torch.from_numpy(dequantize(kq)).to(device=device, dtype=dtype)
        values = torch.from_numpy(dequantize(vq)).to(device=device, dtype=dtype)
        layer.update(keys, values)  # t <= window - 1: the sliding layer keeps all of it
        if kind == KIND_SLIDING:
            layer.cumulative_length = seen
        layers.append(layer)
    if off != len(buf):
        raise KVPayloadError(f"{len(buf) - off} trailing bytes after {n_layers} layers")
    cache = DynamicCache()
    cache.layers = layers
    return cache


__all__ = ["KVPayloadError", "encode_kv_cache", "decode_kv_cache", "MAGIC", "VERSION", "MAX_LAYERS"]
